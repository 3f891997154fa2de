"""Shared helpers for the codec tests: build deltas from (base, target) bit arrays."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard

from nemo_dcr.codec import BITS_DTYPE, DeltaOp, TensorDelta, model
from nemo_dcr.codec.format import ENTRY_FIXED, HEADER, TRAILER, U32, crc32

#: Tests of the MODEL coding (and so of context mode) need the native coder built
#: (`make setup`); without it the codec falls back to zstd and those tests are skipped.
needs_native = pytest.mark.skipif(not model.available(), reason="native range coder (_cans) not built")

FLOAT_SPECIALS = {
    # NaNs with payloads, +-Inf, +-0, subnormals, max finite
    "bfloat16": [0x7FC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x7F7F],
    "float16": [0x7E00, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x7BFF],
    "float32": [0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1],
    "float8_e4m3fn": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x7E],
    "float8_e5m2": [0x7C, 0x7D, 0xFF, 0x00, 0x80, 0x01],
}


def random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    bits = BITS_DTYPE[dtype]
    info = np.iinfo(bits)
    return rng.integers(0, int(info.max), size=n, dtype=bits, endpoint=True)


def xor_delta(name: str, dtype: str, shape: tuple[int, ...], base: np.ndarray, target: np.ndarray,
              element_range: tuple[int, int] | None = None) -> TensorDelta:
    lo, hi = element_range if element_range is not None else (0, base.size)
    x = base[lo:hi] ^ target[lo:hi]
    rel = np.flatnonzero(x)
    return TensorDelta(name=name, dtype=dtype, shape=shape, op=DeltaOp.XOR,
                       positions=(rel + lo).astype(np.int64), values=x[rel], element_range=(lo, hi))


def overwrite_delta(name: str, dtype: str, shape: tuple[int, ...], positions: np.ndarray, target: np.ndarray,
                    element_range: tuple[int, int] | None = None) -> TensorDelta:
    positions = np.asarray(positions, dtype=np.int64)
    return TensorDelta(name=name, dtype=dtype, shape=shape, op=DeltaOp.OVERWRITE,
                       positions=positions, values=target[positions].copy(), element_range=element_range)


def forge_chunk(records: list[tuple[tuple, bytes, tuple[int, ...], bytes]], meta: bytes | None = None,
                n_records: int | None = None, dir_raw_len: int | None = None) -> bytes:
    """A chunk whose every checksum is right, with arbitrary directory fields: each record
    is (``entry_fields(...)``, name bytes, shape, payload bytes)."""
    meta_body = meta if meta is not None else U32.pack(0)
    dir_raw, payloads = b"", b""
    for fields, name, shape, payload in records:
        dir_raw += ENTRY_FIXED.pack(*fields) + name + struct.pack(f"<{len(shape)}Q", *shape)
        payloads += payload
    directory = zstandard.ZstdCompressor().compress(dir_raw) if dir_raw else b""
    body = (meta_body + U32.pack(crc32(meta_body)) + directory + U32.pack(crc32(directory))
            + payloads + U32.pack(crc32(payloads)))
    total = HEADER.size + len(body) + TRAILER.size
    h = HEADER.pack(b"NEMODCR\x00", 1, 0, len(records) if n_records is None else n_records, len(meta_body),
                    len(directory), len(dir_raw) if dir_raw_len is None else dir_raw_len, len(payloads), total, 0)
    h = h[:-4] + U32.pack(crc32(h[:-4]))
    pre = h + body
    return pre + TRAILER.pack(crc32(pre), b"DCR\x00")


def entry_fields(name_len=1, dtype=1, op=0, ndim=1, coding=1, flags=0, param=0, lo=0, hi=4, nnz=1, plen=10, ccrc=0):
    """A directory entry's fixed fields (defaults: a 1-entry SPARSE_RAW bf16 XOR record)."""
    return (name_len, dtype, op, ndim, coding, flags, param, lo, hi, nnz, plen, ccrc)
