"""vLLM (CPU build) as a receiver runtime, updated in place through vLLM's own loader.

``adapter``: ``RuntimeAdapter`` over one worker's model (staging of packed weights, the
decision and its costs in its docstring); ``backend``: the weight-transfer backend engine
every worker runs (``tp.py`` across TP workers); ``extension``: the worker steps on its
``DeltaApplier``; ``runtime``: ``VLLMRuntime``, the main-process facade of ``nemo-dcr
receive`` over engines built with the backend.
Importing this package does not import vLLM (``VLLMRuntime.start`` does).
"""
from nemo_dcr.runtimes.vllm.runtime import VLLMRuntime

__all__ = ["VLLMRuntime"]
