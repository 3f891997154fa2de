"""Modelled coding (``Coding.MODEL``): a record's payload coded by the native range coder.

The payload is the range-coded stream alone (``codec/csrc/ans.c`` documents the models).
The record's directory entry carries the one parameter, ``e_lo``: the base exponent that
maps to the lowest exponent bucket in context mode (0 otherwise).

The adaptive model state is shared by the MODEL records of one chunk that have the same
(dtype, mode), in record order: what the first tensors taught the model is not paid for
again by the next ones.  So a chunk's MODEL records decode in order (``ModelStates``).
"""
from __future__ import annotations

import numpy as np

from nemo_dcr import dtypes
from nemo_dcr.codec.format import c_decode
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp

try:
    from nemo_dcr.codec import _cans
except ImportError:  # not built: the payload layer falls back to zstd
    _cans = None

NEXP = 32  # exponent buckets, as in ans.c

#: (exponent shift, exponent bits) of each float dtype; integers have none (bits 0).
#: A view of ``nemo_dcr.dtypes``.
EXPONENT_FIELD: dict[str, tuple[int, int]] = {
    d.name: d.exponent for d in dtypes.DTYPES.values() if d.exponent is not None
}


def available() -> bool:
    return _cans is not None and hasattr(_cans, "encode")


#: Bytes the MODEL decoder reads as zeros past the end of a stream before it rejects it
#: (``MAX_STRIP`` in ``csrc/ans.c``).
MODEL_MAX_STRIP = 4

#: Upper bound on the binary decisions one byte of MODEL stream can code, as a fraction
#: ``_MODEL_DECISIONS_NUM / _MODEL_DECISIONS_DEN``.  Every decision shrinks the coder's range
#: by a factor of at most ``1 - 2**-24`` (probabilities are clamped to ``[2**-23, 1 - 2**-23]``
#: and the range is at least ``2**24``), i.e. costs at least ``2**-24 / ln 2`` bits, so one
#: byte buys at most ``8 * 2**24 * ln 2`` decisions; ``45427 / 65536 > ln 2``.
_MODEL_DECISIONS_NUM = 8 * (1 << 24) * 45427
_MODEL_DECISIONS_DEN = 1 << 16


def max_entries(dtype: str, payload_len: int) -> int:
    """Most entries a MODEL payload of ``payload_len`` bytes can decode to (sound, loose).

    The decoder consumes at most ``payload_len + MODEL_MAX_STRIP`` bytes (4 of them at start)
    before an element boundary, and codes every entry's magnitude with a ``bitlen(W)``-level
    bit tree, so an entry costs at least ``bitlen(W)`` decisions.  An adaptive coder can
    make repeated symbols nearly free, so this allows ~1.9e7 bf16 entries per byte: it stops
    absurd claims, while the receiver's shapes and the version budget bound the rest.
    """
    hbits = (8 * BITS_DTYPE[dtype].itemsize).bit_length()
    decisions = (payload_len + MODEL_MAX_STRIP - 3) * _MODEL_DECISIONS_NUM // _MODEL_DECISIONS_DEN
    return decisions // hbits + 1


def coder_params(dtype: str) -> tuple[int, int, int]:
    """(width, exponent shift, exponent bits) of a dtype."""
    d = dtypes.DTYPES[dtype]
    eshift, ebits = d.exponent or (0, 0)
    return d.width, eshift, ebits


class ModelStates:
    """Adaptive state of each (coding, dtype, context mode) within one chunk, encoder or
    decoder: the MODEL coding's (``get``/``put``) and the BUCKET coding's (``codec/bucket.py``,
    ``get_bucket``/``put_bucket``) are separate states."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, str, bool], np.ndarray] = {}

    def get(self, dtype: str, context: bool) -> np.ndarray:
        key = ("model", dtype, context)
        st = self._states.get(key)
        if st is None:
            st = np.empty(_cans.MODEL_BYTES, dtype=np.uint8)
            _cans.model_init(st)
            self._states[key] = st
        return st

    def put(self, dtype: str, context: bool, state: np.ndarray) -> None:
        self._states[("model", dtype, context)] = state

    def get_bucket(self, dtype: str, context: bool, init) -> np.ndarray:
        key = ("bucket", dtype, context)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = init(dtype, context)
        return st

    def put_bucket(self, dtype: str, context: bool, state: np.ndarray) -> None:
        self._states[("bucket", dtype, context)] = state


def choose_e_lo(dtype: str, base_range: np.ndarray) -> int:
    """Lowest-bucket exponent: the NEXP buckets end at the largest finite exponent."""
    eshift, ebits = EXPONENT_FIELD.get(dtype, (0, 0))
    if not ebits or base_range.size == 0:
        return 0
    field = np.asarray(((1 << ebits) - 1) << eshift, dtype=base_range.dtype)
    top = int(np.bitwise_and(base_range, field).max()) >> eshift  # one pass over the range
    if top == (1 << ebits) - 1:  # Inf/NaN present: the largest finite exponent, slower
        e = (base_range >> eshift) & ((1 << ebits) - 1)
        finite = e[e != (1 << ebits) - 1]
        if finite.size == 0:
            return 0
        top = int(finite.max())
    return max(0, top - (NEXP - 1))


def encode(spec, positions: np.ndarray, values: np.ndarray, base: np.ndarray | None,
           states: ModelStates) -> tuple[bytes, int, np.ndarray]:
    """(payload, e_lo, model state after it): the caller ``put``s the state only if it keeps
    the payload, so a trial encoding that loses to another coding leaves no trace."""
    width, eshift, ebits = coder_params(spec.dtype)
    e_lo = choose_e_lo(spec.dtype, base[spec.lo : spec.hi]) if base is not None else 0
    state = states.get(spec.dtype, base is not None).copy()
    stream = _cans.encode(
        state, np.ascontiguousarray(positions, dtype=np.int64), np.ascontiguousarray(values),
        None if base is None else np.ascontiguousarray(base),
        spec.lo, spec.hi, width, eshift, ebits, e_lo, 0 if spec.op is DeltaOp.XOR else 1,
    )
    return stream, e_lo, state


def decode(spec, payload: memoryview, base: np.ndarray | None,
           states: ModelStates) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of a MODEL record; ``spec.nnz`` was checked against the limits,
    so the output arrays are allocated before decoding and never grow."""
    width, eshift, ebits = coder_params(spec.dtype)
    pos = np.empty(spec.nnz, dtype=np.int64)
    val = np.empty(spec.nnz, dtype=BITS_DTYPE[spec.dtype])
    state = states.get(spec.dtype, base is not None)
    c_decode("MODEL", _cans.decode, state, payload, spec.nnz, None if base is None else np.ascontiguousarray(base),
             spec.lo, spec.hi, width, eshift, ebits, spec.param, 0 if spec.op is DeltaOp.XOR else 1, pos, val)
    return pos, val
