"""C path of xor_diff against the numpy reference (and the reference against its definition)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.kernels import (
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    bits_view_np,
    xor_block_counts,
    xor_diff,
    xor_diff_into,
    xor_diff_reference,
)
from nemo_dcr.kernels import _cxor
from nemo_dcr.kernels.cpu import block_counts_c, xor_diff_c

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


@pytest.fixture
def tiny_scratch():
    """Shrink the per-thread scratch of the one-pass diff so that small inputs spill."""
    old = _cxor.set_scratch_keep(4096)  # 409 bf16 changes per thread
    yield
    _cxor.set_scratch_keep(old)


@pytest.fixture(params=["avx2", "portable"])
def simd(request):
    """Run a test on both C loops (the AVX2 one only where the CPU has it)."""
    got = _cxor.set_simd(request.param == "avx2")
    if got != request.param:
        _cxor.set_simd(True)
        pytest.skip(f"{request.param} loop not available on this CPU")
    yield got
    _cxor.set_simd(True)


def make_pair(dtype: torch.dtype, n: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bit patterns (NaN/Inf payloads included) and a copy with ~rate of elements changed."""
    if n == 0:
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
    rng = np.random.default_rng(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    cur = torch.from_numpy(raw.copy()).view(dtype)
    base_bytes = raw.reshape(n, width).copy()
    changed = rng.random(n) < rate
    # flip one random bit of each chosen element (bit 0 for bool, which must stay 0/1)
    bit = rng.integers(0, 1 if dtype == torch.bool else 8 * width, n)
    idx = np.flatnonzero(changed)
    base_bytes[idx, bit[idx] // 8] ^= (1 << (bit[idx] % 8)).astype(np.uint8)
    base = torch.from_numpy(base_bytes.reshape(-1)).view(dtype)
    return cur, base


def assert_same(got: XorDiff, want: XorDiff) -> None:
    assert got.xor_values.dtype == want.xor_values.dtype
    assert got.bit_equal(want), (got.num_changed, want.num_changed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rate", [0.0, 0.004, 0.03, 0.3, 1.0])
def test_c_path_matches_reference(simd, dtype, rate):
    rng = np.random.default_rng(hash((str(dtype), rate)) % 2**32)
    for trial in range(6):
        n = 0 if trial == 0 else int(rng.integers(1, 5000))  # rarely a multiple of block or word size
        block_size = int(rng.choice([1, 7, 64, 333, 1024, 1 << 16]))
        cur, base = make_pair(dtype, n, rate, seed=trial)
        want = xor_diff_reference(cur, base, block_size=block_size)
        for threads in (1, 2, 3):
            assert_same(xor_diff_c(cur, base, block_size=block_size, num_threads=threads), want)
        assert np.array_equal(block_counts_c(cur, base, block_size=block_size, num_threads=2), want.block_counts)


def test_all_changed_and_none_changed(simd):
    n = 70_001
    cur, _ = make_pair(torch.bfloat16, n, 0.0, seed=1)
    flipped = torch.from_numpy(bits_view_np(cur) ^ np.uint16(0x8000)).view(torch.bfloat16)
    full = xor_diff(cur, flipped, block_size=4096)
    assert full.num_changed == n
    assert np.array_equal(full.positions, np.arange(n))
    assert np.all(full.xor_values == 0x8000)
    assert np.array_equal(full.block_counts[:-1], np.full(17, 4096)) and full.block_counts[-1] == n - 17 * 4096
    none = xor_diff(cur, cur.clone(), block_size=4096)
    assert none.num_changed == 0 and none.block_counts.shape == (18,) and not none.block_counts.any()


def test_float_equal_values_with_different_bits_are_changes(simd):
    """NaN payloads and signed zeros differ in bits although a float compare says otherwise."""
    cur_bits = np.array([0x7FC1, 0x0000, 0x3F80, 0xFFC0, 0x7F80, 0x0001] * 1000, dtype=np.uint16)
    base_bits = cur_bits.copy()
    changed = np.array([0, 1, 3, 4, 5]) + 6 * np.array([0, 17, 500, 999])[:, None]
    changed = np.sort(changed.ravel())
    replacement = {0x7FC1: 0x7FC2, 0x0000: 0x8000, 0xFFC0: 0x7FC0, 0x7F80: 0xFF80, 0x0001: 0x0002}
    for i in changed:
        base_bits[i] = replacement[int(cur_bits[i])]
    cur = torch.from_numpy(cur_bits).view(torch.bfloat16)
    base = torch.from_numpy(base_bits).view(torch.bfloat16)
    got = xor_diff(cur, base, block_size=100)
    assert np.array_equal(got.positions, changed)
    assert np.array_equal(got.xor_values, cur_bits[changed] ^ base_bits[changed])
    assert_same(got, xor_diff_reference(cur, base, block_size=100))


def test_reference_matches_definition():
    """The reference against an element-by-element reading of the contract."""
    cur, base = make_pair(torch.float16, 257, 0.2, seed=3)
    a, b = bits_view_np(cur).tolist(), bits_view_np(base).tolist()
    positions = [i for i in range(257) if a[i] != b[i]]
    ref = xor_diff_reference(cur, base, block_size=50)
    assert ref.positions.tolist() == positions
    assert ref.xor_values.tolist() == [a[i] ^ b[i] for i in positions]
    assert ref.block_counts.tolist() == [sum(1 for p in positions if p // 50 == k) for k in range(6)]


def test_large_threaded_bf16_matches_reference(simd):
    cur, base = make_pair(torch.bfloat16, (1 << 21) + 3, 0.03, seed=7)
    want = xor_diff_reference(cur, base)
    for threads in (1, 2):
        assert_same(xor_diff_c(cur, base, num_threads=threads), want)


def test_shapes_and_noncontiguous_inputs():
    cur, base = make_pair(torch.bfloat16, 64 * 48, 0.05, seed=11)
    cur2, base2 = cur.view(64, 48).t(), base.view(64, 48).t()  # non-contiguous views
    want = xor_diff_reference(cur2.contiguous(), base2.contiguous(), block_size=128)
    assert_same(xor_diff(cur2, base2, block_size=128), want)


def test_negative_controls():
    """The comparison used above really detects a dropped position or a flipped bit."""
    cur, base = make_pair(torch.bfloat16, 10_000, 0.05, seed=5)
    want = xor_diff_reference(cur, base, block_size=1000)
    got = xor_diff(cur, base, block_size=1000)
    assert got.bit_equal(want)
    k = got.num_changed // 2
    blk = int(got.positions[k]) // 1000
    counts = got.block_counts.copy()
    counts[blk] -= 1
    dropped = XorDiff(np.delete(got.positions, k), np.delete(got.xor_values, k), counts, 1000, got.numel)
    assert not dropped.bit_equal(want)
    flipped_values = got.xor_values.copy()
    flipped_values[k] ^= 1
    assert not XorDiff(got.positions, flipped_values, got.block_counts, 1000, got.numel).bit_equal(want)
    with pytest.raises(ValueError, match="sum"):
        XorDiff(np.delete(got.positions, k), np.delete(got.xor_values, k), got.block_counts, 1000, got.numel)


def test_diff_into_reuses_buffers_and_never_writes_past_the_diff(simd):
    cur, base = make_pair(torch.bfloat16, 300_001, 0.03, seed=2)
    want = xor_diff_reference(cur, base, block_size=4096)
    out = DiffBuffers.allocate(want.num_changed + 1000, 2)
    out.positions[:] = -7
    out.xor_values[:] = 0xABCD
    got = xor_diff_into(cur, base, out, block_size=4096)
    assert_same(got, want)
    assert np.shares_memory(got.positions, out.positions)
    assert np.all(out.positions[want.num_changed :] == -7)
    assert np.all(out.xor_values[want.num_changed :] == 0xABCD)
    # counts first (block skipping), then the fill only
    counts = xor_block_counts(cur, base, block_size=4096)
    assert np.array_equal(counts, want.block_counts)
    assert_same(xor_diff_into(cur, base, out, block_size=4096, block_counts=counts), want)


def test_diff_into_capacity_error_carries_counts():
    cur, base = make_pair(torch.float32, 50_000, 0.1, seed=4)
    want = xor_diff_reference(cur, base, block_size=1000)
    small = DiffBuffers.allocate(want.num_changed - 1, 4)
    with pytest.raises(DiffCapacityError) as err:
        xor_diff_into(cur, base, small, block_size=1000)
    assert err.value.needed == want.num_changed
    assert np.array_equal(err.value.block_counts, want.block_counts)
    big = DiffBuffers.allocate(err.value.needed, 4)
    assert_same(xor_diff_into(cur, base, big, block_size=1000, block_counts=err.value.block_counts), want)
    with pytest.raises(ValueError, match="carry"):
        xor_diff_into(cur, base, DiffBuffers.allocate(10**5, 2), block_size=1000)


@pytest.mark.parametrize("extra", [+1, -1])
def test_stale_counts_are_refused_without_overrun(simd, extra):
    cur, base = make_pair(torch.bfloat16, 100_000, 0.02, seed=9)
    counts = xor_block_counts(cur, base, block_size=1024)
    # change the tensor after counting: one more (or one fewer) change in a non-empty block
    blk = int(np.flatnonzero(counts)[3])
    bits = bits_view_np(cur)
    block = slice(blk * 1024, (blk + 1) * 1024)
    same = np.flatnonzero(bits[block] == bits_view_np(base)[block])
    diff = np.flatnonzero(bits[block] != bits_view_np(base)[block])
    i = blk * 1024 + int((same if extra > 0 else diff)[0])
    bits[i] = bits_view_np(base)[i] ^ (1 if extra > 0 else 0)
    out = DiffBuffers.allocate(int(counts.sum()) + 64, 2)
    out.positions[:] = -7
    with pytest.raises(StaleCountsError):
        xor_diff_into(cur, base, out, block_size=1024, block_counts=counts)
    assert np.all(out.positions[int(counts.sum()) :] == -7)


def test_argument_errors():
    a = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        xor_diff(a, torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError):
        xor_diff(a, torch.zeros(11, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        xor_diff(a, a, block_size=0)
    with pytest.raises(ValueError):
        xor_block_counts(a, a, block_size=2**63)  # more than the C int64 contract allows
    with pytest.raises(ValueError, match="blocks"):  # 10 elements are 3 blocks of 4
        xor_diff_into(a, a, DiffBuffers.allocate(4, 2), block_counts=np.zeros(2, dtype=np.int64), block_size=4)
    with pytest.raises(ValueError, match="outside"):  # the last block has 2 elements
        xor_diff_into(a, a, DiffBuffers.allocate(16, 2), block_counts=np.array([0, 0, 3]), block_size=4)


@pytest.mark.gpu
def test_cuda_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        cur, base = make_pair(dtype, (1 << 20) + 17, 0.03, seed=1)
        want = xor_diff_reference(cur, base)
        assert_same(xor_diff(cur.cuda(), base.cuda()), want)
        assert_same(xor_diff(cur.cuda(), base.pin_memory()), want)  # pinned host baseline
        assert np.array_equal(xor_block_counts(cur.cuda(), base.cuda()), want.block_counts)
        out = DiffBuffers.allocate(want.num_changed, cur.element_size(), pin_memory=True)
        assert_same(xor_diff_into(cur.cuda(), base.cuda(), out), want)


def test_kept_scratch_serves_every_width_and_concurrent_callers():
    """The one-pass diff keeps per-thread scratch between calls: a later call with wider
    elements or more changes must still be exact, and so must calls from two Python threads
    at once (one of them then works on fresh scratch)."""
    from concurrent.futures import ThreadPoolExecutor

    pairs = [make_pair(dt, 40_000 + 13 * k, rate, seed=k) for k, (dt, rate) in enumerate(
        [(torch.uint8, 0.01), (torch.float64, 1.0), (torch.bfloat16, 0.03), (torch.float64, 0.5), (torch.uint8, 1.0)]
    )]
    wants = [xor_diff_reference(c, b, block_size=999) for c, b in pairs]
    for (c, b), want in zip(pairs, wants):
        assert_same(xor_diff_c(c, b, block_size=999, num_threads=2), want)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            got = list(pool.map(lambda cb: xor_diff_c(cb[0], cb[1], block_size=999, num_threads=2), pairs))
            for g, want in zip(got, wants):
                assert_same(g, want)


@pytest.mark.parametrize("rate", [0.002, 0.05, 1.0])
def test_spill_past_the_scratch_limit_is_exact(simd, tiny_scratch, rate):
    """A thread whose scratch fills up counts the rest of its blocks and fills them in place
    after the allocation: at 0.2% nothing spills, at 5% the spill starts mid-range, at 100%
    in the first block."""
    cur, base = make_pair(torch.bfloat16, 200_003, rate, seed=21)
    want = xor_diff_reference(cur, base, block_size=1000)
    for threads in (1, 2, 3):
        assert_same(xor_diff_c(cur, base, block_size=1000, num_threads=threads), want)
        out = DiffBuffers.allocate(want.num_changed, 2)
        assert_same(xor_diff_into(cur, base, out, block_size=1000), want)
