"""Apply a decoded delta to a tensor's canonical bits, in place."""
from __future__ import annotations

import numpy as np

from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.errors import ValidationError


def apply_delta_(bits: np.ndarray, delta: TensorDelta) -> None:
    """XOR (``DeltaOp.XOR``) or overwrite (``DeltaOp.OVERWRITE``) ``delta`` into ``bits``.

    ``bits`` is the flat, writable ``BITS_DTYPE[delta.dtype]`` view of the whole canonical
    tensor.  Everything is checked before the first write, so a mismatch raises
    ``ValueError`` with ``bits`` untouched.  Extra memory: one gather of ``nnz`` elements.
    """
    want = BITS_DTYPE[delta.dtype]
    if not isinstance(bits, np.ndarray) or bits.dtype != want or bits.ndim != 1:
        got = f"{bits.dtype}{list(bits.shape)}" if isinstance(bits, np.ndarray) else type(bits).__name__
        raise ValidationError(f"{delta.name}: target must be a flat {want} array, got {got}")
    if bits.size != delta.numel:
        raise ValidationError(f"{delta.name}: target has {bits.size} elements, delta is for {delta.numel}")
    if not bits.flags.writeable:
        raise ValidationError(f"{delta.name}: target array is read-only")
    if delta.nnz == 0:
        return
    if delta.op is DeltaOp.XOR:
        # positions are unique (TensorDelta checks), so the fancy-index read-modify-write is exact.
        bits[delta.positions] ^= delta.values
    else:
        bits[delta.positions] = delta.values
