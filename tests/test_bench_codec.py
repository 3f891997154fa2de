"""The published formats modelled in scripts/bench_codec.py decode to their input, and the
check that guards the timed runs catches a decoder that does not."""
import importlib.util
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("bench_codec", os.path.join(ROOT, "scripts", "bench_codec.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_codec"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# Gaps around the escape threshold, and escaped gaps whose u32 halves are 0xFFFF (which a
# parser that takes every 0xFFFF word for a marker gets wrong).
HARD_GAPS = [1, 2, 0xFFFE, 0xFFFF, 0x10000, 0x1FFFF, 0x2FFFF, 0xFFFF0000, 0xFFFFFFFE, 0xFFFFFFFF]


@pytest.mark.parametrize("seed", range(20))
def test_gap16_round_trip_with_escapes(bc, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 200))
    gaps = rng.choice(HARD_GAPS + rng.integers(1, 70000, 8).tolist(), size=n).astype(np.int64)
    if n and seed % 3 == 0:
        gaps[0] = 0  # position 0 changed
    pos, xor = np.cumsum(gaps), rng.integers(1, 1 << 16, n).astype(np.uint16)
    words = np.frombuffer(bc.gap16_layout(pos, xor).tobytes(), "<u2")
    got_pos, got_val = bc.gap16_parse(words)
    assert got_pos.dtype == np.int64 and got_val.dtype == np.uint16
    assert np.array_equal(got_pos, pos) and np.array_equal(got_val, xor)


def test_gap16_escape_words_are_counted(bc):
    pos = np.cumsum(np.array([0x1FFFF, 0xFFFF0000, 5], dtype=np.int64))
    words = bc.gap16_layout(pos, np.ones(3, np.uint16))
    assert words.size == 2 + 3 + 2 * 2 + 3  # count, 3 gaps of which 2 escaped, 3 values
    perturbed = words.copy()
    perturbed[2] = 1  # the first marker becomes a small gap: the parse must not give the input back
    try:
        p, _ = bc.gap16_parse(perturbed)
        assert not np.array_equal(p, pos)
    except ValueError:
        pass


def _inputs(bc, rng, numel: int, rate: float):
    pos = np.flatnonzero(rng.random(numel) < rate).astype(np.int64)
    xor = rng.integers(1, 1 << 16, pos.size).astype(np.uint16)
    new = rng.integers(0, 1 << 16, pos.size).astype(np.uint16)
    return bc.TensorInput(numel=numel, positions=pos, xor=xor, new=new)


@pytest.mark.parametrize("name", ["gap16+xor+zstd1", "gap32+xor+zstd1", "idx32+bf16 raw", "idx32+bf16+zstd",
                                  "dense xor+zstd"])
def test_published_formats_round_trip_and_the_check_fails_on_a_mismatch(bc, name):
    rng = np.random.default_rng(1)
    inputs = [_inputs(bc, rng, 300_000, 0.0005), _inputs(bc, rng, 4096, 0.2), _inputs(bc, rng, 10, 0.0)]
    fmt = bc.make_published()[name]
    decoded = [fmt.decode(fmt.encode(t), t.numel) for t in inputs]
    bc.check_published(fmt, inputs, decoded, name)  # raises on a mismatch
    # negative control: one value bit flipped in one decoded array
    bad = [tuple(a.copy() for a in d) for d in decoded]
    vals = bad[1][-1]
    vals[np.flatnonzero(vals)[0]] ^= 1
    with pytest.raises(RuntimeError, match="differ"):
        bc.check_published(fmt, inputs, bad, name)
    if not fmt.dense:  # positions as int32 instead of int64: the dtype check catches it
        cast = [(d[0].astype(np.int32), d[1]) for d in decoded]
        with pytest.raises(RuntimeError, match="differ"):
            bc.check_published(fmt, inputs, cast, name)


def test_simd_selects_the_coders_cpu_path(bc, tmp_path):
    """--simd sets the native coders' path before anything is measured (here: no data, exit 2),
    and refuses a name it does not know."""
    from nemo_dcr.codec import bucket

    if not bucket.available():
        pytest.skip("native rANS coder (_crans) not built")
    crans = bucket._crans
    prev = crans.simd()
    try:
        assert bc.main(["--simd", "scalar", "--data", str(tmp_path)]) == 2
        assert crans.simd() == "scalar"
        assert bc.main(["--simd", "avx2", "--data", str(tmp_path)]) == 2
        assert crans.simd() in ("avx2", "scalar")  # scalar where the CPU has no AVX2
    finally:
        crans.set_simd({"scalar": 0, "avx2": 1}.get(prev, 2))
    with pytest.raises(SystemExit):
        bc.main(["--simd", "sse9"])
