"""The native BUCKET coder (``_crans``, codec/csrc/rans.c) against ``bucket_ref``, its
pure-Python twin written from docs/wire-format.md; and the native coder's AVX-512 block
scan against its scalar one (the reference cannot tell which one the native coder used).

Payloads are compared byte for byte and decoded arrays as integers; every comparison has a
negative control (a reference with one constant of the spec changed must disagree)."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from nemo_dcr.codec import BITS_DTYPE, bucket, bucket_ref, model
from nemo_dcr.codec.bucket import _crans

from codec_helpers import FLOAT_SPECIALS

pytestmark = pytest.mark.skipif(not bucket.available(), reason="native rANS coder (_crans) not built")

DTYPES = sorted(BITS_DTYPE)
XOR, OVERWRITE = 0, 1
N = 20_100  # tensor length: the longest record range (escape) is 20_011 from 11
SEG = 4096


def _native_state(width: int, context: bool) -> np.ndarray:
    st = np.empty(_crans.MODEL_BYTES, dtype=np.uint8)
    _crans.model_init(st, width, int(context))
    return st


def _base(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Base bits shaped like weights: floats around 0.02 (a dominant exponent bucket and
    its neighbours) with a few specials (not the largest finite value: e_lo would then put
    every weight in bucket 0), integers of spread-out bit lengths."""
    bits = BITS_DTYPE[dtype]
    W = 8 * bits.itemsize
    if dtype in ("bfloat16", "float32"):
        w = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
        b = (w >> 16).astype(bits) if dtype == "bfloat16" else w
    elif dtype == "float16":
        b = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)
    elif dtype.startswith("float8"):
        eshift, ebits = model.EXPONENT_FIELD[dtype]
        e = np.clip(np.rint(rng.normal((1 << ebits) / 2, 1.5, n)), 0, (1 << ebits) - 1).astype(np.uint8)
        b = ((rng.integers(0, 2, n, dtype=np.uint8) << 7) | (e << eshift)
             | rng.integers(0, 1 << eshift, n, dtype=np.uint8)).astype(bits)
    elif dtype == "bool":
        return rng.integers(0, 2, n, dtype=bits)
    else:  # half uniform bits (one dominant bit length), half shifted down (every bit length)
        b = rng.integers(0, np.iinfo(bits).max, n, dtype=bits, endpoint=True)
        b[::2] >>= rng.integers(0, W, b[::2].size).astype(bits)
    if dtype in FLOAT_SPECIALS:  # NaN, Inf, zeros, subnormals: buckets clamp at 31 and at 0
        eshift, ebits = model.EXPONENT_FIELD[dtype]
        sp = np.array([x for x in FLOAT_SPECIALS[dtype] if (x >> eshift) & ((1 << ebits) - 1) in (0, (1 << ebits) - 1)],
                      dtype=bits)
        b[rng.integers(0, n, 40)] = sp[rng.integers(0, sp.size, 40)]
    return b


def _new(rng: np.random.Generator, dtype: str, old: np.ndarray) -> np.ndarray:
    """New bits, all different from the old: mostly steps of 1-3 in the bit pattern
    (ulp-like), 10% arbitrary; bool flips."""
    bits = BITS_DTYPE[dtype]
    if dtype == "bool":
        return old ^ bits.type(1)
    mask = np.uint64((1 << (8 * bits.itemsize)) - 1)
    step = rng.choice(np.array([-3, -2, -1, 1, 2, 3], np.int64), old.size).view(np.uint64)
    new = ((old.astype(np.uint64) + step) & mask).astype(bits)
    wild = rng.random(old.size) < 0.1
    new[wild] = rng.integers(0, np.iinfo(bits).max, int(wild.sum()), dtype=bits, endpoint=True)
    new[new == old] ^= bits.type(1)  # every element changes (an XOR no-op would be dropped)
    return new


def _far(dtype: str, old: np.ndarray) -> np.ndarray:
    """New bits with ord(new) - ord(old) = 2^(W-1), i.e. k = -2^(W-1) read as signed, so
    h = W: for integers (ord = identity) that is old ^ signbit; for floats it is ~old
    (positive old: ord(old) = old | s, flipping s gives old, whose iord is ~old; negative
    old: ord(old) = ~old, flipping s gives ~old | s, whose iord is ~old & ~s = ~old)."""
    bits = BITS_DTYPE[dtype]
    if dtype in model.EXPONENT_FIELD:
        return ~old
    return old ^ bits.type(1 << (8 * bits.itemsize - 1))


def _buckets(dtype: str, b: np.ndarray, e_lo: int) -> np.ndarray:
    eshift, ebits = model.EXPONENT_FIELD.get(dtype, (0, 0))
    if ebits:
        e = ((b.astype(np.int64) >> eshift) & ((1 << ebits) - 1)) - e_lo
    else:
        e = np.array([int(x).bit_length() for x in b], dtype=np.int64)
    return np.clip(e, 0, 31)


def _records(rng, dtype, base, op):
    """(name, lo, hi, positions, values) of a chunk's records, in order: every change rate,
    ranges with lo > 0 and lengths not multiples of 64 or 4096, several 4096-segments, and
    a record of escapes (gaps far past 31 * 2^k, h = W, k = -2^(W-1))."""
    bits = BITS_DTYPE[dtype]
    W = 8 * bits.itemsize
    out = []
    for name, lo, hi, rate in [("sparse 1%, 4 segments", 37, 37 + 3 * SEG + 1001, 0.01),
                               ("none", 5, 5 + 777, 0.0),
                               ("30%", 3, 3 + 1507, 0.3),
                               ("all", 321, 321 + 333, 1.0)]:
        pos = (np.flatnonzero(rng.random(hi - lo) < rate) + lo).astype(np.int64)
        out.append((name, lo, hi, pos, _new(rng, dtype, base[pos])))
    # Escapes: the first three and the last element of the range's most populous bucket
    # (rank gaps of thousands in it), plus the range's last element.
    lo, hi = 11, 11 + 20_011
    bk = _buckets(dtype, base[lo:hi], model.choose_e_lo(dtype, base[lo:hi]))
    members = np.flatnonzero(bk == np.bincount(bk).argmax()) + lo
    pos = np.unique(np.r_[members[:3], members[-1], hi - 1]).astype(np.int64)
    new = _far(dtype, base[pos])
    new[-1] = np.iinfo(bits).max  # top bit set: h = W context-free, for an overwrite too
    out.append(("escapes", lo, hi, pos, new))
    recs = []
    for name, lo, hi, pos, new in out:
        vals = (base[pos] ^ new) if op == XOR else new
        if op == XOR:  # the encoder drops XOR no-ops
            keep = vals != 0
            pos, vals = pos[keep], vals[keep]
        recs.append((name, lo, hi, pos, vals.astype(bits)))
    assert recs[0][3].size > 50 and recs[1][3].size == 0 and recs[3][3].size == 333 and W >= 8
    return recs


def _ref_state_key(st: bucket_ref.RefState):
    ctxs = [*st.q, *st.h, *st.t.values()]
    return (st.gsum, st.gcnt, [(c.cnt, c.freq, c.next, c.since) for c in ctxs])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [XOR, OVERWRITE], ids=["xor", "overwrite"])
@pytest.mark.parametrize("context", [False, True], ids=["free", "context"])
def test_native_and_reference_agree(dtype, op, context, monkeypatch):
    """Five records share one state each (native encoder and decoder, reference encoder and
    decoder), as the BUCKET records of one chunk do."""
    width, eshift, ebits = model.coder_params(dtype)
    W = 8 * width
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{op}/{context}".encode()))
    base = _base(rng, dtype, N)
    n_enc, n_dec = _native_state(width, context), _native_state(width, context)
    r_enc, r_dec = bucket_ref.RefState(width, context), bucket_ref.RefState(width, context)

    coded: list[tuple[object, int]] = []  # (context, symbol) of every reference symbol
    real_sym = bucket_ref._Writer.sym

    def spy(self, ctx, s):
        coded.append((ctx, s))
        real_sym(self, ctx, s)

    monkeypatch.setattr(bucket_ref._Writer, "sym", spy)
    for name, lo, hi, pos, vals in _records(rng, dtype, base, op):
        e_lo = model.choose_e_lo(dtype, base[lo:hi]) if context else 0
        args = (base if context else None, lo, hi, width, eshift, ebits, e_lo, op)
        native = _crans.encode(n_enc, pos, vals, *args)
        coded.clear()
        ref = bucket_ref.encode(r_enc, pos, vals, *args)
        assert ref == native, f"{name}: payloads differ ({len(ref)} vs {len(native)} bytes)"
        if name == "escapes":  # the record reaches the paths it is for
            assert any(ctx in r_enc.q and s == bucket_ref.QA - 1 for ctx, s in coded), "no gap escape"
            assert any(ctx in r_enc.h and s == W for ctx, s in coded), "no h = W"
        # each decoder reads the other's payload
        rpos, rvals = bucket_ref.decode(r_dec, native, pos.size, *args)
        cpos, cvals = np.empty(pos.size, np.int64), np.empty(pos.size, vals.dtype)
        _crans.decode(n_dec, ref, pos.size, *args, cpos, cvals)
        for p, v in ((rpos, rvals), (cpos, cvals)):
            assert p.dtype == np.int64 and v.dtype == vals.dtype, name
            assert np.array_equal(p, pos) and np.array_equal(v, vals), name
    # The reference decoder ends where its encoder did.  (The native state is not compared:
    # its decoder also caches slot lookup tables in it, its encoder does not.)
    assert _ref_state_key(r_enc) == _ref_state_key(r_dec)


# ------------------------------------------------------------------ negative controls

def _bf16_sequence(context: bool):
    rng = np.random.default_rng(7)
    base = _base(rng, "bfloat16", N)
    width, eshift, ebits = model.coder_params("bfloat16")
    out = []
    for name, lo, hi, pos, vals in _records(rng, "bfloat16", base, XOR):
        e_lo = model.choose_e_lo("bfloat16", base[lo:hi]) if context else 0
        out.append((name, pos, vals, (base if context else None, lo, hi, width, eshift, ebits, e_lo, XOR)))
    return out


@pytest.mark.parametrize("const, wrong, context", [
    ("QA", 31, False),           # the gap alphabet, so the escape symbol (30 for 31)
    ("ESC_LEN_BITS", 7, True),   # the escape's length field
    ("SEG", 2048, True),         # the segment length of the consumption order
    ("TOP_BITS", 4, False),      # context-free: bits below the leading one as a symbol
    ("GAP_HALVE", 32, True),     # when the gap statistics halve
])
def test_a_reference_with_one_constant_changed_disagrees(const, wrong, context, monkeypatch):
    """The byte comparison is not vacuous: the same records, through a reference with one
    of the spec's constants changed, give other bytes; and its decoder, reading the native
    payloads, fails or decodes something else."""
    seq = _bf16_sequence(context)
    width = 2
    n_st = _native_state(width, context)
    natives = [_crans.encode(n_st, pos, vals, *args) for _, pos, vals, args in seq]
    r_st = bucket_ref.RefState(width, context)
    assert [bucket_ref.encode(r_st, pos, vals, *args) for _, pos, vals, args in seq] == natives
    assert _decodes(bucket_ref.RefState(width, context), seq, natives)
    monkeypatch.setattr(bucket_ref, const, wrong)
    r_st = bucket_ref.RefState(width, context)
    assert [bucket_ref.encode(r_st, pos, vals, *args) for _, pos, vals, args in seq] != natives
    r_st = bucket_ref.RefState(width, context)
    assert not _decodes(r_st, seq, natives)


def _decodes(state, seq, payloads) -> bool:
    try:
        for (_, pos, vals, args), payload in zip(seq, payloads):
            p, v = bucket_ref.decode(state, payload, pos.size, *args)
            if not (np.array_equal(p, pos) and np.array_equal(v, vals)):
                return False
    except ValueError:
        return False
    return True


def test_rebuild_remainder_goes_to_the_largest_count(monkeypatch):
    """Pins a reading the spec leaves open ("the most frequent symbol (the lowest such s)"):
    the remainder of a rebuild goes to the symbol with the largest *count*.  Here h = 2
    (values 2, 3) is counted once more than h = 1 and both round to one frequency, so the
    reading that takes the largest frequency (then the lowest s: h = 1) gives other bytes."""
    n = 12_000
    vals = np.insert(np.insert(np.tile(np.array([1, 2], np.uint16), n // 2), 5000, 2), 100, 4)[:n]
    pos = np.arange(n, dtype=np.int64)
    width, eshift, ebits = model.coder_params("bfloat16")
    args = (None, 0, n, width, eshift, ebits, 0, XOR)
    native = _crans.encode(_native_state(width, False), pos, vals, *args)
    assert bucket_ref.encode(bucket_ref.RefState(width, False), pos, vals, *args) == native

    def by_largest_freq(self):
        tot = 1 << bucket_ref.PROB_BITS
        total = sum(self.cnt)
        self.freq = [1 + c * (tot - self.A) // total for c in self.cnt]
        best = max(range(self.A), key=lambda s: (self.freq[s], -s))
        self.freq[best] += tot - sum(self.freq)
        self._cum()
        if total >= bucket_ref.COUNT_HALVE:
            self.cnt = [c >> 1 for c in self.cnt]
        self.next = min(2 * self.next, bucket_ref.REBUILD_MAX)
        self.since = 0

    monkeypatch.setattr(bucket_ref.RefContext, "_rebuild", by_largest_freq)
    assert bucket_ref.encode(bucket_ref.RefState(width, False), pos, vals, *args) != native


# ------------------------------------------------------------------ stricter than the spec

def _payload(rans: bytes, raw: bytes) -> bytes:
    return len(rans).to_bytes(4, "little") + rans + raw


def _low_initial_state() -> tuple[bytes, np.ndarray, np.ndarray, tuple]:
    """A native payload rewritten to start state 0 below 2^16 and read one more word: by
    the spec's decoding rules it decodes to the same record."""
    width, eshift, ebits = model.coder_params("bfloat16")
    pos = np.array([3, 40, 41, 90], np.int64)
    vals = np.array([1, 2, 3, 0x8001], np.uint16)
    args = (None, 0, 100, width, eshift, ebits, 0, OVERWRITE)
    pl = _crans.encode(_native_state(width, False), pos, vals, *args)
    rlen, x = int.from_bytes(pl[:4], "little"), int.from_bytes(pl[4:8], "little")
    ctx = bucket_ref.RefContext(bucket_ref.QA)  # symbol 0: gap 4 in a fresh state, k = 2, q = 0
    f, c = ctx.freq[0], ctx.cum[0]
    x1 = f * (x >> 12) + x % 4096 - c
    assert x1 >= 1 << 16  # the native decoder reads no word after symbol 0
    y, word = x1 >> 16, x1 & 0xFFFF
    x0 = ((y // f) << 12) + y % f + c  # decodes symbol 0 to y, which then reads `word`
    assert x0 < 1 << 16 and c <= x0 % 4096 < c + f
    rans = x0.to_bytes(4, "little") + pl[8:12] + word.to_bytes(2, "little") + pl[12:4 + rlen]
    return _payload(rans, pl[4 + rlen:]), pos, vals, args


def _active_without_entries() -> tuple[bytes, np.ndarray, np.ndarray, tuple]:
    """Context mode, nnz = 0, yet an active mask with one bucket and its first gap."""
    base = _base(np.random.default_rng(1), "bfloat16", 500)
    width, eshift, ebits = model.coder_params("bfloat16")
    args = (base, 0, 500, width, eshift, ebits, model.choose_e_lo("bfloat16", base), XOR)
    w = bucket_ref._Writer()
    w.bits(1 << 5, 32)
    bucket_ref._enc_gap(bucket_ref.RefState(width, True), w, 5, 1000)
    return w.payload(), np.empty(0, np.int64), np.empty(0, np.uint16), args


@pytest.mark.parametrize("make", [_low_initial_state, _active_without_entries])
def test_native_decoder_is_stricter_than_the_spec(make):
    """Payloads the spec's decoding rules accept (the reference decodes them to the record)
    and rans.c rejects: an initial state below 2^16; an active mask when nnz = 0.  The
    spec should list these checks (then bucket_ref makes them and this test flips)."""
    payload, pos, vals, args = make()
    st = bucket_ref.RefState(args[3], args[0] is not None)
    p, v = bucket_ref.decode(st, payload, pos.size, *args)
    assert np.array_equal(p, pos) and np.array_equal(v, vals)
    cpos, cvals = np.empty(pos.size, np.int64), np.empty(pos.size, vals.dtype)
    with pytest.raises(ValueError):
        _crans.decode(_native_state(args[3], args[0] is not None), payload, pos.size, *args, cpos, cvals)


# ------------------------------------------------------------------ AVX-512 vs scalar

_SCALAR = r"""
import sys
import numpy as np
from nemo_dcr.codec import _crans
assert _crans.simd() == "scalar", _crans.simd()
d = dict(np.load(sys.argv[1]))
out = {}
for c in range(int(d["ncases"])):
    width, ctx = int(d[f"{c}_width"]), 1
    enc = np.empty(_crans.MODEL_BYTES, np.uint8); _crans.model_init(enc, width, ctx)
    dec = np.empty(_crans.MODEL_BYTES, np.uint8); _crans.model_init(dec, width, ctx)
    for r in range(int(d["nrecs"])):
        k = f"{c}_{r}"
        pos, vals, base = d[k + "_pos"], d[k + "_vals"], d[f"{c}_base"]
        args = (base, *(int(a) for a in d[k + "_args"]))
        out[k + "_payload"] = np.frombuffer(_crans.encode(enc, pos, vals, *args), np.uint8)
        p, v = np.empty(pos.size, np.int64), np.empty(pos.size, vals.dtype)
        _crans.decode(dec, d[k + "_avx"].tobytes(), pos.size, *args, p, v)
        out[k + "_pos"], out[k + "_vals"] = p, v
np.savez(sys.argv[2], **out)
"""


def test_avx512_and_scalar_paths_give_the_same_bytes(tmp_path: Path):
    """Context mode on float inputs spread over every exponent bucket (and clamped on both
    sides), ranges starting mid-block and ending in a partial block, several records per
    state.  The scalar run is a subprocess: NEMO_DCR_NO_AVX512 is read at import.  The
    control that this compares two paths, not one with itself: this process reports
    ``avx512bw`` and the subprocess asserts ``scalar`` (which also turns off BMI2's
    ``pdep`` in the decoder's bit select)."""
    if _crans.simd() != "avx512bw":
        pytest.skip(f"this process uses the {_crans.simd()} path only (no AVX-512BW, or NEMO_DCR_NO_AVX512)")
    rng = np.random.default_rng(17)
    n = 25 * SEG + 517
    recs = [(13, n - 7, 0.01), (SEG + 5, n, 0.3), (70, 70 + 999, 1.0)]
    d: dict[str, np.ndarray] = {"ncases": np.array(3), "nrecs": np.array(len(recs))}
    expect = {}
    for c, dtype in enumerate(["bfloat16", "float16", "float32"]):
        width, eshift, ebits = model.coder_params(dtype)
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 3, n)
        f = x.astype(np.float16).view(np.uint16) if dtype == "float16" else x.astype(np.float32).view(np.uint32)
        base = (f >> 16).astype(np.uint16) if dtype == "bfloat16" else f
        sp = np.array(FLOAT_SPECIALS[dtype], dtype=base.dtype)
        base[rng.integers(0, n, 500)] = sp[rng.integers(0, sp.size, 500)]
        d[f"{c}_width"], d[f"{c}_base"] = np.array(width), base
        st = _native_state(width, True)
        for r, (lo, hi, rate) in enumerate(recs):
            pos = (np.flatnonzero(rng.random(hi - lo) < rate) + lo).astype(np.int64)
            vals = base[pos] ^ _new(rng, dtype, base[pos])
            keep = vals != 0
            pos, vals = pos[keep], vals[keep]
            args = (lo, hi, width, eshift, ebits, model.choose_e_lo(dtype, base[lo:hi]), XOR)
            payload = _crans.encode(st, pos, vals, base, *args)
            k = f"{c}_{r}"
            d[k + "_pos"], d[k + "_vals"], d[k + "_args"] = pos, vals, np.array(args)
            d[k + "_avx"] = np.frombuffer(payload, np.uint8)
            expect[k] = (payload, pos, vals)
    np.savez(tmp_path / "in.npz", **d)
    env = dict(os.environ, NEMO_DCR_NO_AVX512="1")
    root = str(Path(bucket.__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", _SCALAR, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, env=env, cwd=root, timeout=120)
    out = np.load(tmp_path / "out.npz")
    for k, (payload, pos, vals) in expect.items():
        assert out[k + "_payload"].tobytes() == payload, k
        assert np.array_equal(out[k + "_pos"], pos) and np.array_equal(out[k + "_vals"], vals), k
