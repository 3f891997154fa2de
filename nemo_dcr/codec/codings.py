"""The codings table: one row per record coding, everything the payload layer, the chunk
admission and the sender need to know about it.

A coding is a ``Coding`` value (``codec/format.py``, the record's coding byte), its coder
module, and one row here: whether it is built here (``available``), the bound on the entries
a payload of a given length can declare, checked from the directory before anything is
decoded (``check_size``), how to try it on a record (``trial``; None: only a fallback or
never chosen by the encoder) and how to decode it (``decode``), whether it takes the
directory's parameter byte, whether it shares adaptive state with the chunk's earlier
records of its (dtype, mode) (``stateful``: such records decode in order), and whether it
reads the record's base range even without context (``always_scans``).
``docs/wire-format.md`` specifies each.

Every row's ``decode`` returns positions strictly increasing inside the record's range, by
construction (the native coders: gaps of at least 1, walks in range order, each checked
against the range; DENSE_RAW: the nonzero elements in order) or by a check (the sparse raw
codings), so the chunk decoder builds its ``TensorDelta`` without that O(nnz) pass again
(``tests/codec/test_codings_table.py`` holds each row to it on hostile payloads).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nemo_dcr.codec import bucket, lanes, model, raw
from nemo_dcr.codec.format import CONTEXT_CODINGS, ChunkFormatError, Coding
from nemo_dcr.codec.record import RecordSpec


@dataclass
class Trial:
    """One coding tried on a record: its payload size, and what choosing it takes."""

    size: int
    payload: bytes | None = None
    """The coded bytes (None: made only if chosen, ``CodingRow.materialize``)."""
    param: int = 0
    commit: Callable[[], None] | None = None
    """Keeps the adaptive state the trial ended in (run only if this coding is chosen)."""


@dataclass(frozen=True)
class CodingRow:
    coding: Coding
    available: Callable[[], bool]
    check_size: Callable[[RecordSpec, int], None]
    decode: Callable[[RecordSpec, memoryview, np.ndarray | None, model.ModelStates], tuple[np.ndarray, np.ndarray]]
    trial: Callable[..., Trial | None] | None = None
    materialize: Callable[[RecordSpec, np.ndarray, np.ndarray], bytes] | None = None
    entropy: bool = True
    """Chosen only when listed (``encode_payload(codings=...)``); the raw codings always compete."""
    takes_param: bool = False
    stateful: bool = False
    always_scans: bool = False
    native: str = ""
    """The extension the coder needs (named when a record needs it and it is not built)."""

    @property
    def context(self) -> bool:
        """It may decode against the base (the record's context flag)."""
        return self.coding in CONTEXT_CODINGS


def _bounded(max_entries: Callable[[RecordSpec, int], int], name: str) -> Callable[[RecordSpec, int], None]:
    def check(spec: RecordSpec, payload_len: int) -> None:
        cap = max_entries(spec, payload_len)
        if spec.nnz > cap:
            raise ChunkFormatError(f"nnz {spec.nnz} is more than a {name} payload_len of {payload_len} can code "
                                   f"(at most {cap})")
    return check


def _dense_trial(spec, positions, values, base, states) -> Trial | None:
    return Trial(raw.dense_size(spec)) if raw.dense_ok(spec) else None


def _sparse_trial(spec, positions, values, base, states) -> Trial:
    return Trial(raw.sparse_size(spec))


def _zstd_trial(spec, positions, values, base, states) -> Trial | None:
    if not spec.nnz:
        return None
    coded = raw.encode_zstd(spec, positions, values)
    return Trial(len(coded), coded)


def _model_trial(spec, positions, values, base, states) -> Trial | None:
    if states is None:
        return None
    coded, e_lo, st = model.encode(spec, positions, values, base, states)
    return Trial(len(coded), coded, e_lo, lambda: states.put(spec.dtype, base is not None, st))


def _bucket_trial(spec, positions, values, base, states) -> Trial | None:
    if states is None:
        return None
    coded, e_lo, st = bucket.encode(spec, positions, values, base, states)
    return Trial(len(coded), coded, e_lo, lambda: states.put_bucket(spec.dtype, base is not None, st))


def _lanes_trial(spec, positions, values, base, states) -> Trial:
    coded, e_lo = lanes.encode(spec, positions, values, base)
    return Trial(len(coded), coded, e_lo)


def _always() -> bool:
    return True


CODINGS: dict[Coding, CodingRow] = {row.coding: row for row in (
    CodingRow(Coding.DENSE_RAW, _always, raw.check_dense_size, lambda s, p, b, st: raw.decode_dense(s, p),
              _dense_trial, raw.encode_dense, entropy=False),
    CodingRow(Coding.SPARSE_RAW, _always, raw.check_sparse_size, lambda s, p, b, st: raw.decode_sparse(s, p),
              _sparse_trial, raw.encode_sparse, entropy=False),
    CodingRow(Coding.SPARSE_ZSTD, _always, raw.check_zstd_size, lambda s, p, b, st: raw.decode_zstd(s, p),
              _zstd_trial),
    CodingRow(Coding.MODEL, model.available, _bounded(lambda s, n: model.max_entries(s.dtype, n), "MODEL"),
              model.decode, _model_trial, takes_param=True, stateful=True, always_scans=True,
              native="the native range coder (nemo_dcr.codec._cans)"),
    CodingRow(Coding.BUCKET, bucket.available, _bounded(lambda s, n: bucket.max_entries(n), "BUCKET"),
              bucket.decode, _bucket_trial, takes_param=True, stateful=True,
              native="the native rANS coder (nemo_dcr.codec._crans)"),
    CodingRow(Coding.LANES, lanes.available, _bounded(lambda s, n: lanes.max_entries(n), "LANES"),
              lambda s, p, b, st: lanes.decode(s, p, b), _lanes_trial, takes_param=True,
              native="the native rANS coder (nemo_dcr.codec._crans)"),
)}
"""Every coding a record may carry, in coding-id order (ties in size go to the lower id)."""

ENTROPY_CODINGS = frozenset(c for c, row in CODINGS.items() if row.entropy)
"""Codings ``encode_payload`` chooses from when asked (the raw codings are always candidates)."""
STATEFUL_CODINGS = frozenset(c for c, row in CODINGS.items() if row.stateful)


def row(coding: Coding) -> CodingRow:
    try:
        return CODINGS[coding]
    except KeyError:
        raise ChunkFormatError(f"unknown coding {coding!r}") from None
