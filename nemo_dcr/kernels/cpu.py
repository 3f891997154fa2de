"""CPU path: the C count and fill passes of ``csrc/xor_diff.c``, threaded over blocks.

Both passes release the GIL and split the blocks over ``num_threads`` POSIX threads (not
OpenMP: torch ships its own runtime).  ``xor_diff_c`` is count -> exact allocation -> fill;
``xor_diff_into_c`` skips the allocation (and, given counts, the count pass).
"""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.kernels import _cxor
from nemo_dcr.kernels.types import (
    BITS_NP,
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    bits_view_np,
    check_pair,
)

#: A thread is worth starting only for at least this many input bytes (current + baseline).
MIN_BYTES_PER_THREAD = 4 << 20


def default_threads(nbytes: int) -> int:
    """torch's intra-op thread count, reduced so that each thread gets real work."""
    return max(1, min(torch.get_num_threads(), nbytes // MIN_BYTES_PER_THREAD))


def _operands(current: torch.Tensor, baseline: torch.Tensor, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    check_pair(current, baseline, block_size)
    if current.device.type != "cpu" or baseline.device.type != "cpu":
        raise ValueError(f"the C path needs CPU tensors, got {current.device} and {baseline.device}")
    return bits_view_np(current.detach().contiguous()), bits_view_np(baseline.detach().contiguous())


def _threads(a: np.ndarray, num_threads: int | None) -> int:
    if num_threads is None:
        return default_threads(2 * a.nbytes)
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
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
    nt = _threads(a, num_threads)
    counts, total = _count(a, b, block_size, nt)
    positions = np.empty(total, dtype=np.int64)
    values = np.empty(total, dtype=a.dtype)
    _fill(a, b, block_size, nt, counts, positions, values)
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
    if out.xor_values.dtype != BITS_NP[a.itemsize]:
        raise ValueError(f"buffers carry {out.xor_values.dtype}, the tensor needs {BITS_NP[a.itemsize]}")
    nt = _threads(a, num_threads)
    if block_counts is None:
        counts, total = _count(a, b, block_size, nt)
    else:
        counts = np.array(block_counts, dtype=np.int64, copy=True)
        if counts.shape != (-(-a.size // block_size),):
            raise ValueError(f"block_counts has shape {counts.shape}, the tensor has {-(-a.size // block_size)} blocks")
        total = int(counts.sum())
    if total > out.capacity:
        raise DiffCapacityError(total, out.capacity, counts)
    positions, values = out.positions[:total], out.xor_values[:total]
    _fill(a, b, block_size, nt, counts, positions, values)
    return XorDiff(positions, values, counts, block_size, int(a.size))
