"""Serving runtimes the receiver updates in place, one adapter per runtime.

``base`` holds the seam (``RuntimeAdapter``, ``TensorSpec``); ``hf`` adapts Hugging Face
transformers models.  Importing this package does not import any runtime.
"""
from nemo_dcr.runtimes.base import RuntimeAdapter, TensorSpec, dtype_name, torch_dtype

__all__ = ["RuntimeAdapter", "TensorSpec", "dtype_name", "torch_dtype"]
