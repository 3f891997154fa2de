"""The codings without a native coder: DENSE_RAW and SPARSE_RAW (exact sizes), and SPARSE_ZSTD
(gaps + values through zstd, inflated straight into the output arrays under a sound
expansion bound)."""
from __future__ import annotations

import numpy as np
import zstandard

from nemo_dcr.codec.format import ChunkFormatError
from nemo_dcr.codec.record import RecordSpec
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp

ZSTD_LEVEL = 3

#: Most bytes a zstd frame inflates to per byte of frame.  A block outputs at most 128 KiB
#: (the format's Block_Maximum_Size) and costs at least 4 bytes (3-byte block header + the
#: one byte of an RLE block), so no frame exceeds 2**17 / 4 = 32768x (64 MiB of zeros
#: compresses to 32546x at level 19).
ZSTD_MAX_RATIO = 1 << 15


def _le(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _gap_dtype(spec: RecordSpec) -> np.dtype:
    return np.dtype("<u4") if spec.range_len <= 1 << 32 else np.dtype("<u8")


def dense_ok(spec: RecordSpec) -> bool:
    """An overwrite that leaves some elements of its range alone cannot be dense without the base."""
    return spec.op is DeltaOp.XOR or spec.nnz == spec.range_len


def dense_size(spec: RecordSpec) -> int:
    return spec.range_len * spec.width


def sparse_size(spec: RecordSpec) -> int:
    return spec.nnz * (8 + spec.width)


def encode_dense(spec: RecordSpec, positions: np.ndarray, values: np.ndarray) -> bytes:
    dense = np.zeros(spec.range_len, dtype=_le(BITS_DTYPE[spec.dtype]))
    dense[positions - spec.lo] = values
    return dense.tobytes()


def encode_sparse(spec: RecordSpec, positions: np.ndarray, values: np.ndarray) -> bytes:
    return positions.astype("<i8").tobytes() + values.astype(_le(values.dtype)).tobytes()


def check_dense_size(spec: RecordSpec, payload_len: int) -> None:
    if payload_len != dense_size(spec):
        raise ChunkFormatError(f"dense payload_len is {payload_len} bytes, range needs {dense_size(spec)}")
    if spec.op is DeltaOp.OVERWRITE and spec.nnz != spec.range_len:
        raise ChunkFormatError(f"dense overwrite must cover its whole range: nnz {spec.nnz}, "
                               f"range {spec.range_len}")


def check_sparse_size(spec: RecordSpec, payload_len: int) -> None:
    if payload_len != sparse_size(spec):
        raise ChunkFormatError(f"sparse payload_len is {payload_len} bytes, nnz {spec.nnz} needs {sparse_size(spec)}")


def check_zstd_size(spec: RecordSpec, payload_len: int) -> None:
    want = spec.nnz * (_gap_dtype(spec).itemsize + spec.width)
    if want == 0:
        raise ChunkFormatError("zstd coding of an empty record")
    if want > ZSTD_MAX_RATIO * payload_len:
        raise ChunkFormatError(f"nnz {spec.nnz} needs {want} inflated bytes, more than a zstd payload_len of "
                               f"{payload_len} can hold (at most {ZSTD_MAX_RATIO}x)")


def decode_dense(spec: RecordSpec, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
    bits = BITS_DTYPE[spec.dtype]
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


def decode_sparse(spec: RecordSpec, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
    bits = BITS_DTYPE[spec.dtype]
    pos = np.frombuffer(payload, dtype="<i8", count=spec.nnz).astype(np.int64)
    val = np.frombuffer(payload, dtype=_le(bits), offset=8 * spec.nnz).astype(bits)
    _check_positions(spec, pos)
    return pos, val


def encode_zstd(spec: RecordSpec, positions: np.ndarray, values: np.ndarray) -> bytes:
    gaps = np.diff(positions, prepend=spec.lo - 1) - 1
    raw = gaps.astype(_gap_dtype(spec)).tobytes() + values.astype(_le(values.dtype)).tobytes()
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


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


def decode_zstd(spec: RecordSpec, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
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
