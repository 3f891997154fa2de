"""vLLM (CPU build) as a receiver runtime, updated in place through vLLM's own loader.

``adapter``: ``RuntimeAdapter`` over one worker's model (staging of packed weights, the
decision and its costs in its docstring); ``extension``: the worker extension holding one
``DeltaApplier`` per worker; ``runtime``: ``VLLMRuntime``, the main-process facade.
Importing this package does not import vLLM (``VLLMRuntime.start`` does).
"""
from nemo_dcr.runtimes.vllm.runtime import VLLMRuntime

__all__ = ["VLLMRuntime"]
