"""Encode v1 chunks (layout: ``nemo_dcr.codec.format``, ``docs/wire-format.md``): records in
canonical order, each coded by the codings table's smallest candidate (``payload.py``),
the directory zstd-compressed, every section CRC'd.  Decoding is ``chunk.py``."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import zstandard

from nemo_dcr.codec.format import (
    CONTEXT_CODINGS,
    ChunkLimits,
    DTYPE_CODES,
    END_MAGIC,
    FLAG_CONTEXT,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    OP_CODES,
    ENTRY_FIXED,
    TRAILER,
    U32,
    Coding,
    content_crc,
    crc32,
    dir_zstd_level,
)
from nemo_dcr.codec.codings import CODINGS, STATEFUL_CODINGS
from nemo_dcr.codec.model import ModelStates
from nemo_dcr.codec.payload import encode_payload
from nemo_dcr.codec.record import RecordSpec
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.errors import ValidationError, WrongTypeError


_DEFAULT_LIMITS = ChunkLimits()
"""What any receiver admits: a chunk the encoder writes never exceeds it."""


def _check_base(name: str, dtype: str, numel: int, arr: np.ndarray) -> np.ndarray:
    want = BITS_DTYPE[dtype]
    a = np.asarray(arr)
    if a.dtype != want or a.ndim != 1 or a.size != numel:
        raise ValidationError(f"{name}: base must be flat {want}[{numel}], got {a.dtype}{list(a.shape)}")
    return a


def _canonical(d: TensorDelta) -> tuple[np.ndarray, np.ndarray]:
    """XOR entries whose value is 0 are no-ops; v1 does not carry them."""
    pos, val = d.positions, d.values
    if d.op is DeltaOp.XOR and val.size:
        keep = val != 0
        if not bool(keep.all()):
            pos, val = pos[keep], val[keep]
    return np.ascontiguousarray(pos), np.ascontiguousarray(val)


def _encode_record(d: TensorDelta, base: np.ndarray | None, states: ModelStates | None,
                   codings: frozenset[Coding] | None) -> tuple[bytes, bytes]:
    """(directory entry, payload) of one delta."""
    name = d.name.encode("utf-8")
    # Refuse what a decoder with the default limits would refuse, here rather than there.
    if len(name) > _DEFAULT_LIMITS.max_name_bytes:
        raise ValidationError(f"tensor name of {len(name)} bytes exceeds {_DEFAULT_LIMITS.max_name_bytes}")
    if len(d.shape) > _DEFAULT_LIMITS.max_ndim:
        raise ValidationError(f"{d.name}: {len(d.shape)} dimensions exceed {_DEFAULT_LIMITS.max_ndim}")
    pos, val = _canonical(d)
    lo, hi = d.element_range
    spec = RecordSpec(dtype=d.dtype, shape=d.shape, op=d.op, lo=lo, hi=hi, nnz=int(pos.size))
    coding, param, payload = encode_payload(spec, pos, val, base, states, codings)
    flags = FLAG_CONTEXT if (coding in CONTEXT_CODINGS and base is not None) else 0
    entry = ENTRY_FIXED.pack(
        len(name), DTYPE_CODES[d.dtype], OP_CODES[d.op], len(d.shape), int(coding), flags, param,
        lo, hi, spec.nnz, len(payload), content_crc(pos, val),
    )
    return entry + name + np.asarray(d.shape, dtype="<u8").tobytes(), payload


def encode_chunk(deltas: Sequence[TensorDelta], *, meta: Mapping[str, str] | None = None,
                 base: Mapping[str, np.ndarray] | None = None,
                 codings: Iterable[Coding] | None = None) -> bytes:
    """One chunk holding a record per delta, in order.

    ``base`` maps tensor names to their canonical base bits (flat ``BITS_DTYPE[dtype]``);
    a delta whose name is in it is coded in context mode, and decoding it needs the same
    base.  Metadata keys and values are strings (UTF-8 on the wire).  ``codings`` restricts
    the entropy codings tried per record (``codings.ENTROPY_CODINGS``; default
    ``payload.default_codings``: LANES for context-mode records of many changes, else BUCKET,
    plus MODEL for small ranges); the raw codings are always candidates.
    """
    meta_body = _encode_meta(meta or {})
    if len(meta or {}) > _DEFAULT_LIMITS.max_meta_entries or len(meta_body) > _DEFAULT_LIMITS.max_meta_bytes:
        raise ValidationError("chunk metadata exceeds the default decoder limits")
    states = ModelStates() if any(CODINGS[c].available() for c in STATEFUL_CODINGS) else None
    chosen = None if codings is None else frozenset(Coding(c) for c in codings)
    entries, payloads = [], []
    for d in deltas:
        if not isinstance(d, TensorDelta):
            raise WrongTypeError(f"expected TensorDelta, got {type(d).__name__}")
        b = None
        if base is not None and d.name in base:
            b = _check_base(d.name, d.dtype, d.numel, base[d.name])
        e, p = _encode_record(d, b, states, chosen)
        entries.append(e)
        payloads.append(p)
    dir_raw = b"".join(entries)
    directory = zstandard.ZstdCompressor(level=dir_zstd_level(len(dir_raw))).compress(dir_raw) if dir_raw else b""
    payload_bytes = b"".join(payloads)
    body = (meta_body + U32.pack(crc32(meta_body)) + directory + U32.pack(crc32(directory))
            + payload_bytes + U32.pack(crc32(payload_bytes)))
    total = HEADER.size + len(body) + TRAILER.size
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(deltas), len(meta_body), len(directory), len(dir_raw),
                       len(payload_bytes), total, 0)
    head = head[:-4] + U32.pack(crc32(head[:-4]))
    pre = head + body
    return pre + TRAILER.pack(crc32(pre), END_MAGIC)


def _encode_meta(meta: Mapping[str, str]) -> bytes:
    parts = [U32.pack(len(meta))]
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise WrongTypeError("chunk metadata keys and values must be str")
        kb, vb = k.encode("utf-8"), v.encode("utf-8")
        parts += [U32.pack(len(kb)), kb, U32.pack(len(vb)), vb]
    return b"".join(parts)
