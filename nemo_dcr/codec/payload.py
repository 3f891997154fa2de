"""Record payloads: the byte forms of one record's (positions, values), by the codings table.

``encode_payload`` tries the codings that apply (``default_codings``) and keeps the smallest, so a record
never costs more than its dense bytes (``DENSE_RAW``), except an overwrite that leaves some
elements of its range alone, which cannot be dense without the base and then costs at most
``SPARSE_RAW``.  ``check_payload_size`` bounds what a record declares by its payload length,
from the directory alone; ``decode_payload`` runs it again before it allocates.  What each
coding is and does is its row in ``codings.py``; nothing here names a coding but the
encoder's default choice.
"""
from __future__ import annotations

import numpy as np

from nemo_dcr.codec import bucket, lanes, model
from nemo_dcr.codec.codings import CODINGS, ENTROPY_CODINGS, row
from nemo_dcr.codec.format import ChunkFormatError, Coding
from nemo_dcr.codec.record import RecordSpec
from nemo_dcr.errors import ValidationError


def check_payload_size(spec: RecordSpec, coding: Coding, payload_len: int) -> None:
    """Refuse a record whose declared entries its payload cannot hold: exact for the raw
    codings, a sound expansion bound for the others (each row's ``check_size``).  Needs only
    the directory; raises ChunkFormatError."""
    r = row(coding)
    if spec.param and not r.takes_param:
        raise ChunkFormatError(f"coding {coding.name} takes no parameter, got {spec.param}")
    r.check_size(spec, payload_len)


#: Ranges below this many elements also try the MODEL coding: its per-record overhead is a
#: byte or two where BUCKET's is ~12, and at this size its per-element speed does not matter.
MODEL_TRIAL_MAX_RANGE = 1 << 14

#: Context-mode records of at least this many changed elements (and ``LANES_MIN_RANGE`` elements
#: of range) are coded LANES alone by default: whole chunks of it decode 1.3-2.2x faster than
#: BUCKET's in context mode (issue 34's vector walks; benchmarks/results/codec.json) and encode
#: faster; below, its static tables' bytes show.  From 2^12 (was 2^13) the mid-size matrices of
#: the benchmark models go LANES: context chunks 0-0.8% larger, 0.648x the bound at most
#: (docs/benchmarks.md "Codec").  Context-free, LANES decodes faster but encodes slower than
#: BUCKET, so BUCKET stays.
LANES_MIN_NNZ = 1 << 12
LANES_MIN_RANGE = 1 << 14


def default_codings(spec: RecordSpec, context: bool = False) -> frozenset[Coding]:
    """In context mode, LANES alone for records with at least ``LANES_MIN_NNZ`` changes over at
    least ``LANES_MIN_RANGE`` elements; else BUCKET, plus a MODEL trial for small ranges; the
    zstd fallback where the native coders are not built.  One trial per large record keeps the
    encoder fast."""
    if context and lanes.available() and spec.nnz >= LANES_MIN_NNZ and spec.range_len >= LANES_MIN_RANGE:
        return frozenset({Coding.LANES})
    out = set()
    if bucket.available():
        out.add(Coding.BUCKET)
    if model.available() and (not out or spec.range_len < MODEL_TRIAL_MAX_RANGE):
        out.add(Coding.MODEL)
    return frozenset(out or {Coding.SPARSE_ZSTD})


def encode_payload(spec: RecordSpec, positions: np.ndarray, values: np.ndarray,
                   base: np.ndarray | None, states: model.ModelStates | None,
                   codings: frozenset[Coding] | None = None) -> tuple[Coding, int, bytes]:
    """(coding, param, payload) with the smallest payload; ``base`` (full flat base bits)
    enables context mode.  ``states`` is the chunk's adaptive state (None: no stateful
    coding); ``codings`` the entropy codings to try (default ``default_codings``).  SPARSE_ZSTD
    is also the fallback wherever no native entropy coder was tried."""
    use = default_codings(spec, base is not None) if codings is None else codings
    if not use <= ENTROPY_CODINGS:
        raise ValidationError(f"codings must be a subset of {sorted(c.name for c in ENTROPY_CODINGS)}")
    trials = {}
    for c, r in CODINGS.items():
        if c is Coding.SPARSE_ZSTD or (r.entropy and c not in use) or not r.available():
            continue
        t = r.trial(spec, positions, values, base, states)
        if t is not None:
            trials[c] = t
    native = any(CODINGS[c].entropy for c in trials)
    if Coding.SPARSE_ZSTD in use or not native:
        t = CODINGS[Coding.SPARSE_ZSTD].trial(spec, positions, values, base, states)
        if t is not None:
            trials[Coding.SPARSE_ZSTD] = t
    coding = min(trials, key=lambda c: (trials[c].size, int(c)))  # ties go to the simpler coding
    t = trials[coding]
    if t.commit is not None:
        t.commit()
    payload = t.payload if t.payload is not None else CODINGS[coding].materialize(spec, positions, values)
    assert len(payload) == t.size
    return coding, t.param, payload


def decode_payload(spec: RecordSpec, coding: Coding, payload: memoryview,
                   base: np.ndarray | None, states: model.ModelStates,
                   size_checked: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, values BITS_DTYPE) of a record; raises ChunkFormatError.
    ``size_checked``: the caller ran ``check_payload_size`` on this spec and length already
    (the chunk decoder does, for every record, before decoding any)."""
    if not size_checked:
        check_payload_size(spec, coding, len(payload))
    r = CODINGS[coding]
    if not r.available():
        raise ChunkFormatError(f"record needs {r.native}, not built")
    return r.decode(spec, payload, base, states)
