"""The LANES coding (5): the native coder (``_crans.lanes_*``, codec/csrc/lanes.c) against
``lanes_ref``, its pure-Python twin written from docs/wire-format.md; its scalar and AVX2
decoders against each other; chunks through ``encode_chunk``; admission and hostile payloads.

Payloads are compared byte for byte and decoded arrays as integer views; every comparison
has a negative control that must fail."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import (
    BITS_DTYPE,
    ChunkFormatError,
    Coding,
    DeltaOp,
    TensorDelta,
    decode_chunk,
    encode_chunk,
    lanes,
    lanes_ref,
    read_chunk_index,
)
from nemo_dcr.codec.model import coder_params
from nemo_dcr.codec.payload import RecordSpec, check_payload_size

from codec_helpers import random_bits, xor_delta

pytestmark = pytest.mark.skipif(not lanes.available(), reason="native rANS coder (_crans) not built")

if lanes.available():
    from nemo_dcr.codec.lanes import _crans

XOR, OVERWRITE = 0, 1
N = 9000  # three segments of 4096, the last partial


def _record(rng, dtype: str, frac: float, op: int, lo: int = 37, hi: int = N - 11, small: bool = True):
    idx = np.flatnonzero(rng.random(hi - lo) < frac).astype(np.int64) + lo
    vals = random_bits(rng, dtype, idx.size)
    if small:  # small XOR patterns, as in real deltas: the top-bits contexts see skewed data
        vals = (vals & 7).astype(vals.dtype)
    if op == XOR:
        vals[vals == 0] = 1
    return idx, vals


def _args(dtype: str, base, lo: int, hi: int, op: int):
    width, eshift, ebits = coder_params(dtype)
    e_lo = _crans.choose_e_lo(base, lo, hi, width, eshift, ebits) if base is not None else 0
    return (lo, hi, width, eshift, ebits, e_lo, op)


def _native_decode(payload, nnz, base, args):
    width = args[2]
    pos = np.empty(nnz, dtype=np.int64)
    val = np.empty(nnz, dtype=f"<u{width}")
    _crans.lanes_decode(payload, nnz, base, *args, pos, val)
    return pos, val


CASES = [(d, ctx, op, frac) for d in sorted(BITS_DTYPE) for ctx in (False, True) for op in (XOR, OVERWRITE)
         for frac in (0.004, 0.3)]


@pytest.mark.parametrize("dtype,context,op,frac", CASES)
def test_native_matches_the_python_twin(dtype, context, op, frac):
    rng = np.random.default_rng(hash((dtype, context, op, frac)) & 0xFFFF)
    base = random_bits(rng, dtype, N)
    idx, vals = _record(rng, dtype, frac, op, small=frac < 0.1)
    b = base if context else None
    args = _args(dtype, base if context else None, 37, N - 11, op)
    native = _crans.lanes_encode(idx, vals, b, *args)
    assert lanes_ref.encode(idx, vals, b, *args) == native
    for pos, val in (lanes_ref.decode(native, idx.size, b, *args), _native_decode(native, idx.size, b, args)):
        assert np.array_equal(pos, idx)
        assert np.array_equal(val, vals.view(val.dtype))


def test_twin_comparison_can_fail(monkeypatch):
    """Negative control: a twin with one spec constant changed writes other bytes."""
    rng = np.random.default_rng(3)
    base = random_bits(rng, "bfloat16", N)
    idx, vals = _record(rng, "bfloat16", 0.05, XOR)
    args = _args("bfloat16", base, 37, N - 11, XOR)
    native = _crans.lanes_encode(idx, vals, base, *args)
    assert lanes_ref.encode(idx, vals, base, *args) == native
    monkeypatch.setattr(lanes_ref, "LANES", 8)
    assert lanes_ref.encode(idx, vals, base, *args) != native


def test_empty_and_tiny_records():
    rng = np.random.default_rng(4)
    base = random_bits(rng, "bfloat16", 100)
    for ctx in (False, True):
        b = base if ctx else None
        for idx in (np.zeros(0, np.int64), np.array([5], np.int64), np.array([0, 99], np.int64)):
            vals = np.ones(idx.size, np.uint16)
            args = _args("bfloat16", b, 0, 100, XOR)
            native = _crans.lanes_encode(idx, vals, b, *args)
            assert native == lanes_ref.encode(idx, vals, b, *args)
            pos, val = _native_decode(native, idx.size, b, args)
            assert np.array_equal(pos, idx) and np.array_equal(val, vals)


def _levels() -> dict[str, int]:
    prev = _crans.simd()
    out: dict[str, int] = {}
    for level in (0, 1, 2):
        out.setdefault(_crans.set_simd(level), level)
    for level in (2, 1, 0):
        if _crans.set_simd(level) == prev:
            break
    return out


@pytest.mark.parametrize("context", [False, True])
def test_scalar_and_simd_decoders_agree(context):
    """The decoders of every CPU path give the same arrays from the same bytes (and every
    encoder the same bytes), on records long enough for many 16-symbol groups, starting at
    every lane offset between the symbol groups."""
    levels = _levels()
    if len(levels) < 2:
        pytest.skip("this CPU has the scalar path only")
    prev = _crans.simd()
    rng = np.random.default_rng(11)
    n = 200_000
    base = random_bits(rng, "bfloat16", n)
    try:
        # (a range starting mid-block and ending in a partial block too: the block walks' edges)
        for frac, lo, hi in ((0.01, 0, n), (0.05, 0, n), (0.4, 0, n), (0.03, 37, n - 5)):
            idx, vals = _record(rng, "bfloat16", frac, XOR, lo=lo, hi=hi, small=False)
            b = base if context else None
            args = _args("bfloat16", b, lo, hi, XOR)
            got = {}
            for name, level in levels.items():
                assert _crans.set_simd(level) == name
                payload = _crans.lanes_encode(idx, vals, b, *args)
                got[name] = (payload, *_native_decode(payload, idx.size, b, args))
            ref = got["scalar"]
            for name, (payload, pos, val) in got.items():
                assert payload == ref[0], name
                assert np.array_equal(pos, idx) and np.array_equal(val.view(np.int16), vals.view(np.int16)), name
        # negative control: decoding against a base with exponents changed does not give the arrays back
        if context:
            other = base.copy()
            other[idx[:200]] ^= np.uint16(0x0100)
            for name, level in levels.items():
                _crans.set_simd(level)
                try:
                    pos, _ = _native_decode(payload, idx.size, other, args)
                except ValueError:
                    continue
                assert not np.array_equal(pos, idx)
    finally:
        for level in (2, 1, 0):
            if _crans.set_simd(level) == prev:
                break


def test_avx512_without_vbmi2_gives_the_same_bytes_and_arrays():
    """An AVX-512BW CPU without VBMI2 (Skylake-SP, Cascade Lake) runs the AVX-512 block walks
    with the element-by-element output step and the scalar rANS encoder: the same bytes and
    arrays as with VBMI2 (skipped where the CPU lacks it; then there is nothing to compare)."""
    if _crans.simd() != "avx512bw" or not _crans.set_vbmi2(True):
        pytest.skip("this CPU has no AVX-512 VBMI2")
    rng = np.random.default_rng(12)
    n = 150_000
    base = random_bits(rng, "bfloat16", n)
    try:
        for frac, lo, hi in ((0.02, 0, n), (0.3, 61, n - 3)):
            idx, vals = _record(rng, "bfloat16", frac, XOR, lo=lo, hi=hi, small=False)
            args = _args("bfloat16", base, lo, hi, XOR)
            got = []
            for on in (True, False):
                assert _crans.set_vbmi2(on) is on
                payload = _crans.lanes_encode(idx, vals, base, *args)
                got.append((payload, *_native_decode(payload, idx.size, base, args)))
            assert got[0][0] == got[1][0]
            for payload, pos, val in got:
                assert np.array_equal(pos, idx) and np.array_equal(val.view(np.int16), vals.view(np.int16))
    finally:
        _crans.set_vbmi2(True)


def test_portable_bit_select_gives_the_same_bytes_and_arrays():
    """On AMD before Zen 3 (pdep microcoded) the walks select bits with the portable select:
    LANES and BUCKET give the same bytes and arrays with it as with pdep (skipped without BMI2:
    then the portable select is the only one)."""
    prev = _crans.simd()
    if not _crans.set_pdep(True):
        pytest.skip("this CPU has no BMI2, or this process runs the scalar paths")
    rng = np.random.default_rng(13)
    n = 150_000
    base = random_bits(rng, "bfloat16", n)
    try:
        for frac, lo, hi in ((0.02, 0, n), (0.3, 61, n - 3)):
            idx, vals = _record(rng, "bfloat16", frac, XOR, lo=lo, hi=hi, small=False)
            args = _args("bfloat16", base, lo, hi, XOR)
            got = []
            for on in (True, False):
                assert _crans.set_pdep(on) is on  # control: the runs use different selects
                lanes_payload = _crans.lanes_encode(idx, vals, base, *args)
                st = np.empty(_crans.MODEL_BYTES, dtype=np.uint8)
                _crans.model_init(st, 2, 1)
                bucket_payload = _crans.encode(st, idx, vals, base, *args)
                _crans.model_init(st, 2, 1)
                p, v = np.empty(idx.size, np.int64), np.empty(idx.size, vals.dtype)
                _crans.decode(st, bucket_payload, idx.size, base, *args, p, v)
                got.append((lanes_payload, bucket_payload, *_native_decode(lanes_payload, idx.size, base, args), p, v))
            assert got[0][:2] == got[1][:2]
            for _, _, pos, val, p, v in got:
                assert np.array_equal(pos, idx) and np.array_equal(val, vals)
                assert np.array_equal(p, idx) and np.array_equal(v, vals)
    finally:  # this process's paths again, with this CPU's select
        for level in (2, 1, 0):
            if _crans.set_simd(level) == prev:
                break


def test_chunks_round_trip_bit_exact_with_negative_control():
    rng = np.random.default_rng(6)
    n = 50_000
    base = random_bits(rng, "bfloat16", n)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.02)
    target[idx] ^= (random_bits(rng, "bfloat16", idx.size) & 3).astype(np.uint16) | 1
    d = xor_delta("w", "bfloat16", (n,), base, target)
    for context in (False, True):
        chunk = encode_chunk([d], base={"w": base} if context else None, codings=[Coding.LANES])
        (info,) = read_chunk_index(chunk).records
        assert info.coding is Coding.LANES and info.context is context
        out = decode_chunk(chunk, base={"w": base} if context else None).deltas[0]
        applied = base.copy()
        applied[out.positions] ^= out.values
        assert np.array_equal(applied.view(np.int16), target.view(np.int16))
        applied[out.positions[-1]] ^= np.uint16(1)
        assert not np.array_equal(applied.view(np.int16), target.view(np.int16))


def test_records_decode_alone():
    """No state is shared: a record's payload is the same whatever precedes it."""
    rng = np.random.default_rng(8)
    idx, vals = _record(rng, "bfloat16", 0.05, XOR)
    d = TensorDelta(name="b", dtype="bfloat16", shape=(N,), op=DeltaOp.XOR, positions=idx, values=vals)
    idx2, vals2 = _record(rng, "bfloat16", 0.1, XOR)
    first = TensorDelta(name="a", dtype="bfloat16", shape=(N,), op=DeltaOp.XOR, positions=idx2, values=vals2)
    alone = encode_chunk([d], codings=[Coding.LANES])
    after = encode_chunk([first, d], codings=[Coding.LANES])
    ia, ib = read_chunk_index(alone).records, read_chunk_index(after).records
    assert ia[0].payload_bytes == ib[1].payload_bytes
    # the last payload ends before payloads_crc (4 bytes) and the trailer (8)
    assert alone[-12 - ia[0].payload_bytes:-12] == after[-12 - ib[1].payload_bytes:-12]


def test_admission_bound():
    spec = RecordSpec(dtype="bfloat16", shape=(1 << 30,), op=DeltaOp.XOR, lo=0, hi=1 << 30, nnz=757 * 100 + 1)
    check_payload_size(spec, Coding.LANES, 100)
    over = RecordSpec(dtype="bfloat16", shape=(1 << 30,), op=DeltaOp.XOR, lo=0, hi=1 << 30, nnz=757 * 100 + 2)
    with pytest.raises(ChunkFormatError):
        check_payload_size(over, Coding.LANES, 100)


def test_densest_honest_payload_is_within_the_bound():
    """All elements changed by the same XOR of 1, context-free: the cheapest record LANES can
    code (both tables as skewed as the cap allows); its entries per byte stay under 757."""
    n = 1 << 20
    idx = np.arange(n, dtype=np.int64)
    vals = np.ones(n, np.uint16)
    args = _args("bfloat16", None, 0, n, XOR)
    payload = _crans.lanes_encode(idx, vals, None, *args)
    assert n <= lanes.max_entries(len(payload))
    assert n / len(payload) > 100  # the bound is not absurdly loose for this case


@pytest.mark.parametrize("context", [False, True])
def test_hostile_payloads_raise_value_error_only(context):
    """Byte flips, truncations and extensions of a valid payload: ValueError or arrays, never
    a crash; the twin agrees on whether the result is valid where it decodes."""
    rng = np.random.default_rng(12)
    base = random_bits(rng, "bfloat16", N)
    idx, vals = _record(rng, "bfloat16", 0.03, XOR)
    b = base if context else None
    args = _args("bfloat16", b, 37, N - 11, XOR)
    good = _crans.lanes_encode(idx, vals, b, *args)
    rejected = 0
    for trial in range(300):
        buf = bytearray(good)
        kind = trial % 3
        if kind == 0:
            for i in rng.choice(len(buf), 2, replace=False):
                buf[i] ^= int(rng.integers(1, 256))
        elif kind == 1:
            buf = buf[: int(rng.integers(0, len(buf)))]
        else:
            buf += bytes(rng.integers(0, 256, int(rng.integers(1, 9))).astype(np.uint8))
        try:
            _native_decode(bytes(buf), idx.size, b, args)
        except ValueError:
            rejected += 1
    assert rejected > 250


def test_fuzz_corpus_is_lanes_coded():
    """tests/codec/test_fuzz.py mutates LANES_CHUNKS: they must really hold LANES records."""
    import test_fuzz

    for ctx, (chunk, _, _) in test_fuzz.LANES_CHUNKS.items():
        assert Coding.LANES in {r.coding for r in read_chunk_index(chunk).records}


def test_threads_decode_concurrently():
    """The decoder releases the GIL and keeps its work memory per thread: records decoded on
    several threads at once (different sizes, so the buffers grow while others are in use)
    give the same arrays as one thread."""
    import threading

    rng = np.random.default_rng(13)
    jobs = []
    for i, n in enumerate((20_000, 150_000, 60_000, 250_000)):
        base = random_bits(rng, "bfloat16", n)
        idx, vals = _record(rng, "bfloat16", 0.03, XOR, lo=0, hi=n, small=False)
        b = base if i % 2 else None
        args = _args("bfloat16", b, 0, n, XOR)
        jobs.append((_crans.lanes_encode(idx, vals, b, *args), idx, vals, b, args))
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(5):
            for j in range(len(jobs)):
                payload, idx, vals, b, args = jobs[(j + k) % len(jobs)]
                pos, val = _native_decode(payload, idx.size, b, args)
                if not (np.array_equal(pos, idx) and np.array_equal(val.view(np.int16), vals.view(np.int16))):
                    errors.append(f"thread {k}, job {(j + k) % len(jobs)}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # negative control: the comparison sees a decoded array that differs
    payload, idx, vals, b, args = jobs[0]
    pos, _ = _native_decode(payload, idx.size, b, args)
    pos[0] += 1
    assert not np.array_equal(pos, idx)
