"""Record payloads: the byte forms of one record's (positions, values).

``encode_payload`` tries the codings that apply (``default_codings``) and keeps the smallest, so a record
never costs more than its dense bytes (``DENSE_RAW``), except an overwrite that leaves some
elements of its range alone, which cannot be dense without the base and then costs at most
``SPARSE_RAW``.  ``check_payload_size`` bounds what a record declares by its payload length,
from the directory alone; ``decode_payload`` runs it again before it allocates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from nemo_dcr.codec import bucket, lanes, model
from nemo_dcr.codec.format import ChunkFormatError, Coding
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp
from nemo_dcr.errors import ValidationError

ZSTD_LEVEL = 3

#: Most bytes a zstd frame inflates to per byte of frame.  A block outputs at most 128 KiB
#: (the format's Block_Maximum_Size) and costs at least 4 bytes (3-byte block header + the
#: one byte of an RLE block), so no frame exceeds 2**17 / 4 = 32768x (64 MiB of zeros
#: compresses to 32546x at level 19).
ZSTD_MAX_RATIO = 1 << 15

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


@dataclass(frozen=True)
class RecordSpec:
    """What a payload is about (everything in the record header except the payload)."""

    dtype: str
    shape: tuple[int, ...]
    op: DeltaOp
    lo: int
    hi: int
    nnz: int
    param: int = 0
    """Coding parameter from the directory entry (MODEL, BUCKET: e_lo; others: 0)."""

    def __post_init__(self) -> None:
        if self.dtype not in BITS_DTYPE:
            raise ValidationError(f"unsupported dtype {self.dtype!r}")
        if not (0 <= self.lo <= self.hi) or not (0 <= self.nnz <= self.hi - self.lo):
            raise ValidationError(f"inconsistent record: range [{self.lo}, {self.hi}), {self.nnz} entries")
        if not 0 <= self.param <= 255:
            raise ValidationError(f"coding parameter {self.param} outside u8")

    @property
    def width(self) -> int:
        return BITS_DTYPE[self.dtype].itemsize

    @property
    def range_len(self) -> int:
        return self.hi - self.lo


def model_max_entries(dtype: str, payload_len: int) -> int:
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


def check_payload_size(spec: RecordSpec, coding: Coding, payload_len: int) -> None:
    """Refuse a record whose declared entries its payload cannot hold: exact for the raw
    codings, a sound expansion bound for zstd (``ZSTD_MAX_RATIO``) and MODEL
    (``model_max_entries``).  Needs only the directory; raises ChunkFormatError."""
    w = spec.width
    if spec.param and coding not in (Coding.MODEL, Coding.BUCKET, Coding.LANES):
        raise ChunkFormatError(f"coding {coding.name} takes no parameter, got {spec.param}")
    if coding is Coding.DENSE_RAW:
        if payload_len != spec.range_len * w:
            raise ChunkFormatError(f"dense payload_len is {payload_len} bytes, range needs {spec.range_len * w}")
        if spec.op is DeltaOp.OVERWRITE and spec.nnz != spec.range_len:
            raise ChunkFormatError(f"dense overwrite must cover its whole range: nnz {spec.nnz}, "
                                   f"range {spec.range_len}")
    elif coding is Coding.SPARSE_RAW:
        if payload_len != spec.nnz * (8 + w):
            raise ChunkFormatError(f"sparse payload_len is {payload_len} bytes, nnz {spec.nnz} needs "
                                   f"{spec.nnz * (8 + w)}")
    elif coding is Coding.SPARSE_ZSTD:
        want = spec.nnz * (_gap_dtype(spec).itemsize + w)
        if want == 0:
            raise ChunkFormatError("zstd coding of an empty record")
        if want > ZSTD_MAX_RATIO * payload_len:
            raise ChunkFormatError(f"nnz {spec.nnz} needs {want} inflated bytes, more than a zstd payload_len of "
                                   f"{payload_len} can hold (at most {ZSTD_MAX_RATIO}x)")
    elif coding is Coding.MODEL:
        cap = model_max_entries(spec.dtype, payload_len)
        if spec.nnz > cap:
            raise ChunkFormatError(f"nnz {spec.nnz} is more than a MODEL payload_len of {payload_len} can code "
                                   f"(at most {cap})")
    elif coding is Coding.BUCKET:
        cap = bucket.max_entries(payload_len)
        if spec.nnz > cap:
            raise ChunkFormatError(f"nnz {spec.nnz} is more than a BUCKET payload_len of {payload_len} can code "
                                   f"(at most {cap})")
    elif coding is Coding.LANES:
        cap = lanes.max_entries(payload_len)
        if spec.nnz > cap:
            raise ChunkFormatError(f"nnz {spec.nnz} is more than a LANES payload_len of {payload_len} can code "
                                   f"(at most {cap})")
    else:
        raise ChunkFormatError(f"unknown coding {coding!r}")


def _le(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _gap_dtype(spec: RecordSpec) -> np.dtype:
    return np.dtype("<u4") if spec.range_len <= 1 << 32 else np.dtype("<u8")


#: Ranges below this many elements also try the MODEL coding: its per-record overhead is a
#: byte or two where BUCKET's is ~12, and at this size its per-element speed does not matter.
MODEL_TRIAL_MAX_RANGE = 1 << 14

#: Entropy codings ``encode_payload`` may choose from (the raw codings are always candidates).
ENTROPY_CODINGS = frozenset({Coding.SPARSE_ZSTD, Coding.MODEL, Coding.BUCKET, Coding.LANES})


#: Context-mode records of at least this many changed elements (and ``LANES_MIN_RANGE`` elements
#: of range) are coded LANES alone by default: there its static tables cost less than BUCKET's
#: adaptive learning and it decodes faster (and encodes about as fast); below, the tables' cost
#: shows.  Context-free, LANES decodes faster but encodes slower than BUCKET, so BUCKET stays
#: (docs/benchmarks.md "Codec").
LANES_MIN_NNZ = 1 << 13
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
    enables context mode.  ``states`` is the chunk's adaptive state (None: no MODEL or
    BUCKET coding); ``codings`` the entropy codings to try (default ``default_codings``)."""
    w = spec.width
    cands: list[tuple[int, Coding, bytes | None]] = []
    dense_ok = spec.op is DeltaOp.XOR or spec.nnz == spec.range_len
    if dense_ok:
        cands.append((spec.range_len * w, Coding.DENSE_RAW, None))
    cands.append((spec.nnz * (8 + w), Coding.SPARSE_RAW, None))
    use = default_codings(spec, base is not None) if codings is None else codings
    if not use <= ENTROPY_CODINGS:
        raise ValidationError(f"codings must be a subset of {sorted(c.name for c in ENTROPY_CODINGS)}")
    trials: dict[Coding, tuple[int, np.ndarray]] = {}
    if states is not None and Coding.MODEL in use and model.available():
        coded, e_lo, st = model.encode(spec, positions, values, base, states)
        cands.append((len(coded), Coding.MODEL, coded))
        trials[Coding.MODEL] = (e_lo, st)
    if states is not None and Coding.BUCKET in use and bucket.available():
        coded, e_lo, st = bucket.encode(spec, positions, values, base, states)
        cands.append((len(coded), Coding.BUCKET, coded))
        trials[Coding.BUCKET] = (e_lo, st)
    if Coding.LANES in use and lanes.available():
        coded, e_lo = lanes.encode(spec, positions, values, base)
        cands.append((len(coded), Coding.LANES, coded))
        trials[Coding.LANES] = (e_lo, None)
    if spec.nnz and (Coding.SPARSE_ZSTD in use or not trials):
        coded = _zstd_sparse(spec, positions, values)
        cands.append((len(coded), Coding.SPARSE_ZSTD, coded))
    # Ties go to the simpler coding (listed first).
    size, coding, coded = min(cands, key=lambda c: (c[0], int(c[1])))
    if coding is Coding.DENSE_RAW:
        dense = np.zeros(spec.range_len, dtype=_le(BITS_DTYPE[spec.dtype]))
        dense[positions - spec.lo] = values
        return coding, 0, dense.tobytes()
    if coding is Coding.SPARSE_RAW:
        return coding, 0, positions.astype("<i8").tobytes() + values.astype(_le(values.dtype)).tobytes()
    assert coded is not None and len(coded) == size
    if coding is Coding.MODEL:
        e_lo, st = trials[coding]
        states.put(spec.dtype, base is not None, st)
        return coding, e_lo, coded
    if coding is Coding.BUCKET:
        e_lo, st = trials[coding]
        states.put_bucket(spec.dtype, base is not None, st)
        return coding, e_lo, coded
    if coding is Coding.LANES:
        return coding, trials[coding][0], coded
    return coding, 0, coded


def _zstd_sparse(spec: RecordSpec, positions: np.ndarray, values: np.ndarray) -> bytes:
    gaps = np.diff(positions, prepend=spec.lo - 1) - 1
    raw = gaps.astype(_gap_dtype(spec)).tobytes() + values.astype(_le(values.dtype)).tobytes()
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


def decode_payload(spec: RecordSpec, coding: Coding, payload: memoryview,
                   base: np.ndarray | None, states: model.ModelStates) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, values BITS_DTYPE) of a record; raises ChunkFormatError."""
    bits = BITS_DTYPE[spec.dtype]
    check_payload_size(spec, coding, len(payload))
    if coding is Coding.DENSE_RAW:
        dense = np.frombuffer(payload, dtype=_le(bits))  # a view: the range is not copied
        if spec.op is DeltaOp.OVERWRITE:
            return np.arange(spec.lo, spec.hi, dtype=np.int64), dense.astype(bits)
        changed = int(np.count_nonzero(dense))
        if changed != spec.nnz:  # before allocating: the output is then nnz entries
            raise ChunkFormatError(f"dense XOR has {changed} changed elements, header says {spec.nnz}")
        rel = np.flatnonzero(dense).astype(np.int64, copy=False)
        val = dense[rel].astype(bits, copy=False)
        rel += spec.lo
        return rel, val
    if coding is Coding.SPARSE_RAW:
        pos = np.frombuffer(payload, dtype="<i8", count=spec.nnz).astype(np.int64)
        val = np.frombuffer(payload, dtype=_le(bits), offset=8 * spec.nnz).astype(bits)
        _check_positions(spec, pos)
        return pos, val
    if coding is Coding.SPARSE_ZSTD:
        return _decode_zstd_sparse(spec, payload)
    if coding is Coding.MODEL:
        if not model.available():
            raise ChunkFormatError("record needs the native range coder (nemo_dcr.codec._cans), not built")
        return model.decode(spec, payload, base, states)
    if coding is Coding.BUCKET:
        if not bucket.available():
            raise ChunkFormatError("record needs the native rANS coder (nemo_dcr.codec._crans), not built")
        return bucket.decode(spec, payload, base, states)
    if coding is Coding.LANES:
        if not lanes.available():
            raise ChunkFormatError("record needs the native rANS coder (nemo_dcr.codec._crans), not built")
        return lanes.decode(spec, payload, base)
    raise ChunkFormatError(f"unknown coding {coding!r}")


#: Frame bytes ``_inflate_into`` feeds the decompressor at a time: each step inflates to at
#: most ``ZSTD_MAX_RATIO`` times this (8 MiB), whatever the frame.
_ZSTD_FEED = 256

#: Entries converted at a time when gaps become positions in place.
_GAP_BLOCK = 1 << 20


def _inflate_into(payload: memoryview, targets: list[memoryview]) -> None:
    """Inflate the zstd frame at the start of ``payload`` into ``targets``, in order, filling
    them exactly (bytes after the frame are ignored, as ``ZstdDecompressor.decompress``
    ignores them).  Memory beyond the targets: one step's output, at most
    ``_ZSTD_FEED * ZSTD_MAX_RATIO`` bytes."""
    want = sum(len(t) for t in targets)
    dec = zstandard.ZstdDecompressor().decompressobj()
    got, ti, off = 0, 0, 0
    try:
        for i in range(0, len(payload), _ZSTD_FEED):
            out = memoryview(dec.decompress(payload[i : i + _ZSTD_FEED]))
            if got + len(out) > want:
                raise ChunkFormatError(f"zstd frame holds more than the {want} bytes the record needs")
            got += len(out)
            while len(out):
                t = targets[ti]
                k = min(len(t) - off, len(out))
                t[off : off + k] = out[:k]
                out, off = out[k:], off + k
                if off == len(t):
                    ti, off = ti + 1, 0
            if dec.eof:
                break
    except zstandard.ZstdError as e:
        raise ChunkFormatError(f"bad zstd frame: {e}") from None
    if not dec.eof:
        raise ChunkFormatError("bad zstd frame: truncated")
    if got != want:
        raise ChunkFormatError(f"zstd frame holds {got} bytes, record needs {want}")


def _decode_zstd_sparse(spec: RecordSpec, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of a SPARSE_ZSTD record, inflated straight into the output arrays:
    the gaps into the front of the positions array, turned into positions there, so memory
    is the ``nnz * (8 + width)`` bytes of the output plus O(``_GAP_BLOCK``)."""
    bits = BITS_DTYPE[spec.dtype]
    gd, n = _gap_dtype(spec), spec.nnz
    want = n * (gd.itemsize + spec.width)
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise ChunkFormatError(f"bad zstd frame: {e}") from None
    if params.content_size not in (want, zstandard.CONTENTSIZE_UNKNOWN):
        raise ChunkFormatError(f"zstd frame declares {params.content_size} bytes, record needs {want}")
    pos = np.empty(n, dtype=np.int64)
    val = np.empty(n, dtype=_le(bits))
    raw = memoryview(pos).cast("B")
    _inflate_into(payload, [raw[: n * gd.itemsize], memoryview(val).cast("B")])
    gaps = pos.view(np.uint8)[: n * gd.itemsize].view(gd)
    if n and int(gaps.max()) >= spec.range_len:
        raise ChunkFormatError("gap outside the record's range")
    if gd.itemsize < 8:
        # Widen in place, last block first: a block's positions never cover the gaps of the
        # blocks before it, only its own, which it copies first (numpy does not order a
        # widening copy between overlapping arrays).
        for start in range((n - 1) // _GAP_BLOCK * _GAP_BLOCK, -1, -_GAP_BLOCK):
            pos[start : start + _GAP_BLOCK] = gaps[start : start + _GAP_BLOCK].copy()
    # position = lo - 1 + the sum of (gap + 1) up to it.  A step adds at most range_len, so a
    # sum past int64 wraps into a decrease, which _check_positions refuses.
    carry = spec.lo - 1
    for start in range(0, n, _GAP_BLOCK):
        block = pos[start : start + _GAP_BLOCK]
        block += 1
        np.cumsum(block, out=block)
        block += carry
        carry = int(block[-1])
    _check_positions(spec, pos)
    return pos, val.astype(bits, copy=False)


def _check_positions(spec: RecordSpec, pos: np.ndarray) -> None:
    if pos.size and (pos[0] < spec.lo or pos[-1] >= spec.hi or not bool(np.all(pos[1:] > pos[:-1]))):
        raise ChunkFormatError("positions are not strictly increasing inside the record's range")
