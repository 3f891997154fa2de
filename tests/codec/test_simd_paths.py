"""The native BUCKET coder's CPU paths (``_crans.set_simd``: scalar, AVX2, AVX-512BW) give
the same payload bytes and the same decoded arrays.

The paths differ only in the context-mode block scan (and the decoder's bit select); the
pure-Python twin (test_bucket_ref.py) cannot tell which one the native coder used, so this
compares them with each other in one process.  Inputs are float bases spread over every
exponent bucket (clamped on both sides, with specials), ranges that start mid-block and end
in a partial block, blocks of one bucket only, and several records per adaptive state.

Negative controls: the paths compared are really different (``set_simd`` names them), and
the comparisons can fail (a payload coded with another ``e_lo``, i.e. other buckets, differs;
decoding against a base with one exponent changed does not give the arrays back)."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import BITS_DTYPE, bucket, model

from codec_helpers import FLOAT_SPECIALS

pytestmark = pytest.mark.skipif(not bucket.available(), reason="native rANS coder (_crans) not built")

if bucket.available():
    from nemo_dcr.codec.bucket import _crans

XOR, OVERWRITE = 0, 1
SEG = 4096
N = 3 * SEG + 1000
#: (lo, hi, changed fraction): mid-block starts, partial last blocks, several segments
RECORDS = [(13, N - 7, 0.01), (SEG + 5, 2 * SEG + 64 * 7 + 33, 0.3), (70, 70 + 999, 1.0), (0, N, 0.002),
           (64, 64 + 64 * 9, 0.05)]
DTYPES = ["bfloat16", "float16", "float32"]  # the dtypes with a SIMD block scan


def _levels() -> dict[str, int]:
    """Path name -> set_simd level, for the paths this CPU has."""
    prev = _crans.simd()
    out: dict[str, int] = {}
    for level in (0, 1, 2):
        out.setdefault(_crans.set_simd(level), level)
    _restore(prev)
    return out


def _restore(name: str) -> None:
    for level in (2, 1, 0):
        if _crans.set_simd(level) == name:
            return
    raise AssertionError(f"cannot restore the {name} path")


@pytest.fixture
def paths():
    prev = _crans.simd()
    levels = _levels()
    if len(levels) < 2:
        pytest.skip("this CPU has the scalar path only")
    yield levels
    _restore(prev)


def _base(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Magnitudes over 12 decades (more exponents than the 32 buckets: both clamps), specials
    sprinkled in, and a run of one value (blocks that hold one bucket only)."""
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 3, n)
    x[SEG + 640:SEG + 640 + 64 * 5] = 0.03125
    if dtype == "float16":
        base = x.astype(np.float16).view(np.uint16).copy()
    else:
        f = x.astype(np.float32).view(np.uint32)
        base = (f >> 16).astype(np.uint16) if dtype == "bfloat16" else f.copy()
    # zeros, subnormals, Inf, NaN; not the largest finite value, which would make e_lo put
    # every weight in bucket 0
    eshift, ebits = model.EXPONENT_FIELD[dtype]
    sp = np.array([x for x in FLOAT_SPECIALS[dtype] if (x >> eshift) & ((1 << ebits) - 1) in (0, (1 << ebits) - 1)],
                  dtype=base.dtype)
    base[rng.integers(0, n, 300)] = sp[rng.integers(0, sp.size, 300)]
    return base


def _records(rng: np.random.Generator, dtype: str, base: np.ndarray, op: int):
    width, eshift, ebits = model.coder_params(dtype)
    bits = BITS_DTYPE[dtype]
    for lo, hi, rate in RECORDS:
        pos = (np.flatnonzero(rng.random(hi - lo) < rate) + lo).astype(np.int64)
        step = rng.integers(1, 4, pos.size).astype(bits)
        new = (base[pos] + step).astype(bits)
        vals = base[pos] ^ new if op == XOR else new
        keep = vals != 0 if op == XOR else np.ones(pos.size, bool)
        pos, vals = pos[keep], np.ascontiguousarray(vals[keep])
        e_lo = model.choose_e_lo(dtype, base[lo:hi])
        yield pos, vals, (lo, hi, width, eshift, ebits, e_lo, op)


def _bucket(x, eshift: int, ebits: int, e_lo: int) -> int:
    return min(max(((int(x) >> eshift) & ((1 << ebits) - 1)) - e_lo, 0), 31)


def _state(width: int) -> np.ndarray:
    st = np.empty(_crans.MODEL_BYTES, dtype=np.uint8)
    _crans.model_init(st, width, 1)
    return st


def _encode_all(dtype: str, base: np.ndarray, recs) -> list[bytes]:
    st = _state(BITS_DTYPE[dtype].itemsize)
    return [_crans.encode(st, pos, vals, base, *args) for pos, vals, args in recs]


def _decode_all(dtype: str, base: np.ndarray, recs, payloads) -> list[tuple[np.ndarray, np.ndarray]]:
    st = _state(BITS_DTYPE[dtype].itemsize)
    out = []
    for (pos, vals, args), payload in zip(recs, payloads):
        p, v = np.empty(pos.size, np.int64), np.empty(pos.size, vals.dtype)
        _crans.decode(st, payload, pos.size, base, *args, p, v)
        out.append((p, v))
    return out


@pytest.mark.parametrize("op", [XOR, OVERWRITE])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_gives_the_same_bytes_and_arrays(paths, dtype, op):
    rng = np.random.default_rng(1900 + DTYPES.index(dtype) * 2 + op)
    base = _base(rng, dtype, N)
    recs = list(_records(rng, dtype, base, op))
    assert sum(p.size for p, _, _ in recs) > 1000
    got = {}
    for name, level in paths.items():
        assert _crans.set_simd(level) == name  # control: the runs below use different paths
        payloads = _encode_all(dtype, base, recs)
        decoded = _decode_all(dtype, base, recs, payloads)
        for (pos, vals, _), (p, v) in zip(recs, decoded):
            assert p.dtype == pos.dtype and v.dtype == vals.dtype
            assert np.array_equal(p, pos) and np.array_equal(v, vals), name
        got[name] = payloads
    ref = got.pop("scalar")
    for name, payloads in got.items():
        assert payloads == ref, f"{name} path coded other bytes than the scalar path"
        # and each path decodes the other's bytes (the decoder's scan and bit select)
        _crans.set_simd(paths[name])
        for (pos, vals, _), (p, v) in zip(recs, _decode_all(dtype, base, recs, ref)):
            assert np.array_equal(p, pos) and np.array_equal(v, vals), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_controls_the_comparisons_can_fail(paths, dtype):
    """Other buckets (e_lo + 1) give other bytes on every path; a base with one exponent
    changed near a change decodes to other arrays or is refused."""
    rng = np.random.default_rng(1950 + DTYPES.index(dtype))
    base = _base(rng, dtype, N)
    recs = list(_records(rng, dtype, base, XOR))
    moved = [(pos, vals, (*args[:5], args[5] + 1, args[6])) for pos, vals, args in recs]
    width, eshift, ebits = model.coder_params(dtype)
    pos0, e_lo = recs[0][0], recs[0][2][5]
    bad = base.copy()
    flip = np.asarray(1 << (eshift + ebits - 2), dtype=base.dtype)
    # an element next to a change whose bucket the flip moves: shifts that bucket's ranks
    i = next(int(j) + 1 for j in pos0[pos0.size // 2:]
             if _bucket(base[j + 1], eshift, ebits, e_lo) != _bucket(base[j + 1] ^ flip, eshift, ebits, e_lo))
    bad[i] ^= flip
    for name, level in paths.items():
        assert _crans.set_simd(level) == name
        payloads = _encode_all(dtype, base, recs)
        assert _encode_all(dtype, base, moved) != payloads, name
        try:
            decoded = _decode_all(dtype, bad, recs, payloads)
        except ValueError:
            continue
        assert not all(np.array_equal(p, pos) and np.array_equal(v, vals)
                       for (pos, vals, _), (p, v) in zip(recs, decoded)), name


def test_simd_names_a_path():
    assert bucket.simd() in ("avx512bw", "avx2", "scalar")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_choose_e_lo_is_the_same_on_every_path(paths, dtype):
    """``choose_e_lo`` (2-byte floats have an AVX2 loop of 16 elements a step) against numpy,
    on every path; ranges shorter than a step and with the largest exponent in the tail.
    Control: one larger exponent in the range moves the answer."""
    width, eshift, ebits = model.coder_params(dtype)
    emax = (1 << ebits) - 1
    rng = np.random.default_rng(1990 + width + ebits)
    n = 5000
    for trial in range(40):
        e = rng.integers(0, emax + 1, n) if trial % 2 else rng.integers(emax // 3, emax // 2, n)
        base = ((rng.integers(0, 2, n) << (eshift + ebits)) | (e << eshift)
                | rng.integers(0, 1 << eshift, n)).astype(np.uint16)
        lo = int(rng.integers(0, 40))
        hi = lo + int(rng.integers(0, 3)) if trial < 6 else int(rng.integers(lo, n + 1))
        if trial % 4 == 2 and hi > lo:  # the largest finite exponent is the range's last element
            base[hi - 1] = (base[hi - 1] & ~np.uint16(emax << eshift)) | np.uint16((emax - 1) << eshift)
        ex = (base[lo:hi].astype(np.int64) >> eshift) & emax
        ex[ex == emax] = 0
        want = max(int(ex.max(initial=0)) - 31, 0)
        got = {name: (_crans.set_simd(level), _crans.choose_e_lo(base, lo, hi, width, eshift, ebits))[1]
               for name, level in paths.items()}
        assert set(got.values()) == {want}, (trial, lo, hi, got, want)
        if hi > lo and want < emax - 1 - 31:  # control
            bumped = base.copy()
            bumped[hi - 1] = (bumped[hi - 1] & ~np.uint16(emax << eshift)) | np.uint16((want + 32) << eshift)
            for name, level in paths.items():
                _crans.set_simd(level)
                assert _crans.choose_e_lo(bumped, lo, hi, width, eshift, ebits) == want + 1, name
