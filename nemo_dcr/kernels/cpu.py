"""CPU path: the C passes of ``csrc/xor_diff.c``, threaded over blocks.

All release the GIL and split the blocks over ``num_threads`` POSIX threads (not OpenMP:
torch ships its own runtime).  ``xor_diff_c`` and ``xor_diff_into_c`` without counts make
one pass: each thread compacts its blocks into a private scratch kept between calls, then
the pieces are copied, in block order, into the exact output (k(8 + w) extra bytes moved
instead of a second read of 2nw).  ``xor_diff_into_c`` with counts runs only the fill
pass, which writes in place at the counts' prefix sums and never reads an empty block.
"""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.kernels import _cxor
from nemo_dcr.kernels.types import (
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    bits_view_np,
    check_pair,
)
from nemo_dcr.errors import ValidationError

#: A thread is worth starting only for at least this many input bytes (current + baseline).
MIN_BYTES_PER_THREAD = 4 << 20


def release_scratch() -> None:
    """Free the per-thread scratch the one-pass diff keeps between calls (at most 128 MiB
    per thread; larger scratch is freed after each call anyway)."""
    _cxor.release_scratch()


def default_threads(nbytes: int) -> int:
    """torch's intra-op thread count, reduced so that each thread gets real work."""
    return max(1, min(torch.get_num_threads(), nbytes // MIN_BYTES_PER_THREAD))


def _operands(current: torch.Tensor, baseline: torch.Tensor, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    check_pair(current, baseline, block_size)
    if current.device.type != "cpu" or baseline.device.type != "cpu":
        raise ValidationError(f"the C path needs CPU tensors, got {current.device} and {baseline.device}")
    return bits_view_np(current.detach().contiguous()), bits_view_np(baseline.detach().contiguous())


def _threads(a: np.ndarray, num_threads: int | None) -> int:
    if num_threads is None:
        return default_threads(2 * a.nbytes)
    if num_threads < 1:
        raise ValidationError(f"num_threads must be >= 1, got {num_threads}")
    return num_threads


def _count(a: np.ndarray, b: np.ndarray, block_size: int, nt: int) -> tuple[np.ndarray, int]:
    counts = np.empty(-(-a.size // block_size), dtype=np.int64)
    total = _cxor.count(a, b, a.itemsize, block_size, nt, counts)
    return counts, total


def _fill(a, b, block_size, nt, counts, positions, values) -> None:
    try:
        _cxor.fill(a, b, a.itemsize, block_size, nt, counts, positions, values)
    except LookupError as e:
        raise StaleCountsError(str(e)) from None


def block_counts_c(
    current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16, num_threads: int | None = None
) -> np.ndarray:
    a, b = _operands(current, baseline, block_size)
    return _count(a, b, block_size, _threads(a, num_threads))[0]


def xor_diff_c(
    current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16, num_threads: int | None = None
) -> XorDiff:
    a, b = _operands(current, baseline, block_size)
    counts = np.empty(-(-a.size // block_size), dtype=np.int64)
    positions, values = _cxor.diff(
        a, b, a.itemsize, block_size, _threads(a, num_threads), counts,
        lambda k: (np.empty(k, dtype=np.int64), np.empty(k, dtype=a.dtype)),
    )
    return XorDiff(positions, values, counts, block_size, int(a.size))


def xor_diff_into_c(
    current: torch.Tensor,
    baseline: torch.Tensor,
    out: DiffBuffers,
    *,
    block_size: int = 1 << 16,
    block_counts: np.ndarray | None = None,
    num_threads: int | None = None,
) -> XorDiff:
    a, b = _operands(current, baseline, block_size)
    if out.xor_values.dtype != dtypes.bits_of_width(a.itemsize):
        raise ValidationError(f"buffers carry {out.xor_values.dtype}, the tensor needs {dtypes.bits_of_width(a.itemsize)}")
    nt = _threads(a, num_threads)
    if block_counts is None:
        counts = np.empty(-(-a.size // block_size), dtype=np.int64)

        def views(k: int) -> tuple[np.ndarray, np.ndarray]:
            if k > out.capacity:
                raise DiffCapacityError(k, out.capacity, counts.copy())
            return out.positions[:k], out.xor_values[:k]

        positions, values = _cxor.diff(a, b, a.itemsize, block_size, nt, counts, views)
        return XorDiff(positions, values, counts, block_size, int(a.size))
    counts = np.array(block_counts, dtype=np.int64, copy=True)
    if counts.shape != (-(-a.size // block_size),):
        raise ValidationError(f"block_counts has shape {counts.shape}, the tensor has {-(-a.size // block_size)} blocks")
    total = int(counts.sum())
    if total > out.capacity:
        raise DiffCapacityError(total, out.capacity, counts)
    positions, values = out.positions[:total], out.xor_values[:total]
    _fill(a, b, block_size, nt, counts, positions, values)
    return XorDiff(positions, values, counts, block_size, int(a.size))
