"""Both Triton implementations on a real CUDA device (``pytest -m gpu``; scripts/gpu_check.sh).

The interpreter tests (test_xor_diff_triton*.py) run programs one after another, so they
cannot show a race, a spin that never ends or a memory-ordering mistake in the single pass's
look-back; these can.  Sizes go up to 2**26 elements (16 K tiles of 4096, far more than
are resident at once, so tiles really wait on each other), every result is compared bit for
bit with the CPU C path (whole tensors) and the two implementations with each other, and
the single pass is repeated to catch nondeterminism.  The caller bounds the run time
(gpu_check.sh runs pytest under ``timeout``): a look-back that deadlocks shows as a timeout.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nemo_dcr.kernels import DiffBuffers, xor_diff_reference

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@functools.lru_cache(maxsize=2)  # the 2**26-element pairs are reused across tiles (read-only)
def make_pair(dtype: torch.dtype, n: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bits and a copy with a fraction ``rate`` of elements changed in one byte (CPU)."""
    if n == 0:
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
    rng = np.random.default_rng(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    base = raw.reshape(n, width).copy()
    idx = np.flatnonzero(rng.random(n) < rate) if rate < 1 else np.arange(n)
    base[idx, rng.integers(0, width, idx.size)] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype), torch.from_numpy(base.reshape(-1)).view(dtype)


def same(x, y) -> bool:
    return all(
        p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)
        for p, q in ((x.positions, y.positions), (x.xor_values, y.xor_values), (x.block_counts, y.block_counts))
    )


# widths 2, 2, 4, 1, 8 (the kernels see integer views: bf16 and fp16 share compiled kernels)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64]
SIZES = [0, 1, 4095, 4097, (1 << 20) + 17]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("rate", [0.0, 0.03, 1.0])
def test_both_impls_match_the_c_path(dtype, numel, rate):
    from nemo_dcr.kernels.cpu import xor_diff_c
    from nemo_dcr.kernels.triton_xor import xor_diff_device

    cur, base = make_pair(dtype, numel, rate, seed=numel + int(rate * 100))
    block_size = 1 << 16 if numel != 4097 else 1000  # 1000: the bincount route
    want = xor_diff_c(cur, base, block_size=block_size)
    if numel <= 4097:
        assert want.bit_equal(xor_diff_reference(cur, base, block_size=block_size))
    g_cur, g_base = cur.cuda(), base.cuda()
    two = xor_diff_device(g_cur, g_base, block_size=block_size, impl="two_pass")
    one = xor_diff_device(g_cur, g_base, block_size=block_size, impl="single_pass")
    assert two.to_host().bit_equal(want)
    assert one.to_host().bit_equal(want)
    assert same(one, two)
    if want.num_changed:  # negative control: one flipped input bit changes the result
        bits = g_cur.clone().view(torch.uint8)
        bits[int(want.positions[0]) * cur.element_size()] ^= 1
        flipped = xor_diff_device(bits.view(dtype), g_base, block_size=block_size, impl="single_pass")
        assert not flipped.to_host().bit_equal(want)


@needs_cuda
@pytest.mark.parametrize("tile", [128, 1024, 4096])
@pytest.mark.parametrize("rate", [0.001, 0.05, 0.5])
def test_single_pass_is_exact_and_deterministic_on_many_tiles(rate, tile):
    """2**26 BF16 elements (16 K to 512 K tiles): far more tiles than are resident, so the
    look-back meets NOT_READY and AGGREGATE predecessors.  Ten runs, all identical."""
    from nemo_dcr.kernels.cpu import xor_diff_c
    from nemo_dcr.kernels.triton_xor import xor_diff_device

    cur, base = make_pair(torch.bfloat16, 1 << 26, rate, seed=7)
    want = xor_diff_c(cur, base)
    g_cur, g_base = cur.cuda(), base.cuda()
    first = xor_diff_device(g_cur, g_base, tile=tile, impl="single_pass")
    assert first.to_host().bit_equal(want)
    assert same(first, xor_diff_device(g_cur, g_base, tile=tile, impl="two_pass"))
    for _ in range(10):
        assert same(xor_diff_device(g_cur, g_base, tile=tile, impl="single_pass"), first)


@needs_cuda
@pytest.mark.parametrize("capacity", [0, 1, 12_345, 1 << 20])
def test_single_pass_overflow_completion(capacity):
    from nemo_dcr.kernels.cpu import xor_diff_c
    from nemo_dcr.kernels.triton_xor import xor_diff_device

    cur, base = make_pair(torch.bfloat16, (1 << 22) + 5, 0.1, seed=3)
    want = xor_diff_c(cur, base)
    got = xor_diff_device(cur.cuda(), base.cuda(), impl="single_pass", capacity=capacity)
    assert got.to_host().bit_equal(want)


@needs_cuda
def test_single_pass_into_pinned_buffers_and_both_probe_forms():
    import triton.language as tl

    from nemo_dcr.kernels import triton_xor as tx

    cur, base = make_pair(torch.bfloat16, (1 << 21) + 3, 0.03, seed=5)
    want = xor_diff_reference(cur, base)
    out = DiffBuffers.allocate(want.num_changed, 2, pin_memory=True)
    assert tx.xor_diff_into_triton(cur.cuda(), base.cuda(), out, impl="single_pass").bit_equal(want)
    saved = tx.HAS_ATOMIC_LOAD
    try:
        for form in ({True, False} if hasattr(tl, "atomic_load") else {False}):
            tx.HAS_ATOMIC_LOAD = form
            assert tx.xor_diff_device(cur.cuda(), base.cuda(), impl="single_pass").to_host().bit_equal(want)
    finally:
        tx.HAS_ATOMIC_LOAD = saved
