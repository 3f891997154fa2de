"""stream_chunk: decode_chunk one record at a time, with skips that respect the coder state
MODEL and BUCKET records share along a chunk; and the SPARSE_ZSTD decoder that inflates
straight into its output arrays."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import zstandard

from nemo_dcr.codec import (
    ChunkFormatError,
    ChunkValidationError,
    Coding,
    DeltaOp,
    MissingBaseError,
    TensorDelta,
    decode_chunk,
    encode_chunk,
    read_chunk_index,
    stream_chunk,
)
from nemo_dcr.codec import raw as raw_mod
from nemo_dcr.codec.payload import RecordSpec, decode_payload

from codec_helpers import needs_native, random_bits, xor_delta

SPECS = [("a", "bfloat16", (64, 64), 0.05), ("b", "bfloat16", (4096,), 0.2), ("c", "float32", (300,), 0.3),
         ("d", "bfloat16", (16,), 1 / 16), ("e", "int64", (50,), 0.1)]


def _chunk(rng, *, context: bool = False, codings=None):
    bases, deltas = {}, []
    for name, dtype, shape, rate in SPECS:
        n = int(np.prod(shape))
        b = random_bits(rng, dtype, n)
        t = b.copy()
        idx = np.flatnonzero(rng.random(n) < rate)
        t[idx] = random_bits(rng, dtype, idx.size)
        bases[name] = b
        deltas.append(xor_delta(name, dtype, shape, b, t))
    return encode_chunk(deltas, meta={"k": "v"}, base=bases if context else None, codings=codings), bases


def _same(x: TensorDelta, y: TensorDelta) -> bool:
    return (x.name == y.name and x.element_range == y.element_range and x.values.dtype == y.values.dtype
            and np.array_equal(x.positions, y.positions) and np.array_equal(x.values, y.values))


@pytest.mark.parametrize("codings", [None, [Coding.SPARSE_ZSTD], pytest.param([Coding.MODEL], marks=needs_native)])
@pytest.mark.parametrize("context", [False, pytest.param(True, marks=needs_native)])
def test_stream_yields_what_decode_chunk_returns(rng, context, codings):
    data, bases = _chunk(rng, context=context, codings=codings)
    base = bases if context else None
    whole = decode_chunk(data, base=base)
    stream = stream_chunk(data, base=base)
    assert stream.meta == whole.meta and stream.records == whole.records and stream.size == len(data)
    assert stream.skipped == [None] * len(SPECS)
    got = list(stream)
    assert [r.info for r in got] == whole.records and all(r.skipped is None for r in got)
    assert all(_same(r.delta, d) for r, d in zip(got, whole.deltas))
    # negative control: one flipped bit is seen
    d = whole.deltas[0]
    flipped = TensorDelta(name=d.name, dtype=d.dtype, shape=d.shape, op=d.op, positions=d.positions,
                          values=d.values ^ np.asarray(1, d.values.dtype), element_range=d.element_range)
    assert not _same(got[0].delta, flipped)


@needs_native
def test_a_skipped_record_takes_the_rest_of_its_coder_state_along(rng):
    data, _ = _chunk(rng)
    infos = read_chunk_index(data).records
    stateful = {i.name for i in infos if i.coding in (Coding.MODEL, Coding.BUCKET)}
    assert {"a", "b", "c"} <= stateful  # a and b share the bf16 state, c has the float32 one
    stream = stream_chunk(data, skip=lambda i: "too big" if i.name == "a" else None)
    why = dict(zip((i.name for i in infos), stream.skipped))
    assert why["a"] == "too big"
    assert why["b"] == f"record 'b': its {infos[1].coding.name} coder state follows record 'a', which is not decoded"
    assert why["c"] is None and why["e"] is None
    # d (bf16): skipped only if it is in a's state; a raw coding has none
    d = infos[3]
    assert (why["d"] is not None) == (d.coding is infos[0].coding and d.coding in (Coding.MODEL, Coding.BUCKET))
    whole = {x.name: x for x in decode_chunk(data).deltas}
    for r in stream:
        assert r.skipped == why[r.info.name]
        assert (r.delta is None) == (r.skipped is not None)
        if r.delta is not None:
            assert _same(r.delta, whole[r.info.name])


def test_skipping_a_raw_record_skips_nothing_else(rng):
    data, _ = _chunk(rng, codings=[Coding.SPARSE_ZSTD])  # no adaptive state anywhere
    stream = stream_chunk(data, skip=lambda i: "no" if i.name == "a" else None)
    assert stream.skipped == ["no"] + [None] * (len(SPECS) - 1)
    assert [r.delta is None for r in stream] == [True] + [False] * (len(SPECS) - 1)


@needs_native
def test_only_records_to_be_decoded_need_a_base(rng):
    data, bases = _chunk(rng, context=True)
    with pytest.raises(MissingBaseError):  # at the call, before any record is decoded
        stream_chunk(data)
    stream = stream_chunk(data, skip=lambda i: "needs the base" if i.context else None)
    got = list(stream)
    assert any(r.info.context for r in got)
    assert all((r.delta is None) == r.info.context for r in got)


def test_admission_comes_before_the_first_record(rng, monkeypatch):
    from nemo_dcr.codec import chunk as chunk_mod

    data, _ = _chunk(rng)
    monkeypatch.setattr(chunk_mod, "decode_payload", lambda *a, **k: pytest.fail("a payload was decoded"))
    with pytest.raises(ChunkValidationError, match="record 'a': name is not one of"):
        stream_chunk(data, expect={"z": ("bfloat16", (4,))})


def test_the_stream_keeps_no_reference_to_what_it_yielded(rng):
    data, _ = _chunk(rng)
    it = iter(stream_chunk(data))
    rec = next(it)
    values = weakref.ref(rec.delta.values)
    positions = weakref.ref(rec.delta.positions)
    del rec
    next(it)
    gc.collect()
    assert values() is None and positions() is None
    # control: a record still held keeps its arrays
    rec = next(it)
    held = weakref.ref(rec.delta.values)
    next(it)
    gc.collect()
    assert held() is not None


# ----------------------------------------------------------------- SPARSE_ZSTD, inflated in place

def _zstd_record(dtype: str, numel: int, positions: np.ndarray, rng) -> tuple[RecordSpec, bytes, np.ndarray]:
    vals = np.maximum(random_bits(rng, dtype, positions.size), 1)
    spec = RecordSpec(dtype=dtype, shape=(numel,), op=DeltaOp.XOR, lo=0, hi=numel, nnz=positions.size)
    return spec, raw_mod.encode_zstd(spec, positions, vals), vals


@pytest.mark.parametrize("small_steps", [False, True])
@pytest.mark.parametrize("dtype, numel, n", [
    ("bfloat16", 1 << 12, 100),
    ("int64", 1 << 16, 5000),
    ("float32", (1 << 33) + 5, 1000),  # a range over 2**32: 8-byte gaps
])
def test_sparse_zstd_decodes_in_place(rng, monkeypatch, dtype, numel, n, small_steps):
    if small_steps:  # many gap blocks, and inflated pieces that straddle the gaps/values boundary
        monkeypatch.setattr(raw_mod, "_GAP_BLOCK", 7)
        monkeypatch.setattr(raw_mod, "_ZSTD_FEED", 5)
    pos = np.unique(rng.integers(0, numel, size=n, dtype=np.int64))
    pos[-1] = numel - 1  # the last element, too
    pos = np.unique(pos)
    spec, payload, vals = _zstd_record(dtype, numel, pos, rng)
    got_pos, got_val = decode_payload(spec, Coding.SPARSE_ZSTD, memoryview(payload), None, None)
    assert got_pos.dtype == np.int64 and got_val.dtype == vals.dtype
    assert np.array_equal(got_pos, pos) and np.array_equal(got_val, vals)
    assert got_val.flags.writeable and got_pos.flags.writeable
    assert not np.array_equal(got_pos[:-1], pos[1:])  # control: a shift is seen


def test_sparse_zstd_frames_are_read_as_before(rng):
    """The first frame is the record (bytes after it are ignored, as ZstdDecompressor.decompress
    ignores them); a truncated frame, or one holding more or less than the record needs, is
    refused."""
    pos = np.arange(0, 4000, 7, dtype=np.int64)
    spec, payload, vals = _zstd_record("bfloat16", 4096, pos, rng)
    raw = zstandard.ZstdDecompressor().decompress(payload)

    def dec(p: bytes):
        return decode_payload(spec, Coding.SPARSE_ZSTD, memoryview(p), None, None)

    for ok in [payload, payload + b"junk", payload + payload,
               zstandard.ZstdCompressor(write_content_size=False).compress(raw)]:
        got_pos, got_val = dec(ok)
        assert np.array_equal(got_pos, pos) and np.array_equal(got_val, vals)
    no_size = zstandard.ZstdCompressor(write_content_size=False)
    for bad, msg in [(payload[:-1], "truncated"), (no_size.compress(raw + b"\0"), "more than"),
                     (no_size.compress(raw[:-1]), "holds"), (b"\0" * 16, "bad zstd frame")]:
        with pytest.raises(ChunkFormatError, match=msg):
            dec(bad)


def test_sparse_zstd_gap_outside_the_range_is_refused():
    spec = RecordSpec(dtype="bfloat16", shape=(8,), op=DeltaOp.XOR, lo=0, hi=8, nnz=1)
    payload = zstandard.ZstdCompressor().compress(np.array([8], "<u4").tobytes() + b"\1\0")
    with pytest.raises(ChunkFormatError, match="gap outside"):
        decode_payload(spec, Coding.SPARSE_ZSTD, memoryview(payload), None, None)
    control = zstandard.ZstdCompressor().compress(np.array([7], "<u4").tobytes() + b"\1\0")
    assert decode_payload(spec, Coding.SPARSE_ZSTD, memoryview(control), None, None)[0].tolist() == [7]
