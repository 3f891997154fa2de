"""LANES coding (``Coding.LANES``, 5): BUCKET's modelling with static per-record tables and
16 interleaved rANS lanes, coded by the native coder (``codec/csrc/lanes.c``, built into
``_crans``).  docs/wire-format.md "LANES" specifies it; ``lanes_ref.py`` is its pure-Python
twin.

Each record decodes alone (no state shared between records), so a LANES record can be
decoded, skipped or retried independently.  The directory entry's parameter is ``e_lo`` as
for BUCKET.  The decoder runs 8 lanes per AVX2 vector where the CPU has AVX2
(``_crans.set_simd`` / ``NEMO_DCR_NO_SIMD=1`` select the scalar twin; same bytes, same arrays).
"""
from __future__ import annotations

import numpy as np

from nemo_dcr.codec.format import Coding, c_decode
from nemo_dcr.codec.model import coder_params
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp

try:
    from nemo_dcr.codec import _crans
except ImportError:  # not built: the payload layer uses the other codings
    _crans = None

#: The coding this module implements (for callers that list candidate codings).
CODING = Coding.LANES

#: Most entries one byte of a LANES payload can code (``max_entries``).  Every entry codes at
#: least two rANS symbols (its gap quotient and its value's bit length); a table gives no
#: symbol more than 4080 of 4096 slots, so decoding a symbol from a state x in [2^16, 2^32)
#: leaves at most x (1 - 1/272) (it removes (4096 - f) floor(x / 4096) + cum >= 16 * 16 of
#: every 4096 * 17): at least log2(272/271) = 0.0053 bits.  A byte of the rANS section adds
#: at most 8 + 0.044 bits to the states (a word is read into a state of at least 16), raw
#: bytes add none, so a byte codes at most 8.044 / 0.0053 / 2 < 757 entries.
ENTRIES_PER_BYTE = 757


def available() -> bool:
    return _crans is not None and hasattr(_crans, "lanes_encode")


def max_entries(payload_len: int) -> int:
    """Most entries a LANES payload of ``payload_len`` bytes can decode to (sound, loose)."""
    return ENTRIES_PER_BYTE * payload_len + 1


def encode(spec, positions: np.ndarray, values: np.ndarray, base: np.ndarray | None) -> tuple[bytes, int]:
    """(payload, e_lo) of a record; context mode when ``base`` (full flat base bits) is given."""
    width, eshift, ebits = coder_params(spec.dtype)
    e_lo = _crans.choose_e_lo(base, spec.lo, spec.hi, width, eshift, ebits) if base is not None else 0
    payload = _crans.lanes_encode(
        np.ascontiguousarray(positions, dtype=np.int64), np.ascontiguousarray(values),
        None if base is None else np.ascontiguousarray(base),
        spec.lo, spec.hi, width, eshift, ebits, e_lo, 0 if spec.op is DeltaOp.XOR else 1,
    )
    return payload, e_lo


def decode(spec, payload: memoryview, base: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of a LANES record; ``spec.nnz`` was admitted (``max_entries``,
    the chunk limits), so the output arrays are allocated before decoding and never grow."""
    width, eshift, ebits = coder_params(spec.dtype)
    pos = np.empty(spec.nnz, dtype=np.int64)
    val = np.empty(spec.nnz, dtype=BITS_DTYPE[spec.dtype])
    c_decode("LANES", _crans.lanes_decode, payload, spec.nnz, None if base is None else np.ascontiguousarray(base),
             spec.lo, spec.hi, width, eshift, ebits, spec.param, 0 if spec.op is DeltaOp.XOR else 1, pos, val)
    return pos, val
