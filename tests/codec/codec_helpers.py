"""Shared helpers for the codec tests: build deltas from (base, target) bit arrays."""
from __future__ import annotations

import numpy as np

import pytest

from nemo_dcr.codec import BITS_DTYPE, DeltaOp, TensorDelta, model

#: Tests of the MODEL coding (and so of context mode) need the native coder built
#: (`make setup`); without it the codec falls back to zstd and those tests are skipped.
needs_native = pytest.mark.skipif(not model.available(), reason="native range coder (_cans) not built")

FLOAT_SPECIALS = {
    # NaNs with payloads, +-Inf, +-0, subnormals, max finite
    "bfloat16": [0x7FC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x7F7F],
    "float16": [0x7E00, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x7BFF],
    "float32": [0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1],
    "float8_e4m3fn": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x7E],
    "float8_e5m2": [0x7C, 0x7D, 0xFF, 0x00, 0x80, 0x01],
}


def random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    bits = BITS_DTYPE[dtype]
    info = np.iinfo(bits)
    return rng.integers(0, int(info.max), size=n, dtype=bits, endpoint=True)


def xor_delta(name: str, dtype: str, shape: tuple[int, ...], base: np.ndarray, target: np.ndarray,
              element_range: tuple[int, int] | None = None) -> TensorDelta:
    lo, hi = element_range if element_range is not None else (0, base.size)
    x = base[lo:hi] ^ target[lo:hi]
    rel = np.flatnonzero(x)
    return TensorDelta(name=name, dtype=dtype, shape=shape, op=DeltaOp.XOR,
                       positions=(rel + lo).astype(np.int64), values=x[rel], element_range=(lo, hi))


def overwrite_delta(name: str, dtype: str, shape: tuple[int, ...], positions: np.ndarray, target: np.ndarray,
                    element_range: tuple[int, int] | None = None) -> TensorDelta:
    positions = np.asarray(positions, dtype=np.int64)
    return TensorDelta(name=name, dtype=dtype, shape=shape, op=DeltaOp.OVERWRITE,
                       positions=positions, values=target[positions].copy(), element_range=element_range)
