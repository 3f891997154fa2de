"""Encode and decode v1 chunks (layout: ``nemo_dcr.codec.format``, ``docs/wire-format.md``).

The decoder validates in this order and allocates nothing a chunk declares before the
declaration has passed both the limits and the remaining-buffer check:
header (magic, version, CRC, total length) -> whole-chunk CRC -> metadata -> each record
(head CRC, sizes, payload CRC, decode, content CRC).  It only returns arrays; applying them
is ``apply_delta_``'s job, so a chunk that fails anywhere has written nothing.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr.codec.format import (
    DTYPE_CODES,
    DTYPE_NAMES,
    END_MAGIC,
    FLAG_CONTEXT,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    OP_CODES,
    OP_FROM_CODE,
    RECORD_FIXED,
    RECORD_FLAGS_KNOWN,
    TRAILER,
    U32,
    ChunkFormatError,
    ChunkLimits,
    Coding,
    ContentMismatchError,
    MissingBaseError,
    content_crc,
    crc32,
)
from nemo_dcr.codec.payload import RecordSpec, decode_payload, encode_payload
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta


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
    record_bytes: int


@dataclass(frozen=True)
class DecodedChunk:
    deltas: list[TensorDelta]
    meta: dict[str, str]
    records: list[RecordInfo] = field(default_factory=list)
    size: int = 0
    """Bytes of the chunk."""


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """Manifest name of a chunk: ``sha256:<hex>`` of all of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- encode

def _check_base(name: str, dtype: str, numel: int, arr: np.ndarray) -> np.ndarray:
    want = BITS_DTYPE[dtype]
    a = np.asarray(arr)
    if a.dtype != want or a.ndim != 1 or a.size != numel:
        raise ValueError(f"{name}: base must be flat {want}[{numel}], got {a.dtype}{list(a.shape)}")
    return a


def _canonical(d: TensorDelta) -> tuple[np.ndarray, np.ndarray]:
    """XOR entries whose value is 0 are no-ops; v1 does not carry them."""
    pos, val = d.positions, d.values
    if d.op is DeltaOp.XOR and val.size:
        keep = val != 0
        if not bool(keep.all()):
            pos, val = pos[keep], val[keep]
    return np.ascontiguousarray(pos), np.ascontiguousarray(val)


def encode_record(d: TensorDelta, base: np.ndarray | None) -> bytes:
    name = d.name.encode("utf-8")
    if len(name) > 0xFFFF:
        raise ValueError(f"tensor name too long ({len(name)} bytes)")
    if len(d.shape) > 255:
        raise ValueError(f"{d.name}: too many dimensions ({len(d.shape)})")
    pos, val = _canonical(d)
    lo, hi = d.element_range
    spec = RecordSpec(dtype=d.dtype, shape=d.shape, op=d.op, lo=lo, hi=hi, nnz=int(pos.size))
    coding, payload = encode_payload(spec, pos, val, base)
    flags = FLAG_CONTEXT if (coding is Coding.MODEL and base is not None) else 0
    fixed = RECORD_FIXED.pack(
        len(name), DTYPE_CODES[d.dtype], OP_CODES[d.op], len(d.shape), int(coding), flags, 0,
        lo, hi, spec.nnz, len(payload), crc32(payload), content_crc(pos, val), 0,
    )
    shape = np.asarray(d.shape, dtype="<u8").tobytes()
    head = fixed + name + shape
    return head + U32.pack(crc32(head)) + payload


def encode_chunk(deltas: Sequence[TensorDelta], *, meta: Mapping[str, str] | None = None,
                 base: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One chunk holding a record per delta, in order.

    ``base`` maps tensor names to their canonical base bits (flat ``BITS_DTYPE[dtype]``);
    a delta whose name is in it is coded in context mode, and decoding it needs the same
    base.  Metadata keys and values are strings (UTF-8 on the wire).
    """
    body = [_encode_meta(meta or {})]
    for d in deltas:
        if not isinstance(d, TensorDelta):
            raise TypeError(f"expected TensorDelta, got {type(d).__name__}")
        b = None
        if base is not None and d.name in base:
            b = _check_base(d.name, d.dtype, d.numel, base[d.name])
        body.append(encode_record(d, b))
    body_bytes = b"".join(body)
    total = HEADER.size + len(body_bytes) + TRAILER.size
    head0 = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(deltas), len(body[0]) - U32.size, 0, total, 0, 0)
    head = head0[:-8] + U32.pack(crc32(head0[:-8])) + U32.pack(0)
    pre = head + body_bytes
    return pre + TRAILER.pack(crc32(pre), END_MAGIC)


def _encode_meta(meta: Mapping[str, str]) -> bytes:
    parts = [U32.pack(len(meta))]
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError("chunk metadata keys and values must be str")
        kb, vb = k.encode("utf-8"), v.encode("utf-8")
        parts += [U32.pack(len(kb)), kb, U32.pack(len(vb)), vb]
    body = b"".join(parts)
    return body + U32.pack(crc32(body))


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


def _parse_header(buf: memoryview, limits: ChunkLimits) -> tuple[int, int]:
    if len(buf) > limits.max_chunk_bytes:
        raise ChunkFormatError(f"chunk of {len(buf)} bytes exceeds the limit {limits.max_chunk_bytes}")
    if len(buf) < HEADER.size + TRAILER.size:
        raise ChunkFormatError(f"truncated: {len(buf)} bytes is shorter than header + trailer")
    magic, version, flags, n_records, meta_len, res0, total, hcrc, res1 = HEADER.unpack(buf[: HEADER.size])
    if magic != MAGIC:
        raise ChunkFormatError("not a nemo_dcr chunk (bad magic)")
    if hcrc != crc32(buf[: HEADER.size - 8]):
        raise ChunkFormatError("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version} (this decoder reads {FORMAT_VERSION})")
    if flags or res0 or res1:
        raise ChunkFormatError("reserved header fields are not zero")
    if total != len(buf):
        raise ChunkFormatError(f"chunk declares {total} bytes, got {len(buf)} (truncated or extended)")
    ccrc, end_magic = TRAILER.unpack(buf[-TRAILER.size :])
    if end_magic != END_MAGIC or ccrc != crc32(buf[: -TRAILER.size]):
        raise ChunkFormatError("chunk checksum mismatch")
    if n_records > limits.max_records:
        raise ChunkFormatError(f"{n_records} records exceed the limit {limits.max_records}")
    if meta_len > limits.max_meta_bytes:
        raise ChunkFormatError(f"metadata of {meta_len} bytes exceeds the limit {limits.max_meta_bytes}")
    return n_records, meta_len


def _decode_meta(r: _Reader, meta_len: int, limits: ChunkLimits) -> dict[str, str]:
    body = r.take(meta_len, "metadata")
    if r.u32("metadata checksum") != crc32(body):
        raise ChunkFormatError("metadata checksum mismatch")
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


def _decode_record(r: _Reader, limits: ChunkLimits, base: Mapping[str, np.ndarray] | None,
                   budget: list[int], *, decode: bool) -> tuple[RecordInfo, TensorDelta | None]:
    start = r.pos
    fixed = r.take(RECORD_FIXED.size, "record header")
    (name_len, dcode, opcode, ndim, coding, flags, res0, lo, hi, nnz, plen, pcrc, ccrc,
     res1) = RECORD_FIXED.unpack(fixed)
    if name_len > limits.max_name_bytes:
        raise ChunkFormatError(f"tensor name of {name_len} bytes exceeds the limit {limits.max_name_bytes}")
    if ndim > limits.max_ndim:
        raise ChunkFormatError(f"{ndim} dimensions exceed the limit {limits.max_ndim}")
    name_b = r.take(name_len, "tensor name")
    shape_b = r.take(8 * ndim, "tensor shape")
    if r.u32("record header checksum") != crc32(fixed, name_b, shape_b):
        raise ChunkFormatError("record header checksum mismatch")
    try:
        name = bytes(name_b).decode("utf-8")
    except UnicodeDecodeError:
        raise ChunkFormatError("tensor name is not UTF-8") from None
    if dcode not in DTYPE_NAMES:
        raise ChunkFormatError(f"{name}: unknown dtype code {dcode}")
    if opcode not in OP_FROM_CODE:
        raise ChunkFormatError(f"{name}: unknown op code {opcode}")
    try:
        coding_e = Coding(coding)
    except ValueError:
        raise ChunkFormatError(f"{name}: unknown coding {coding}") from None
    if flags & ~RECORD_FLAGS_KNOWN or res0 or res1:
        raise ChunkFormatError(f"{name}: unknown record flags or non-zero reserved fields")
    context = bool(flags & FLAG_CONTEXT)
    if context and coding_e is not Coding.MODEL:
        raise ChunkFormatError(f"{name}: context flag on a {coding_e.name} record")
    shape = tuple(int(s) for s in np.frombuffer(shape_b, dtype="<u8"))
    numel = 1
    for s in shape:
        numel *= s  # Python ints: no overflow
    if numel > limits.max_numel:
        raise ChunkFormatError(f"{name}: {numel} elements exceed the limit {limits.max_numel}")
    if not (lo <= hi <= numel) or nnz > hi - lo:
        raise ChunkFormatError(f"{name}: range [{lo}, {hi}) / {nnz} entries inconsistent with {numel} elements")
    dtype = DTYPE_NAMES[dcode]
    op = OP_FROM_CODE[opcode]
    width = BITS_DTYPE[dtype].itemsize
    need = nnz * (8 + width)
    if need > budget[0]:
        raise ChunkFormatError(f"{name}: decoded size exceeds the chunk limit {limits.max_decoded_bytes}")
    budget[0] -= need
    payload = r.take(plen, "record payload")
    if crc32(payload) != pcrc:
        raise ChunkFormatError(f"{name}: payload checksum mismatch")
    info = RecordInfo(name=name, dtype=dtype, shape=shape, op=op, element_range=(lo, hi), nnz=nnz,
                      coding=coding_e, context=context, payload_bytes=plen, record_bytes=r.pos - start)
    if not decode:
        return info, None
    b = None
    if context:
        if base is None or name not in base:
            raise MissingBaseError(f"{name}: context-mode record; decoding needs its base bits")
        b = _check_base(name, dtype, numel, base[name])
    spec = RecordSpec(dtype=dtype, shape=shape, op=op, lo=lo, hi=hi, nnz=nnz)
    pos, val = decode_payload(spec, coding_e, payload, b)
    if pos.size != nnz or val.size != nnz:
        raise ChunkFormatError(f"{name}: payload decoded to {pos.size} entries, header says {nnz}")
    if content_crc(pos, val) != ccrc:
        raise ContentMismatchError(
            f"{name}: decoded content checksum mismatch"
            + (" (is the base the one the delta was encoded against?)" if context else "")
        )
    try:
        delta = TensorDelta(name=name, dtype=dtype, shape=shape, op=op, positions=pos, values=val,
                            element_range=(lo, hi))
    except ValueError as e:
        raise ChunkFormatError(str(e)) from None
    return info, delta


def _walk(data: bytes | bytearray | memoryview, base: Mapping[str, np.ndarray] | None,
          limits: ChunkLimits, *, decode: bool) -> DecodedChunk:
    buf = memoryview(data).cast("B")
    n_records, meta_len = _parse_header(buf, limits)
    r = _Reader(buf, HEADER.size, len(buf) - TRAILER.size)
    meta = _decode_meta(r, meta_len, limits)
    budget = [limits.max_decoded_bytes]
    infos, deltas = [], []
    for _ in range(n_records):
        info, d = _decode_record(r, limits, base, budget, decode=decode)
        infos.append(info)
        if d is not None:
            deltas.append(d)
    if r.pos != r.end:
        raise ChunkFormatError(f"{r.end - r.pos} trailing bytes after the last record")
    return DecodedChunk(deltas=deltas, meta=meta, records=infos, size=len(buf))


def decode_chunk(data: bytes | bytearray | memoryview, *, base: Mapping[str, np.ndarray] | None = None,
                 limits: ChunkLimits = ChunkLimits()) -> DecodedChunk:
    """Parse and decode a whole chunk; raises ``ChunkFormatError`` on any malformed input.

    ``base`` is needed only for context-mode records (``MissingBaseError`` otherwise).
    """
    return _walk(data, base, limits, decode=True)


def read_chunk_index(data: bytes | bytearray | memoryview, *,
                     limits: ChunkLimits = ChunkLimits()) -> DecodedChunk:
    """Validate a chunk's structure and checksums and list its records without decoding
    payloads (``deltas`` is empty); needs no base."""
    return _walk(data, None, limits, decode=False)
