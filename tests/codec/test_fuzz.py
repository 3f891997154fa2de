"""Hostile and damaged chunks: always ChunkFormatError, never another exception or a write."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr.codec import ChunkFormatError, ChunkLimits, Coding, apply_delta_, decode_chunk, encode_chunk, lanes
from nemo_dcr.codec.format import HEADER, TRAILER, U32, crc32, dir_zstd_level

from codec_helpers import entry_fields as _fields
from codec_helpers import forge_chunk as _forge
from codec_helpers import needs_native, random_bits, xor_delta


def _valid_chunk(context: bool = False, codings=None) -> tuple[bytes, dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    bases, targets, deltas = {}, {}, []
    for name, dtype, shape, rate in [("a.weight", "bfloat16", (40, 64), 0.05), ("b.bias", "float32", (300,), 0.3),
                                      ("c", "float8_e4m3fn", (16, 16), 1.0), ("d", "int64", (50,), 0.1)]:
        n = int(np.prod(shape))
        b = random_bits(rng, dtype, n)
        t = b.copy()
        idx = np.flatnonzero(rng.random(n) < rate)
        t[idx] = random_bits(rng, dtype, idx.size)
        bases[name], targets[name] = b, t
        deltas.append(xor_delta(name, dtype, shape, b, t))
    return encode_chunk(deltas, meta={"base": "v1"}, base=bases if context else None, codings=codings), bases, targets


CHUNKS = {ctx: _valid_chunk(ctx) for ctx in (False, True)}
#: The same deltas coded LANES (coding 5) where it applies, for the mutation tests below.
LANES_CHUNKS = {ctx: _valid_chunk(ctx, [Coding.LANES]) for ctx in (False, True)} if lanes.available() else {}


def _decode_and_apply(data: bytes, bases: dict[str, np.ndarray], context: bool) -> dict[str, np.ndarray]:
    """The receiver's order: decode the whole chunk, then apply; returns the targets."""
    targets = {k: v.copy() for k, v in bases.items()}
    decoded = decode_chunk(data, base=bases if context else None)
    for d in decoded.deltas:
        apply_delta_(targets[d.name], d)
    return targets


def _expect_rejected_untouched(data: bytes, context: bool) -> None:
    _, bases, _ = CHUNKS[context]
    targets = {k: v.copy() for k, v in bases.items()}
    snapshot = {k: v.copy() for k, v in targets.items()}
    with pytest.raises(ChunkFormatError):
        decoded = decode_chunk(data, base=bases if context else None)
        for d in decoded.deltas:  # only reached if decoding (wrongly) succeeded
            apply_delta_(targets[d.name], d)
    for k in targets:
        assert np.array_equal(targets[k], snapshot[k]), f"{k} was written"


def test_valid_chunks_apply():
    for ctx, (data, bases, targets) in CHUNKS.items():
        out = _decode_and_apply(data, bases, ctx)
        for k in targets:
            assert np.array_equal(out[k], targets[k])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.data())
def test_random_byte_flips(context, data):
    chunk = bytearray(CHUNKS[context][0])
    where = data.draw(st.sets(st.integers(0, len(chunk) - 1), min_size=1, max_size=4))
    for i in where:  # distinct offsets, non-zero masks: the chunk really differs
        chunk[i] ^= data.draw(st.integers(1, 255))
    _expect_rejected_untouched(bytes(chunk), context)


@settings(max_examples=150, deadline=None)
@given(st.booleans(), st.data())
def test_truncations_and_extensions(context, data):
    chunk = CHUNKS[context][0]
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(chunk) - 1))
        bad = chunk[:cut]
    else:
        bad = chunk + data.draw(st.binary(min_size=1, max_size=64))
    _expect_rejected_untouched(bad, context)


def test_every_single_byte_truncation():
    chunk = CHUNKS[False][0]
    for cut in range(len(chunk)):
        with pytest.raises(ChunkFormatError):
            decode_chunk(chunk[:cut])


# ---------------------------------------------------------------- forged chunks (valid CRCs)

HOSTILE = {
    "huge nnz raw": [(_fields(nnz=2**40, hi=2**41, plen=0), b"w", (2**41,), b"")],
    "huge numel": [(_fields(hi=0, nnz=0, plen=0), b"w", (2**32, 2**32), b"")],
    "nnz beyond range": [(_fields(nnz=5, hi=4, plen=50), b"w", (4,), b"\0" * 50)],
    "range beyond tensor": [(_fields(lo=2, hi=9, nnz=0, plen=0), b"w", (4,), b"")],
    "unknown dtype": [(_fields(dtype=99, plen=0, nnz=0), b"w", (4,), b"")],
    "unknown op": [(_fields(op=7, plen=0, nnz=0), b"w", (4,), b"")],
    "unknown coding": [(_fields(coding=42, plen=0, nnz=0), b"w", (4,), b"")],
    "unknown flag": [(_fields(flags=0x80, plen=0, nnz=0), b"w", (4,), b"")],
    "context on raw": [(_fields(flags=1, plen=0, nnz=0), b"w", (4,), b"")],
    "param on raw": [(_fields(param=3, plen=0, nnz=0), b"w", (4,), b"")],
    "payload beyond buffer": [(_fields(plen=2**31), b"w", (4,), b"")],
    "payload short of buffer": [(_fields(plen=5), b"w", (4,), b"\0" * 10)],
    "wrong content crc": [(_fields(nnz=1, plen=10), b"w", (4,), struct.pack("<q", 1) + b"\1\0")],
    "name not utf8": [(_fields(name_len=2, plen=0, nnz=0), b"\xff\xfe", (4,), b"")],
    "dense wrong size": [(_fields(coding=0, plen=7, nnz=1), b"w", (4,), b"\1" * 7)],
    "unsorted raw positions": [(_fields(nnz=2, plen=20), b"w", (4,),
                                struct.pack("<qq", 3, 1) + b"\1\0\1\0")],
    "negative raw position": [(_fields(nnz=1, plen=10), b"w", (4,), struct.pack("<q", -1) + b"\1\0")],
    "zstd bomb": [(_fields(coding=2, nnz=1, plen=0), b"w", (4,), b"")],
    "model garbage": [(_fields(coding=3, nnz=1, plen=16), b"w", (4,), bytes(range(16)))],
    "model huge range": [(_fields(coding=3, nnz=1, hi=2**40, plen=4), b"w", (2**40,), b"\x01\x02\x03\x04")],
    "model garbage ctx": [(_fields(coding=3, flags=1, nnz=1, plen=16), b"w", (4,), bytes(range(16)))],
    "lanes garbage": [(_fields(coding=5, nnz=1, plen=80), b"w", (4,), bytes(range(80)))],
    "lanes garbage ctx": [(_fields(coding=5, flags=1, nnz=1, plen=80), b"w", (4,), bytes(range(80)))],
    "lanes short": [(_fields(coding=5, nnz=1, plen=16), b"w", (4,), bytes(range(16)))],
    # admission: more entries than 757 per payload byte, refused before any allocation
    "lanes huge nnz": [(_fields(coding=5, nnz=757 * 80 + 2, hi=2**20, plen=80), b"w", (2**20,), bytes(80))],
    "lanes huge range ctx": [(_fields(coding=5, flags=1, nnz=1, hi=2**40, plen=80), b"w", (2**40,), bytes(80))],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_forged_records_are_rejected(case):
    data = _forge(HOSTILE[case])
    with pytest.raises(ChunkFormatError):
        decode_chunk(data, base={"w": np.zeros(4, np.uint16)})


@needs_native
def test_model_stream_that_runs_dry_stops_early():
    """A MODEL record whose stream ends long before its range is rejected after a few bytes'
    worth of elements.  Walking its whole 2**36-element range instead (allowed by these
    limits) would take many minutes, so this test would hang rather than pass."""
    data = _forge([(_fields(coding=3, nnz=2, hi=2**36, plen=2), b"w", (2**36,), b"\x00\x01")])
    with pytest.raises(ChunkFormatError, match="MODEL payload"):
        decode_chunk(data, limits=ChunkLimits(max_scan_elements=2**40))


@needs_native
def test_context_record_against_a_base_of_another_size_is_a_format_error():
    data = _forge([(_fields(coding=3, flags=1, nnz=1, hi=8, plen=4), b"w", (8,), b"\x01\x02\x03\x04")])
    with pytest.raises(ChunkFormatError, match="base given"):
        decode_chunk(data, base={"w": np.zeros(4, np.uint16)})


def test_zstd_bomb_is_bounded():
    import zstandard

    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    data = _forge([(_fields(coding=2, nnz=1, plen=len(bomb)), b"w", (4,), bomb)])
    with pytest.raises(ChunkFormatError):
        decode_chunk(data)


def test_forged_header_counts():
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge([], n_records=2**31))
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge([], n_records=3))
    one = [(_fields(nnz=0, plen=0), b"w", (4,), b"")]
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge(one, dir_raw_len=2**30))
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge(one, n_records=2))
    meta = U32.pack(2**31)
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge([], meta=meta))
    dup = U32.pack(2) + (U32.pack(1) + b"k" + U32.pack(1) + b"v") * 2
    with pytest.raises(ChunkFormatError):
        decode_chunk(_forge([], meta=dup))


def test_limits_are_enforced_before_decoding():
    data = CHUNKS[False][0]
    for lim in [ChunkLimits(max_records=3), ChunkLimits(max_name_bytes=3), ChunkLimits(max_decoded_bytes=100),
                ChunkLimits(max_chunk_bytes=100), ChunkLimits(max_numel=1000), ChunkLimits(max_meta_entries=0),
                ChunkLimits(max_directory_bytes=100)]:
        with pytest.raises(ChunkFormatError):
            decode_chunk(data, limits=lim)
    assert len(decode_chunk(data, limits=ChunkLimits()).deltas) == 4


@needs_native
def test_scan_limit_is_enforced_before_decoding():
    data = CHUNKS[False][0]
    with pytest.raises(ChunkFormatError, match="context-mode ranges exceed"):
        decode_chunk(data, limits=ChunkLimits(max_scan_elements=1000))


# ------------------------------------------------- structure-aware fuzzing (CRCs resealed)

def _split(chunk: bytes) -> tuple[int, bytes, bytes, bytes]:
    _, _, _, n, ml, dl, _, pl, _, _ = HEADER.unpack(chunk[: HEADER.size])
    o = HEADER.size
    meta = chunk[o : o + ml]
    o += ml + 4
    directory = chunk[o : o + dl]
    o += dl + 4
    raw = zstandard.ZstdDecompressor().decompress(directory) if dl else b""
    return n, meta, raw, chunk[o : o + pl]


def _reseal(n: int, meta: bytes, dir_raw: bytes, payloads: bytes) -> bytes:
    d = zstandard.ZstdCompressor(level=dir_zstd_level(len(dir_raw))).compress(dir_raw) if dir_raw else b""
    body = meta + U32.pack(crc32(meta)) + d + U32.pack(crc32(d)) + payloads + U32.pack(crc32(payloads))
    total = HEADER.size + len(body) + TRAILER.size
    h = HEADER.pack(b"NEMODCR\x00", 1, 0, n, len(meta), len(d), len(dir_raw), len(payloads), total, 0)
    pre = h[:-4] + U32.pack(crc32(h[:-4])) + body
    return pre + TRAILER.pack(crc32(pre), b"DCR\x00")


def test_reseal_helper_round_trips():
    for ctx, (data, bases, _) in CHUNKS.items():
        assert _reseal(*_split(data)) == data


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.sampled_from(["payload", "directory", "cut"]), st.booleans(), st.data())
def test_mutations_behind_valid_checksums(context, where, lanes_coded, data):
    """A forger can fix every CRC: damage in the payloads or the directory must still end
    in ChunkFormatError (or a chunk that decodes to valid deltas), never another exception.
    Half the examples damage a chunk coded LANES (coding 5) where it applies."""
    if lanes_coded and not LANES_CHUNKS:
        return
    chunk, bases, _ = (LANES_CHUNKS if lanes_coded else CHUNKS)[context]
    n, meta, dir_raw, payloads = _split(chunk)
    if where == "payload":
        buf = bytearray(payloads)
        for i in data.draw(st.sets(st.integers(0, len(buf) - 1), min_size=1, max_size=3)):
            buf[i] ^= data.draw(st.integers(1, 255))
        payloads = bytes(buf)
    elif where == "directory":
        buf = bytearray(dir_raw)
        for i in data.draw(st.sets(st.integers(0, len(buf) - 1), min_size=1, max_size=2)):
            buf[i] ^= data.draw(st.integers(1, 255))
        dir_raw = bytes(buf)
    else:
        payloads = payloads[: data.draw(st.integers(0, len(payloads)))] + data.draw(st.binary(max_size=8))
    forged = _reseal(n, meta, dir_raw, payloads)
    try:
        decoded = decode_chunk(forged, base=bases if context else None)
    except ChunkFormatError:
        return
    for d in decoded.deltas:  # whatever decodes is internally consistent
        assert d.positions.size == d.values.size
