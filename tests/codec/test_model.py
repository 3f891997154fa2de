"""The native MODEL coder against its pure-Python twin, and its own invariants."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import BITS_DTYPE, DeltaOp
from nemo_dcr.codec import model, model_ref
from nemo_dcr.codec.payload import RecordSpec

from codec_helpers import FLOAT_SPECIALS, needs_native, random_bits

pytestmark = needs_native


def _record(rng, dtype, n, rate, op, specials=False):
    base = random_bits(rng, dtype, n)
    if specials and dtype in FLOAT_SPECIALS:
        base[::5] = np.array(FLOAT_SPECIALS[dtype], dtype=base.dtype)[rng.integers(0, len(FLOAT_SPECIALS[dtype]), base[::5].size)]
    pos = np.flatnonzero(rng.random(n) < rate).astype(np.int64)
    if op is DeltaOp.XOR:
        # mostly small ulp-like changes, some arbitrary patterns
        small = (np.uint64(1) << rng.integers(0, 4, pos.size).astype(np.uint64)) - np.uint64(1)
        vals = np.where(rng.random(pos.size) < 0.8, small + np.uint64(1), random_bits(rng, dtype, pos.size))
        vals = vals.astype(BITS_DTYPE[dtype])
        vals[vals == 0] = 1
    else:
        vals = random_bits(rng, dtype, pos.size)
    return base, pos, vals


def _c_encode(state, dtype, pos, vals, base, lo, hi, shape, op):
    width, eshift, ebits = model.coder_params(dtype)
    e_lo = model.choose_e_lo(dtype, base[lo:hi]) if base is not None else 0
    args = (base, lo, hi, width, eshift, ebits, e_lo, 0 if op is DeltaOp.XOR else 1)
    return model._cans.encode(state, pos, vals, *args), args


@pytest.mark.parametrize("dtype", sorted(BITS_DTYPE))
@pytest.mark.parametrize("context", [False, True])
def test_native_and_reference_agree(dtype, context):
    rng = np.random.default_rng(hash((dtype, context)) % 2**32)
    state = np.empty(model._cans.MODEL_BYTES, np.uint8)
    model._cans.model_init(state)
    dstate = state.copy()
    ref_enc, ref_dec = model_ref.RefModel(), model_ref.RefModel()
    # Three records in a row share the adaptive state, as in a chunk.
    for n, rate, op, rng_range, shape in [(600, 0.05, DeltaOp.XOR, (0, 600), (20, 30)),
                                          (500, 0.3, DeltaOp.OVERWRITE, (100, 420), (500,)),
                                          (300, 1.0, DeltaOp.XOR, (0, 300), (3, 10, 10))]:
        base, pos, vals = _record(rng, dtype, n, rate, op, specials=True)
        lo, hi = rng_range
        keep = (pos >= lo) & (pos < hi)
        pos, vals = pos[keep], vals[keep]
        b = base if context else None
        stream, args = _c_encode(state, dtype, pos, vals, b, lo, hi, shape, op)
        ref_stream = model_ref.encode(ref_enc, pos, vals, *args)
        assert stream == ref_stream
        # each decoder reads the other's stream
        rpos, rvals = model_ref.decode(ref_dec, stream, pos.size, *args)
        assert np.array_equal(rpos, pos) and rvals == [int(v) for v in vals]
        cpos = np.empty(pos.size, np.int64)
        cvals = np.empty(pos.size, vals.dtype)
        model._cans.decode(dstate, ref_stream, pos.size, *args, cpos, cvals)
        assert np.array_equal(cpos, pos) and np.array_equal(cvals, vals)


def test_reference_detects_a_changed_value():
    """Negative control: the agreement check is not vacuous."""
    rng = np.random.default_rng(3)
    base, pos, vals = _record(rng, "bfloat16", 400, 0.1, DeltaOp.XOR)
    state = np.empty(model._cans.MODEL_BYTES, np.uint8)
    model._cans.model_init(state)
    stream, args = _c_encode(state, "bfloat16", pos, vals, None, 0, 400, (400,), DeltaOp.XOR)
    bad = vals.copy()
    bad[0] ^= np.uint16(0x40)
    assert model_ref.encode(model_ref.RefModel(), pos, bad, *args) != stream


@pytest.mark.parametrize("context", [False, True])
def test_state_is_shared_only_when_kept(context):
    """A trial encoding that loses to another coding must not advance the chunk's state."""
    rng = np.random.default_rng(5)
    base, pos, vals = _record(rng, "bfloat16", 2000, 0.02, DeltaOp.XOR)
    spec = RecordSpec("bfloat16", (2000,), DeltaOp.XOR, 0, 2000, pos.size)
    states = model.ModelStates()
    before = states.get("bfloat16", context).copy()
    payload, e_lo, new_state = model.encode(spec, pos, vals, base if context else None, states)
    assert np.array_equal(states.get("bfloat16", context), before)
    assert not np.array_equal(new_state, before)
    dstates = model.ModelStates()
    spec = RecordSpec("bfloat16", (2000,), DeltaOp.XOR, 0, 2000, pos.size, param=e_lo)
    p, v = model.decode(spec, memoryview(payload), base if context else None, dstates)
    assert np.array_equal(p, pos) and np.array_equal(v, vals)
    assert np.array_equal(dstates.get("bfloat16", context), new_state)


def test_corrupt_streams_raise_value_error_only():
    rng = np.random.default_rng(11)
    base, pos, vals = _record(rng, "float32", 3000, 0.05, DeltaOp.XOR)
    state = np.empty(model._cans.MODEL_BYTES, np.uint8)
    model._cans.model_init(state)
    stream, args = _c_encode(state.copy(), "float32", pos, vals, base, 0, 3000, (3000,), DeltaOp.XOR)
    for trial in range(300):
        s = bytearray(stream)
        kind = trial % 3
        if kind == 0:
            s[rng.integers(0, len(s))] ^= int(rng.integers(1, 256))
        elif kind == 1:
            s = s[: rng.integers(0, len(s))]
        else:
            s += bytes(rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8))
        cpos = np.empty(pos.size, np.int64)
        cvals = np.empty(pos.size, vals.dtype)
        try:
            model._cans.decode(state.copy(), bytes(s), pos.size, *args, cpos, cvals)
        except ValueError:
            continue
        # A stream that still decodes must at least give valid positions.
        assert np.all(np.diff(cpos) > 0) and (cpos.size == 0 or (cpos[0] >= 0 and cpos[-1] < 3000))


def test_compresses_ulp_steps_well_in_context_mode():
    """Given the base, a +-1 ulp change is a sign bit; without it, the XOR's carry chain
    (trailing ones of the mantissa) must be coded too.  Every element changes, so no
    position flags are coded and only value costs are compared."""
    rng = np.random.default_rng(9)
    n = 50_000
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    base = (w.view(np.uint32) >> 16).astype(np.uint16)
    pos = np.arange(n, dtype=np.int64)
    step = np.where(rng.random(pos.size) < 0.5, 1, -1).astype(np.int64)
    new = (base[pos].astype(np.int64) + step).astype(np.uint16)  # same sign: +-1 in the bit pattern
    vals = base[pos] ^ new
    spec = RecordSpec("bfloat16", (n,), DeltaOp.XOR, 0, n, pos.size)
    free, _, _ = model.encode(spec, pos, vals, None, model.ModelStates())
    ctx, _, _ = model.encode(spec, pos, vals, base, model.ModelStates())
    assert len(ctx) < 0.8 * len(free)
