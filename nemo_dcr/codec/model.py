"""Modelled coding (``Coding.MODEL``): thin wrapper over the native range coder."""
from __future__ import annotations

import numpy as np

try:
    from nemo_dcr.codec import _cans
except ImportError:  # not built: the payload layer falls back to zstd
    _cans = None


def available() -> bool:
    return _cans is not None and hasattr(_cans, "encode")


def encode(spec, positions: np.ndarray, values: np.ndarray, base: np.ndarray | None) -> bytes:
    raise NotImplementedError


def decode(spec, payload, base):
    raise NotImplementedError
