"""The BUCKET coding (4): the default record coding, its compatibility with chunks made
before it, its admission bound and its behaviour on hostile payloads.  The byte-for-byte
comparison with the pure-Python twin is tests/codec/test_bucket_ref.py."""
from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

from nemo_dcr.codec import (
    BITS_DTYPE,
    ChunkFormatError,
    Coding,
    DeltaOp,
    TensorDelta,
    bucket,
    decode_chunk,
    encode_chunk,
    read_chunk_index,
)
from nemo_dcr.codec.model import ModelStates
from nemo_dcr.codec.payload import RecordSpec, check_payload_size

from codec_helpers import random_bits, xor_delta

pytestmark = pytest.mark.skipif(not bucket.available(), reason="native rANS coder (_crans) not built")

DATA = pathlib.Path(__file__).parent / "data"


def adam_like(rng: np.random.Generator, n: int, scale: float = 4e-6) -> tuple[np.ndarray, np.ndarray]:
    """bf16 (base, target) bits where, as after an AdamW step, an element changes when a
    roughly constant step exceeds half its ulp: small weights change, large ones rarely."""
    import torch

    w = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02)
    step = torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))
    b = w.to(torch.bfloat16)
    t = (b.float() + step).to(torch.bfloat16)
    return b.view(torch.int16).numpy().view(np.uint16).copy(), t.view(torch.int16).numpy().view(np.uint16).copy()


@pytest.mark.parametrize("n", [300_000, 60_000])
def test_default_is_bucket_or_lanes_and_bit_exact_with_negative_control(rng, n):
    """The default codes a context-mode record LANES from LANES_MIN_NNZ changes on, BUCKET
    below and BUCKET context-free."""
    from nemo_dcr.codec.payload import LANES_MIN_NNZ

    base, target = adam_like(rng, n)
    d = xor_delta("w", "bfloat16", (n,), base, target)
    assert 0.005 < d.nnz / n < 0.2
    want = Coding.LANES if d.nnz >= LANES_MIN_NNZ else Coding.BUCKET
    assert want is (Coding.LANES if n == 300_000 else Coding.BUCKET)  # both sides are tested
    for context in (False, True):
        chunk = encode_chunk([d], base={"w": base} if context else None)
        (info,) = read_chunk_index(chunk).records
        assert info.coding is (want if context else Coding.BUCKET) and info.context is context
        out = decode_chunk(chunk, base={"w": base} if context else None).deltas[0]
        applied = base.copy()
        applied[out.positions] ^= out.values
        assert np.array_equal(applied.view(np.int16), target.view(np.int16))
        # negative control: the same comparison catches one flipped bit
        applied[out.positions[0]] ^= np.uint16(1)
        assert not np.array_equal(applied.view(np.int16), target.view(np.int16))


def test_context_mode_uses_the_exponent(rng):
    """On deltas whose changes depend on the exponent, context mode codes the flags at their
    conditional entropy, well under context-free (which cannot see the base)."""
    n = 400_000
    base, target = adam_like(rng, n)
    d = xor_delta("w", "bfloat16", (n,), base, target)
    free = len(encode_chunk([d], codings=[Coding.BUCKET]))
    ctx = len(encode_chunk([d], base={"w": base}, codings=[Coding.BUCKET]))
    assert ctx < 0.8 * free, (ctx, free)


def test_wrong_base_is_refused(rng):
    n = 50_000
    base, target = adam_like(rng, n)
    d = xor_delta("w", "bfloat16", (n,), base, target)
    chunk = encode_chunk([d], base={"w": base})
    other = base.copy()
    other[d.positions[:50]] ^= np.uint16(0x0080)  # exponent bits of some changed elements
    with pytest.raises(ChunkFormatError):
        decode_chunk(chunk, base={"w": other})


@pytest.mark.parametrize("dtype", sorted(BITS_DTYPE))
@pytest.mark.parametrize("context", [False, True])
def test_every_dtype_op_and_range(rng, dtype, context):
    n = 9000  # three segments of 4096, the last partial
    base = random_bits(rng, dtype, n)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.05)
    target[idx] ^= np.maximum(random_bits(rng, dtype, idx.size), 1).astype(base.dtype)
    lo, hi = 1000, 8999
    deltas = [xor_delta("x", dtype, (n,), base, target, (lo, hi)),
              TensorDelta(name="o", dtype=dtype, shape=(n,), op=DeltaOp.OVERWRITE,
                          positions=idx.astype(np.int64), values=target[idx].copy())]
    bases = {"x": base, "o": base} if context else None
    chunk = encode_chunk(deltas, base=bases, codings=[Coding.BUCKET])
    assert {r.coding for r in read_chunk_index(chunk).records} <= {Coding.BUCKET, Coding.DENSE_RAW, Coding.SPARSE_RAW}
    got = decode_chunk(chunk, base=bases).deltas
    for want, out in zip(deltas, got):
        keep = want.values != 0 if want.op is DeltaOp.XOR else slice(None)
        assert np.array_equal(out.positions, want.positions[keep])
        assert np.array_equal(out.values.view(np.uint8), want.values[keep].view(np.uint8))


def test_chunk_made_before_coding_4_still_decodes():
    """A MODEL chunk written by nemo_dcr before BUCKET existed (tests/codec/data/model_v1.npz,
    made with the then-default encoder) decodes to the deltas it was made from."""
    z = np.load(DATA / "model_v1.npz")
    chunk = z["chunk"].tobytes()
    assert {r.coding for r in read_chunk_index(chunk).records} == {Coding.MODEL}
    out = decode_chunk(chunk, base={"a": z["base_a"]})
    assert out.meta["made_by"] == "nemo_dcr before coding 4"
    a, b = out.deltas
    assert np.array_equal(a.positions, z["pos_a"]) and np.array_equal(a.values, z["val_a"])
    assert np.array_equal(b.positions, z["pos_b"]) and np.array_equal(b.values, z["val_b"])


def test_records_share_the_chunk_state_and_trials_leave_no_trace(rng):
    """Two chunks with the same second record: one whose first record was coded BUCKET, one
    where it lost to DENSE_RAW.  The second record's bytes depend on the first only when the
    first was kept (the state carries), and both chunks decode."""
    n = 20000
    base, target = adam_like(rng, n)
    d2 = xor_delta("b", "bfloat16", (n,), base, target)
    sparse = xor_delta("a", "bfloat16", (n,), base, target)
    dense_t = base ^ np.maximum(random_bits(rng, "bfloat16", n), 1)  # all change, at random: DENSE_RAW wins
    dense = xor_delta("a", "bfloat16", (n,), base, dense_t)
    alone = encode_chunk([d2], codings=[Coding.BUCKET])
    after_dense = encode_chunk([dense, d2], codings=[Coding.BUCKET])
    after_sparse = encode_chunk([sparse, d2], codings=[Coding.BUCKET])
    infos = read_chunk_index(after_dense).records
    assert infos[0].coding is Coding.DENSE_RAW and infos[1].coding is Coding.BUCKET
    assert infos[1].payload_bytes == read_chunk_index(alone).records[0].payload_bytes
    assert read_chunk_index(after_sparse).records[1].payload_bytes < infos[1].payload_bytes
    for chunk in (after_dense, after_sparse):
        decode_chunk(chunk)


def test_expansion_bound_is_sound_and_enforced():
    """The cheapest BUCKET payload there is (all-zero overwrites of every element) stays
    within ``max_entries``; a record declaring one more than the bound is refused."""
    n = 1 << 21
    d = TensorDelta(name="w", dtype="bfloat16", shape=(n,), op=DeltaOp.OVERWRITE,
                    positions=np.arange(n, dtype=np.int64), values=np.zeros(n, np.uint16))
    info = read_chunk_index(encode_chunk([d], codings=[Coding.BUCKET])).records[0]
    assert info.coding is Coding.BUCKET
    assert n <= bucket.max_entries(info.payload_bytes) < 4 * n
    cap = bucket.max_entries(12)
    spec = dict(dtype="bfloat16", shape=(1 << 40,), op=DeltaOp.OVERWRITE, lo=0, hi=1 << 40)
    check_payload_size(RecordSpec(**spec, nnz=cap), Coding.BUCKET, 12)
    with pytest.raises(ChunkFormatError, match=f"BUCKET payload_len of 12 can code \\(at most {cap}\\)"):
        check_payload_size(RecordSpec(**spec, nnz=cap + 1), Coding.BUCKET, 12)


@pytest.mark.parametrize("context", [False, True])
def test_hostile_payloads_fail_cleanly(rng, context):
    """Flipped, truncated, extended and random payloads fed straight to the decoder (no
    chunk CRC in the way) raise ChunkFormatError or decode to something, never crash, hang
    or read out of bounds.  Truncated, extended and random payloads are always refused (the
    final-state, consumption and padding checks); a flipped raw bit (a sign or low bit) can
    decode to other values, which the chunk's content CRC catches one layer up."""
    n = 20000
    base, target = adam_like(rng, n)
    d = xor_delta("w", "bfloat16", (n,), base, target)
    spec = RecordSpec(dtype="bfloat16", shape=(n,), op=DeltaOp.XOR, lo=0, hi=n, nnz=d.nnz)
    b = base if context else None
    payload, e_lo, _ = bucket.encode(spec, d.positions, d.values, b, ModelStates())
    spec = RecordSpec(**{**spec.__dict__, "param": e_lo})
    pos, val = bucket.decode(spec, memoryview(payload), b, ModelStates())
    assert np.array_equal(pos, d.positions) and np.array_equal(val, d.values)
    refused = 0
    for trial in range(300):
        bad = bytearray(payload)
        kind = trial % 4
        if kind == 0:
            i = int(rng.integers(0, len(bad)))
            bad[i] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            bad = bad[: int(rng.integers(0, len(bad)))]
        elif kind == 2:
            bad += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        else:
            bad = bytearray(rng.integers(0, 256, len(bad), dtype=np.uint8).tobytes())
        try:
            p2, v2 = bucket.decode(spec, memoryview(bytes(bad)), b, ModelStates())
        except ChunkFormatError:
            refused += 1
        else:
            assert kind == 0, f"a {['', 'truncated', 'extended', 'random'][kind]} payload decoded"
            assert p2.size == d.nnz and (p2.size == 0 or (p2[0] >= 0 and p2[-1] < n))
            assert not (np.array_equal(p2, pos) and np.array_equal(v2, val))
    assert refused >= 225


def test_decoding_in_threads_matches(rng):
    """The coder releases the GIL and keeps no global state: chunks decoded concurrently on
    threads give the same arrays as one by one."""
    n = 100_000
    chunks, bases = [], []
    for _ in range(4):
        base, target = adam_like(rng, n)
        bases.append(base)
        chunks.append(encode_chunk([xor_delta("w", "bfloat16", (n,), base, target)], base={"w": base}))
    serial = [decode_chunk(c, base={"w": b}).deltas[0] for c, b in zip(chunks, bases)]
    got: list = [None] * 4

    def work(i: int) -> None:
        got[i] = decode_chunk(chunks[i], base={"w": bases[i]}).deltas[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(serial, got):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)


def test_native_e_lo_matches_the_numpy_definition(rng):
    """The encoder's one-pass e_lo (``_crans.choose_e_lo``) equals ``model.choose_e_lo`` on
    every float width, sub-ranges, constant ranges and Inf/NaN exponents."""
    from nemo_dcr.codec.model import choose_e_lo, coder_params

    for dtype in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int32"):
        for trial in range(40):
            n = int(rng.integers(0, 3000))
            b = random_bits(rng, dtype, n)
            if trial % 3 == 0 and n:
                b[:] = b[0]
            lo = int(rng.integers(0, n + 1))
            hi = int(rng.integers(lo, n + 1))
            w, es, eb = coder_params(dtype)
            assert bucket._crans.choose_e_lo(b, lo, hi, w, es, eb) == choose_e_lo(dtype, b[lo:hi]), (dtype, trial)
