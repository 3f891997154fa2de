"""apply(decode(encode(delta))) on the base gives the target, bit for bit (integer views)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr.codec import (
    BITS_DTYPE,
    DeltaOp,
    MissingBaseError,
    TensorDelta,
    apply_delta_,
    chunk_digest,
    decode_chunk,
    encode_chunk,
)

from codec_helpers import FLOAT_SPECIALS, needs_native, overwrite_delta, random_bits, xor_delta

DTYPES = sorted(BITS_DTYPE)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    numel = math.prod(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    rate = draw(st.sampled_from([0.0, 1.0, 0.005, 0.05, 0.3]) | st.floats(0.0, 1.0))
    lo = draw(st.integers(0, numel))
    hi = draw(st.integers(lo, numel))
    whole = draw(st.booleans())
    op = draw(st.sampled_from([DeltaOp.XOR, DeltaOp.OVERWRITE]))
    context = draw(st.booleans())
    specials = draw(st.booleans())
    return dtype, shape, seed, rate, (0, numel) if whole else (lo, hi), op, context, specials


def _make(dtype, shape, seed, rate, rng_range, specials):
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    base = random_bits(rng, dtype, n)
    if specials and dtype in FLOAT_SPECIALS and n:
        sp = np.array(FLOAT_SPECIALS[dtype], dtype=BITS_DTYPE[dtype])
        base[rng.integers(0, n, size=n // 2 + 1)] = rng.choice(sp, size=n // 2 + 1)
    target = base.copy()
    lo, hi = rng_range
    changed = np.zeros(n, dtype=bool)
    changed[lo:hi] = rng.random(hi - lo) < rate
    idx = np.flatnonzero(changed)
    new = random_bits(rng, dtype, idx.size)
    if specials and dtype in FLOAT_SPECIALS and idx.size:
        sp = np.array(FLOAT_SPECIALS[dtype], dtype=BITS_DTYPE[dtype])
        new[: idx.size // 2] = rng.choice(sp, size=idx.size // 2)
    target[idx] = new
    return base, target, idx


def _roundtrip(deltas, base_bits, target_bits, *, context: bool):
    base_map = {d.name: base_bits[d.name] for d in deltas} if context else None
    chunk = encode_chunk(deltas, meta={"k": "v"}, base=base_map)
    decoded = decode_chunk(chunk, base=base_map)
    assert decoded.meta == {"k": "v"}
    assert decoded.size == len(chunk)
    out = {k: v.copy() for k, v in base_bits.items()}
    for d in decoded.deltas:
        apply_delta_(out[d.name], d)
    for k in target_bits:
        assert out[k].dtype == target_bits[k].dtype
        assert np.array_equal(out[k], target_bits[k]), k
    return chunk, decoded


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_roundtrip_property(case):
    dtype, shape, seed, rate, rng_range, op, context, specials = case
    base, target, idx = _make(dtype, shape, seed, rate, rng_range, specials)
    if op is DeltaOp.XOR:
        d = xor_delta("t", dtype, shape, base, target, rng_range)
    else:
        # An overwrite may also name unchanged positions (e.g. a journal repair).
        extra = np.arange(rng_range[0], rng_range[1], 3)
        pos = np.union1d(idx, extra).astype(np.int64)
        d = overwrite_delta("t", dtype, shape, pos, target, rng_range)
    expect = base.copy()
    expect[rng_range[0]:rng_range[1]] = target[rng_range[0]:rng_range[1]]
    _, decoded = _roundtrip([d], {"t": base}, {"t": expect}, context=context)
    (got,) = decoded.deltas
    assert (got.name, got.dtype, got.shape, got.op, got.element_range) == (d.name, d.dtype, d.shape, d.op, d.element_range)
    assert np.array_equal(got.positions, d.positions) and np.array_equal(got.values, d.values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.1, 1.0])
def test_every_dtype_and_rate(dtype, context, rate, rng):
    n = 3000
    base = random_bits(rng, dtype, n)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < rate)
    target[idx] ^= np.maximum(random_bits(rng, dtype, idx.size), 1).astype(base.dtype)
    d = xor_delta("w", dtype, (30, 100), base, target)
    assert d.nnz == idx.size
    chunk, _ = _roundtrip([d], {"w": base}, {"w": target}, context=context)
    # A record never costs more than its dense bytes (plus fixed framing).
    assert len(chunk) <= n * base.itemsize + 200


def test_disjoint_subranges_of_one_tensor_in_one_chunk(rng):
    base = random_bits(rng, "bfloat16", 1000)
    target = base.copy()
    idx = rng.choice(1000, 100, replace=False)
    target[idx] ^= np.uint16(0x0101)
    parts = [xor_delta("w", "bfloat16", (10, 100), base, target, r) for r in [(0, 250), (250, 700), (700, 1000)]]
    _roundtrip(parts, {"w": base}, {"w": target}, context=False)
    _roundtrip(parts, {"w": base}, {"w": target}, context=True)


def test_zero_valued_xor_entries_are_dropped():
    d = TensorDelta(name="w", dtype="bfloat16", shape=(4,), op=DeltaOp.XOR,
                    positions=np.array([0, 1, 2], np.int64), values=np.array([0, 5, 0], np.uint16))
    (got,) = decode_chunk(encode_chunk([d])).deltas
    assert got.positions.tolist() == [1] and got.values.tolist() == [5]


def test_negative_control_one_flipped_bit_is_detected(rng):
    base = random_bits(rng, "bfloat16", 500)
    target = base.copy()
    target[rng.choice(500, 40, replace=False)] ^= np.uint16(3)
    d = xor_delta("w", "bfloat16", (500,), base, target)
    (got,) = decode_chunk(encode_chunk([d])).deltas
    out = base.copy()
    apply_delta_(out, got)
    assert np.array_equal(out, target)
    bad_vals = got.values.copy()
    bad_vals[7] ^= np.uint16(1 << 4)
    bad = TensorDelta(name=got.name, dtype=got.dtype, shape=got.shape, op=got.op,
                      positions=got.positions, values=bad_vals)
    out2 = base.copy()
    apply_delta_(out2, bad)
    assert not np.array_equal(out2, target)
    assert int(np.count_nonzero(out2 != target)) == 1


@needs_native
def test_context_record_needs_base_and_rejects_wrong_base(rng):
    from nemo_dcr.codec import ChunkFormatError

    base = random_bits(rng, "bfloat16", 2000)
    target = base.copy()
    target[rng.choice(2000, 200, replace=False)] += np.uint16(1)
    d = xor_delta("w", "bfloat16", (20, 100), base, target)
    chunk = encode_chunk([d], base={"w": base})
    with pytest.raises(MissingBaseError):
        decode_chunk(chunk)
    assert decode_chunk(chunk, base={"w": base}).records[0].context
    wrong = base.copy()
    wrong[::7] ^= np.uint16(0x0180)
    with pytest.raises(ChunkFormatError):
        decode_chunk(chunk, base={"w": wrong})


def test_chunk_digest_is_sha256_of_bytes():
    import hashlib

    data = encode_chunk([])
    assert chunk_digest(data) == "sha256:" + hashlib.sha256(data).hexdigest()
    assert decode_chunk(data).deltas == []


def test_apply_rejects_mismatched_target_without_writing(rng):
    base = random_bits(rng, "float32", 10)
    target = base.copy()
    target[3] ^= np.uint32(9)
    d = xor_delta("w", "float32", (10,), base, target)
    wrong_dtype = base.view(np.uint16).copy()
    before = wrong_dtype.copy()
    with pytest.raises(ValueError):
        apply_delta_(wrong_dtype, d)
    assert np.array_equal(wrong_dtype, before)
    with pytest.raises(ValueError):
        apply_delta_(base[:9].copy(), d)


@needs_native
@pytest.mark.parametrize("context", [False, True])
def test_mixed_codings_in_one_chunk_keep_the_shared_model_state_in_step(rng, context):
    """Records of one dtype share MODEL state; records that end up DENSE or SPARSE_RAW in
    between must not desynchronise the decoder."""
    from nemo_dcr.codec import Coding

    bases, targets, deltas = {}, {}, []
    for i, (n, rate) in enumerate([(5000, 0.02), (64, 1.0), (3, 0.7), (8000, 0.05), (200, 0.0), (4000, 0.01)]):
        b = random_bits(rng, "bfloat16", n)
        t = b.copy()
        idx = np.flatnonzero(rng.random(n) < rate)
        t[idx] ^= np.maximum(random_bits(rng, "bfloat16", idx.size), 1).astype(np.uint16)
        name = f"t{i}"
        bases[name], targets[name] = b, t
        deltas.append(xor_delta(name, "bfloat16", (n,), b, t))
    chunk, decoded = _roundtrip(deltas, bases, targets, context=context)
    codings = {r.coding for r in decoded.records}
    assert Coding.MODEL in codings and len(codings) >= 2


def test_encoder_refuses_what_default_decoders_would_refuse():
    d = TensorDelta(name="x" * 2000, dtype="bfloat16", shape=(1,), op=DeltaOp.XOR,
                    positions=np.array([0], np.int64), values=np.array([1], np.uint16))
    with pytest.raises(ValueError):
        encode_chunk([d])
    with pytest.raises(ValueError):
        encode_chunk([], meta={f"k{i}": "" for i in range(5000)})
