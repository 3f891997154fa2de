"""Decode v1 chunks (encoding: ``encode.py``; layout: ``nemo_dcr.codec.format``, ``docs/wire-format.md``).

The decoder validates in this order and allocates nothing a chunk declares before the
declaration has passed both the limits and the remaining-buffer check:
header (magic, version, CRC, section lengths) -> whole-chunk CRC -> metadata (CRC, limits)
-> directory (CRC, bounded inflate, every entry against the limits and the chunk's decoded-size
limit) -> the caller's ``expect`` (names, dtypes, shapes) -> each record's payload length
against what it declares -> context bases present -> the version's
``DecodeBudget`` -> payload section (CRC, lengths) -> each record (decode, content CRC).
Up to the budget, memory is proportional to the header (``nemo_dcr.codec.admit``).  It only
returns arrays; applying them is ``apply_delta_``'s job, so a chunk that fails anywhere has
written nothing.  ``stream_chunk`` validates the same way, then decodes one record per step,
so a caller that needs each record only briefly (``nemo-dcr delta inspect``) holds one.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import zstandard

from nemo_dcr.codec.admit import DecodeBudget, check_expected
from nemo_dcr.codec.format import (
    CONTEXT_CODINGS,
    DTYPE_NAMES,
    END_MAGIC,
    FLAG_CONTEXT,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    OP_FROM_CODE,
    ENTRY_FIXED,
    RECORD_FLAGS_KNOWN,
    TRAILER,
    U32,
    ChunkFormatError,
    ChunkLimits,
    Coding,
    BaseMismatchError,
    ContentMismatchError,
    MissingBaseError,
    content_crc,
    crc32,
)
from nemo_dcr.codec.codings import CODINGS, STATEFUL_CODINGS
from nemo_dcr.codec.model import ModelStates
from nemo_dcr.codec.payload import check_payload_size, decode_payload
from nemo_dcr.codec.record import RecordSpec
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.errors import ValidationError


@dataclass(frozen=True)
class RecordInfo:
    """Header facts of one record, for inspection and accounting (no payload data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    op: DeltaOp
    element_range: tuple[int, int]
    nnz: int
    coding: Coding
    context: bool
    payload_bytes: int


@dataclass(frozen=True)
class DecodedChunk:
    deltas: list[TensorDelta]
    """One per record, in chunk order (empty from ``read_chunk_index``)."""
    meta: dict[str, str]
    records: list[RecordInfo] = field(default_factory=list)
    """Directory facts of every record, in chunk order."""
    size: int = 0
    """Bytes of the chunk."""


@dataclass(frozen=True)
class StreamedRecord:
    """One record of a ``ChunkStream``: its directory facts, and its delta unless skipped."""

    info: RecordInfo
    delta: TensorDelta | None
    """None where the record was not decoded (``skipped`` says why)."""
    skipped: str | None = None


@dataclass(frozen=True)
class ChunkStream:
    """A validated and admitted chunk whose records decode one at a time (``stream_chunk``).

    Iterating it (once) yields a ``StreamedRecord`` per record in chunk order, decoding each
    as it is reached; the stream keeps no reference to what it yielded, so a caller that
    drops each record before taking the next holds one record's arrays at a time."""

    meta: dict[str, str]
    records: list[RecordInfo]
    """Directory facts of every record, in chunk order."""
    skipped: list[str | None]
    """Per record, why it will not be decoded (None: it will), fixed from the directory."""
    size: int
    """Bytes of the chunk."""
    _decoded: Iterator[StreamedRecord] = field(repr=False)

    def __iter__(self) -> Iterator[StreamedRecord]:
        return self._decoded


_DEFAULT_LIMITS = ChunkLimits()
_CODING_OF_CODE = {c.value: c for c in Coding}


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """Manifest name of a chunk: ``sha256:<hex>`` of all of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- decode

class _Reader:
    """Bounds-checked cursor over the chunk bytes."""

    def __init__(self, buf: memoryview, start: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, start, end

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.end - self.pos:
            raise ChunkFormatError(f"truncated: {what} needs {n} bytes, {self.end - self.pos} left")
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return U32.unpack(self.take(4, what))[0]

    def section(self, n: int, what: str) -> memoryview:
        body = self.take(n, what)
        if self.u32(f"{what} checksum") != crc32(body):
            raise ChunkFormatError(f"{what} checksum mismatch")
        return body


@dataclass(frozen=True)
class _Header:
    n_records: int
    meta_len: int
    dir_len: int
    dir_raw_len: int
    payloads_len: int


def _parse_header(buf: memoryview, limits: ChunkLimits) -> _Header:
    if len(buf) > limits.max_chunk_bytes:
        raise ChunkFormatError(f"chunk of {len(buf)} bytes exceeds the limit {limits.max_chunk_bytes}")
    if len(buf) < HEADER.size + TRAILER.size:
        raise ChunkFormatError(f"truncated: {len(buf)} bytes is shorter than header + trailer")
    magic, version, flags, n_records, meta_len, dir_len, dir_raw_len, payloads_len, total, hcrc = HEADER.unpack(
        buf[: HEADER.size])
    if magic != MAGIC:
        raise ChunkFormatError("not a nemo_dcr chunk (bad magic)")
    if hcrc != crc32(buf[: HEADER.size - 4]):
        raise ChunkFormatError("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version} (this decoder reads {FORMAT_VERSION})")
    if flags:
        raise ChunkFormatError(f"unknown chunk flags {flags:#x}")
    if total != len(buf):
        raise ChunkFormatError(f"chunk declares {total} bytes, got {len(buf)} (truncated or extended)")
    ccrc, end_magic = TRAILER.unpack(buf[-TRAILER.size :])
    if end_magic != END_MAGIC or ccrc != crc32(buf[: -TRAILER.size]):
        raise ChunkFormatError("chunk checksum mismatch")
    if n_records > limits.max_records:
        raise ChunkFormatError(f"{n_records} records exceed the limit {limits.max_records}")
    if meta_len > limits.max_meta_bytes:
        raise ChunkFormatError(f"metadata of {meta_len} bytes exceeds the limit {limits.max_meta_bytes}")
    max_entry = ENTRY_FIXED.size + limits.max_name_bytes + 8 * limits.max_ndim
    if dir_raw_len > limits.max_directory_bytes:
        raise ChunkFormatError(f"directory of {dir_raw_len} bytes exceeds the limit {limits.max_directory_bytes}")
    if not (n_records * ENTRY_FIXED.size <= dir_raw_len <= n_records * max_entry) or (dir_raw_len == 0) != (
            dir_len == 0):
        raise ChunkFormatError(f"directory of {dir_raw_len} bytes is impossible for {n_records} records")
    sections = meta_len + dir_len + payloads_len + 3 * U32.size
    if HEADER.size + sections + TRAILER.size != total:
        raise ChunkFormatError("section lengths do not add up to the chunk length")
    return _Header(n_records, meta_len, dir_len, dir_raw_len, payloads_len)


def _decode_meta(body: memoryview, limits: ChunkLimits) -> dict[str, str]:
    m = _Reader(body, 0, len(body))
    count = m.u32("metadata count")
    if count > limits.max_meta_entries:
        raise ChunkFormatError(f"{count} metadata entries exceed the limit {limits.max_meta_entries}")
    out: dict[str, str] = {}
    try:
        for _ in range(count):
            k = bytes(m.take(m.u32("metadata key length"), "metadata key")).decode("utf-8")
            v = bytes(m.take(m.u32("metadata value length"), "metadata value")).decode("utf-8")
            if k in out:
                raise ChunkFormatError(f"duplicate metadata key {k!r}")
            out[k] = v
    except UnicodeDecodeError:
        raise ChunkFormatError("metadata is not UTF-8") from None
    if m.pos != m.end:
        raise ChunkFormatError("trailing bytes in the metadata section")
    return out


@dataclass(frozen=True)
class _Entry:
    info: RecordInfo
    content_crc: int
    spec: RecordSpec
    """The payload's spec, built once (admission and decoding both read it)."""


def _inflate_directory(compressed: memoryview, raw_len: int) -> memoryview:
    if raw_len == 0:
        return memoryview(b"")
    try:
        params = zstandard.get_frame_parameters(compressed)
        if params.content_size != raw_len:
            raise ChunkFormatError(f"directory frame declares {params.content_size} bytes, header says {raw_len}")
        # max_output_size bounds the allocation by the (limit-checked) header value.
        raw = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise ChunkFormatError(f"bad directory frame: {e}") from None
    if len(raw) != raw_len:
        raise ChunkFormatError(f"directory inflates to {len(raw)} bytes, header says {raw_len}")
    return memoryview(raw)


def _parse_entry(r: _Reader, limits: ChunkLimits, left: list[int]) -> _Entry:
    (name_len, dcode, opcode, ndim, coding, flags, param, lo, hi, nnz, plen, ccrc) = ENTRY_FIXED.unpack(
        r.take(ENTRY_FIXED.size, "directory entry"))
    if name_len > limits.max_name_bytes:
        raise ChunkFormatError(f"tensor name of {name_len} bytes exceeds the limit {limits.max_name_bytes}")
    if ndim > limits.max_ndim:
        raise ChunkFormatError(f"{ndim} dimensions exceed the limit {limits.max_ndim}")
    try:
        name = bytes(r.take(name_len, "tensor name")).decode("utf-8")
    except UnicodeDecodeError:
        raise ChunkFormatError("tensor name is not UTF-8") from None
    shape = struct.unpack(f"<{ndim}Q", r.take(8 * ndim, "tensor shape"))  # Python ints
    if dcode not in DTYPE_NAMES:
        raise ChunkFormatError(f"{name}: unknown dtype code {dcode}")
    if opcode not in OP_FROM_CODE:
        raise ChunkFormatError(f"{name}: unknown op code {opcode}")
    coding_e = _CODING_OF_CODE.get(coding)
    if coding_e is None:
        raise ChunkFormatError(f"{name}: unknown coding {coding}")
    if flags & ~RECORD_FLAGS_KNOWN:
        raise ChunkFormatError(f"{name}: unknown record flags {flags:#x}")
    context = bool(flags & FLAG_CONTEXT)
    if context and coding_e not in CONTEXT_CODINGS:
        raise ChunkFormatError(f"{name}: context flag on a {coding_e.name} record")
    numel = 1
    for s in shape:
        numel *= s  # Python ints: no overflow
    if numel > limits.max_numel:
        raise ChunkFormatError(f"{name}: {numel} elements exceed the limit {limits.max_numel}")
    if not lo <= hi <= numel:
        raise ChunkFormatError(f"record {name!r}: range [{lo}, {hi}) is not inside its {numel} elements")
    if nnz > hi - lo:
        raise ChunkFormatError(f"record {name!r}: nnz {nnz} exceeds its range [{lo}, {hi}) of {hi - lo} elements")
    dtype = DTYPE_NAMES[dcode]
    need = nnz * (8 + BITS_DTYPE[dtype].itemsize)
    if need > left[0]:
        raise ChunkFormatError(f"record {name!r}: nnz {nnz} brings the decoded size over the chunk limit of "
                               f"{limits.max_decoded_bytes} bytes")
    left[0] -= need
    if (row := CODINGS.get(coding_e)) is not None and (row.always_scans or (row.context and context)):
        if hi - lo > left[1]:
            raise ChunkFormatError(f"record {name!r}: context-mode ranges exceed the chunk limit of "
                                   f"{limits.max_scan_elements} elements")
        left[1] -= hi - lo
    info = RecordInfo(name=name, dtype=dtype, shape=shape, op=OP_FROM_CODE[opcode], element_range=(lo, hi),
                      nnz=nnz, coding=coding_e, context=context, payload_bytes=plen)
    spec = RecordSpec(dtype=dtype, shape=shape, op=info.op, lo=lo, hi=hi, nnz=nnz, param=param)
    return _Entry(info, ccrc, spec)


def _decode_record(e: _Entry, payload: memoryview, base: Mapping[str, np.ndarray] | None,
                   states: ModelStates) -> TensorDelta:
    info = e.info
    name = info.name
    b = None
    if info.context:  # _admit checked that base holds it
        numel = 1
        for s in info.shape:
            numel *= s
        b = np.asarray(base[name])
        if b.dtype != BITS_DTYPE[info.dtype] or b.ndim != 1 or b.size != numel:
            raise BaseMismatchError(f"{name}: record is for {info.dtype}{list(info.shape)}, the base given "
                                    f"for it is {b.dtype}[{b.size}]")
    lo, hi = info.element_range
    try:
        pos, val = decode_payload(e.spec, info.coding, payload, b, states, size_checked=True)  # by _admit
    except ChunkFormatError as err:
        raise type(err)(f"record {name!r}: {err}") from None
    if pos.size != info.nnz or val.size != info.nnz:
        raise ChunkFormatError(f"{name}: payload decoded to {pos.size} entries, directory says {info.nnz}")
    if content_crc(pos, val) != e.content_crc:
        raise ContentMismatchError(
            f"{name}: decoded content checksum mismatch"
            + (" (is the base the one the delta was encoded against?)" if info.context else "")
        )
    try:
        return TensorDelta(name=name, dtype=info.dtype, shape=info.shape, op=info.op, positions=pos, values=val,
                           element_range=(lo, hi), _ordered=True)  # every row's decode: codec/codings.py
    except ValidationError as err:  # TensorDelta's own checks (a decoder's output it refuses)
        raise ChunkFormatError(str(err)) from None


def _admit(entries: list[_Entry], base: Mapping[str, np.ndarray] | None, expect: Mapping | None,
           budget: DecodeBudget | None, skipped: Sequence[str | None] | None) -> None:
    """Everything checkable from the directory, before any payload is decoded.  ``skipped``
    is the decode plan (None: nothing will be decoded); only records it decodes need a base."""
    infos = [e.info for e in entries]
    if expect is not None:
        check_expected(infos, expect)
    for e in entries:
        try:
            check_payload_size(e.spec, e.info.coding, e.info.payload_bytes)
        except ChunkFormatError as err:
            raise ChunkFormatError(f"record {e.info.name!r}: {err}") from None
    if skipped is not None:
        for i, why in zip(infos, skipped):
            if why is None and i.context and (base is None or i.name not in base):
                raise MissingBaseError(f"{i.name}: context-mode record; decoding needs its base bits")
    if budget is not None:
        budget.charge(infos)


def _plan(infos: Sequence[RecordInfo], skip: Callable[[RecordInfo], str | None] | None) -> list[str | None]:
    """Why each record will not be decoded (None: it will), from the directory alone: the
    records ``skip`` names, and every later record coded from the same adaptive state
    (MODEL or BUCKET, same dtype and mode, ``ModelStates``) as one of them, whose state
    would be unknown."""
    out: list[str | None] = []
    broken: dict[tuple[Coding, str, bool], str] = {}  # state -> the first record skipped in it
    for i in infos:
        why = skip(i) if skip is not None else None
        key = (i.coding, i.dtype, i.context)
        if why is None and key in broken:
            why = (f"record {i.name!r}: its {i.coding.name} coder state follows record {broken[key]!r}, "
                   "which is not decoded")
        if why is not None and i.coding in STATEFUL_CODINGS:
            broken.setdefault(key, i.name)
        out.append(why)
    return out


def _decode_each(entries: list[_Entry], skipped: list[str | None], payloads: memoryview,
                 base: Mapping[str, np.ndarray] | None) -> Iterator[StreamedRecord]:
    """Decode the records in order (MODEL and BUCKET records share their adaptive state along
    the chunk), one per step; nothing decoded stays referenced here once it is yielded."""
    states = ModelStates()
    off = 0
    for e, why in zip(entries, skipped):
        n = e.info.payload_bytes
        if why is None:
            yield StreamedRecord(e.info, _decode_record(e, payloads[off : off + n], base, states))
        else:
            yield StreamedRecord(e.info, None, why)
        off += n


@dataclass(frozen=True)
class _Opened:
    """A chunk validated and admitted up to its payloads, which are not decoded yet."""

    meta: dict[str, str]
    entries: list[_Entry]
    payloads: memoryview
    size: int
    skipped: list[str | None] | None
    """The decode plan (``_plan``); None when nothing is to be decoded."""


def _open(data: bytes | bytearray | memoryview, base: Mapping[str, np.ndarray] | None,
          limits: ChunkLimits, *, decode: bool, expect: Mapping | None = None,
          budget: DecodeBudget | None = None,
          skip: Callable[[RecordInfo], str | None] | None = None) -> _Opened:
    buf = memoryview(data).cast("B")
    h = _parse_header(buf, limits)
    r = _Reader(buf, HEADER.size, len(buf) - TRAILER.size)
    meta = _decode_meta(r.section(h.meta_len, "metadata"), limits)
    dr = _Reader(_inflate_directory(r.section(h.dir_len, "directory"), h.dir_raw_len), 0, h.dir_raw_len)
    left = [limits.max_decoded_bytes, limits.max_scan_elements]  # what this chunk may still declare
    entries = [_parse_entry(dr, limits, left) for _ in range(h.n_records)]
    if dr.pos != dr.end:
        raise ChunkFormatError(f"{dr.end - dr.pos} trailing bytes in the directory")
    if sum(e.info.payload_bytes for e in entries) != h.payloads_len:
        raise ChunkFormatError("directory payload lengths do not add up to the payload section")
    skipped = _plan([e.info for e in entries], skip) if decode else None
    _admit(entries, base, expect, budget, skipped)
    payloads = r.section(h.payloads_len, "payloads")
    assert r.pos == r.end
    return _Opened(meta=meta, entries=entries, payloads=payloads, size=len(buf), skipped=skipped)


def decode_chunk(data: bytes | bytearray | memoryview, *, base: Mapping[str, np.ndarray] | None = None,
                 limits: ChunkLimits = ChunkLimits(), expect: Mapping | None = None,
                 budget: DecodeBudget | None = None) -> DecodedChunk:
    """Parse and decode a whole chunk; raises ``ChunkFormatError`` on any malformed input.

    ``base`` is needed only for context-mode records (``MissingBaseError`` otherwise).

    Untrusted chunks: pass ``expect`` (tensor name -> ``(dtype, shape)`` or an object with
    ``dtype`` and ``shape``, e.g. a runtime's ``TensorSpec``: what the receiver holds) and
    the version's ``budget`` (one ``DecodeBudget`` shared by all chunks of the version).
    Then every record's name, dtype, shape and declared counts are checked and charged
    before any payload is decoded, and a chunk that does not fit raises
    ``ChunkValidationError`` (a ``ValidationError``) having allocated memory proportional
    to its header only.  Without them, a record may allocate up to ``limits`` allows.
    """
    stream = stream_chunk(data, base=base, limits=limits, expect=expect, budget=budget)
    deltas = [r.delta for r in stream]
    return DecodedChunk(deltas=deltas, meta=stream.meta, records=stream.records, size=stream.size)


def stream_chunk(data: bytes | bytearray | memoryview, *, base: Mapping[str, np.ndarray] | None = None,
                 limits: ChunkLimits = ChunkLimits(), expect: Mapping | None = None,
                 budget: DecodeBudget | None = None,
                 skip: Callable[[RecordInfo], str | None] | None = None) -> ChunkStream:
    """``decode_chunk`` one record at a time: validate and admit the chunk (as
    ``decode_chunk`` does, raising the same errors before any payload is decoded), then
    decode each record as the returned ``ChunkStream`` is iterated.

    ``skip(info)`` returns why a record should not be decoded, or None; such a record is
    yielded without a delta, and so is every later record that continues its adaptive coder
    state (``ChunkStream.skipped`` gives the reasons up front).  Only records to be decoded
    need a base.  Memory: one record's arrays at a time, if the caller drops each record
    before taking the next; ``skip`` on ``RecordInfo.nnz`` bounds that (a record allocates
    about ``nnz * (8 + width)`` bytes).  The decoded arrays are the stream's only copy: a
    caller may modify them."""
    o = _open(data, base, limits, decode=True, expect=expect, budget=budget, skip=skip)
    return ChunkStream(meta=o.meta, records=[e.info for e in o.entries], skipped=o.skipped, size=o.size,
                       _decoded=_decode_each(o.entries, o.skipped, o.payloads, base))


def read_chunk_index(data: bytes | bytearray | memoryview, *, limits: ChunkLimits = ChunkLimits(),
                     expect: Mapping | None = None) -> DecodedChunk:
    """Validate a chunk's structure and checksums and list its records without decoding
    payloads (``deltas`` is empty); needs no base.  With ``expect`` (as for
    ``decode_chunk``), records that do not fit raise ``ChunkValidationError``."""
    o = _open(data, None, limits, decode=False, expect=expect)
    return DecodedChunk(deltas=[], meta=o.meta, records=[e.info for e in o.entries], size=o.size)
