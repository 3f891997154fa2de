"""Bucketed coding (``Coding.BUCKET``): a record's payload coded by the native rANS coder.

``codec/csrc/rans.c`` documents the coding and docs/wire-format.md specifies it.  In short:
changed positions are gaps between ranks *within the base exponent's bucket* (context mode)
or between positions (context-free), values are ulp counts (context mode) or XOR patterns,
and everything is adaptive rANS with raw low bits, visiting only changed elements plus one
vectorised pass over the base.  The directory entry's parameter is ``e_lo`` as for MODEL.

The adaptive state is shared by the BUCKET records of one chunk with the same (dtype,
mode), in record order (``ModelStates``), so a chunk's BUCKET records decode in order.
"""
from __future__ import annotations

import numpy as np

from nemo_dcr.codec.format import c_decode
from nemo_dcr.codec.model import ModelStates, coder_params
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp

try:
    from nemo_dcr.codec import _crans
except ImportError:  # not built: the payload layer uses the other codings
    _crans = None

#: Least number of bits one changed element costs in a BUCKET payload: its gap quotient and
#: its value's bit length are rANS symbols of alphabets of at least 32 and 9 symbols, each
#: given at least 1 of 4096, so neither is ever likelier than (4096 - 31) / 4096 resp.
#: (4096 - 8) / 4096: -log2 of their product is 0.01379 bits.  ``max_entries`` uses 1/73.
_MIN_BITS_NUM, _MIN_BITS_DEN = 1, 73


def available() -> bool:
    return _crans is not None


def simd() -> str:
    """The block-scan path the native coder uses here (``avx512bw``, ``avx2`` or ``scalar``;
    ``NEMO_DCR_NO_SIMD=1`` at import forces ``scalar``)."""
    return _crans.simd() if _crans is not None else "unavailable"


def max_entries(payload_len: int) -> int:
    """Most entries a BUCKET payload of ``payload_len`` bytes can decode to (sound, loose):
    the payload holds two 32-bit final states, 16-bit words and raw bits, so it carries at
    most ``8 * payload_len`` bits of coded information, and every entry costs at least
    ``1/73`` bit."""
    return (8 * payload_len) * _MIN_BITS_DEN // _MIN_BITS_NUM + 1


def _init_state(dtype: str, context: bool, nbytes: int | None = None) -> np.ndarray:
    """A fresh state: decoders need ``MODEL_BYTES`` (with the decode tables); an encoder's
    ``ENC_BYTES`` leaves them out, so its per-record trial copy is small."""
    st = np.empty(_crans.MODEL_BYTES if nbytes is None else nbytes, dtype=np.uint8)
    _crans.model_init(st, BITS_DTYPE[dtype].itemsize, int(context))
    return st


def _init_encoder_state(dtype: str, context: bool) -> np.ndarray:
    return _init_state(dtype, context, _crans.ENC_BYTES)


def encode(spec, positions: np.ndarray, values: np.ndarray, base: np.ndarray | None,
           states: ModelStates) -> tuple[bytes, int, np.ndarray]:
    """(payload, e_lo, state after it): the caller ``put_bucket``s the state only if it
    keeps the payload, so a trial encoding that loses leaves no trace."""
    width, eshift, ebits = coder_params(spec.dtype)
    context = base is not None
    e_lo = _crans.choose_e_lo(base, spec.lo, spec.hi, width, eshift, ebits) if context else 0
    state = states.get_bucket(spec.dtype, context, _init_encoder_state).copy()
    payload = _crans.encode(
        state, np.ascontiguousarray(positions, dtype=np.int64), np.ascontiguousarray(values),
        None if base is None else np.ascontiguousarray(base),
        spec.lo, spec.hi, width, eshift, ebits, e_lo, 0 if spec.op is DeltaOp.XOR else 1,
    )
    return payload, e_lo, state


def decode(spec, payload: memoryview, base: np.ndarray | None, states: ModelStates) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of a BUCKET record; ``spec.nnz`` was checked against the limits,
    so the output arrays are allocated before decoding and never grow."""
    width, eshift, ebits = coder_params(spec.dtype)
    pos = np.empty(spec.nnz, dtype=np.int64)
    val = np.empty(spec.nnz, dtype=BITS_DTYPE[spec.dtype])
    state = states.get_bucket(spec.dtype, base is not None, _init_state)
    c_decode("BUCKET", _crans.decode, state, payload, spec.nnz, None if base is None else np.ascontiguousarray(base),
             spec.lo, spec.hi, width, eshift, ebits, spec.param, 0 if spec.op is DeltaOp.XOR else 1, pos, val)
    return pos, val
