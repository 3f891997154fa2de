"""CUDA path: XOR diff as two Triton kernels around a device prefix sum.

  1. ``_count_kernel``: one program per tile of ``TILE`` elements loads both tiles, XORs
     them and stores the tile's changed count (int32).
  2. ``torch.cumsum`` of the tile counts gives each tile's output offset; one scalar copy
     to the host sizes the outputs exactly.
  3. ``_fill_kernel``: a tile whose count is zero returns at once (block skipping);
     others reload their tile, rank the changed lanes with an in-tile ``tl.cumsum`` and
     scatter (position, xor value) to ``offset + rank``: tiles are disjoint and ordered,
     so positions come out sorted with no atomics and the result is deterministic.

Memory traffic for n elements of w bytes, k changed, t tiles: reads 2nw (count) + up to
2nw (fill; only non-empty tiles) + 8t, writes k(8 + w) + 12t.  ``block_counts`` are tile
counts summed per block when ``block_size`` is a multiple of the tile, else a bincount of
the positions on device.

Everything works on integer views of the tensors, so the kernels never see a float and the
XOR values are the exact bits.  Under ``TRITON_INTERPRET=1`` the same code runs on CPU
tensors (the tests use that).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from nemo_dcr.kernels.types import (
    BITS_NP,
    BITS_TORCH,
    BITS_TORCH_NP,
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    check_pair,
)

#: Largest tile; a tile is the largest power of two <= MAX_TILE that divides block_size.
MAX_TILE = 4096
_MIN_TILE = 128


@triton.jit
def _count_kernel(a_ptr, b_ptr, tile_counts_ptr, numel, TILE: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    offs = tile * TILE + tl.arange(0, TILE)
    inside = offs < numel
    a = tl.load(a_ptr + offs, mask=inside, other=0)
    b = tl.load(b_ptr + offs, mask=inside, other=0)
    changed = ((a ^ b) != 0).to(tl.int32)
    tl.store(tile_counts_ptr + tile, tl.sum(changed, axis=0))


@triton.jit
def _fill_kernel(a_ptr, b_ptr, tile_counts_ptr, tile_offsets_ptr, pos_ptr, val_ptr, numel, TILE: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    count = tl.load(tile_counts_ptr + tile)
    if count > 0:
        offs = tile * TILE + tl.arange(0, TILE)
        inside = offs < numel
        a = tl.load(a_ptr + offs, mask=inside, other=0)
        b = tl.load(b_ptr + offs, mask=inside, other=0)
        x = a ^ b
        changed = x != 0
        rank = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        dst = tl.load(tile_offsets_ptr + tile) + rank.to(tl.int64)
        tl.store(pos_ptr + dst, offs, mask=changed)
        tl.store(val_ptr + dst, x, mask=changed)


def tile_for(block_size: int) -> int:
    """Tile size for a block size: its largest power-of-two divisor, clipped to the tile range."""
    low_bit = block_size & -block_size
    return min(MAX_TILE, max(_MIN_TILE, low_bit))


@dataclass(frozen=True, eq=False)
class DeviceXorDiff:
    """``XorDiff`` whose arrays stay on the device (torch tensors, values as signed ints of
    the element width, to be reinterpreted as unsigned on the host)."""

    positions: torch.Tensor
    xor_values: torch.Tensor
    block_counts: torch.Tensor
    block_size: int
    numel: int

    def to_host(self) -> XorDiff:
        width = self.xor_values.element_size()
        return XorDiff(
            self.positions.cpu().numpy(),
            self.xor_values.cpu().numpy().view(BITS_NP[width]),
            self.block_counts.cpu().numpy().astype(np.int64, copy=False),
            self.block_size,
            self.numel,
        )


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(BITS_TORCH[t.element_size()])


def _tile_counts(a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor:
    ntiles = triton.cdiv(a.numel(), tile)
    counts = torch.empty(ntiles, dtype=torch.int32, device=a.device)
    if ntiles:
        _count_kernel[(ntiles,)](a, b, counts, a.numel(), TILE=tile, num_warps=8 if tile >= 2048 else 4)
    return counts


def _block_counts_from_tiles(tile_counts: torch.Tensor, numel: int, block_size: int, tile: int) -> torch.Tensor:
    nblocks = -(-numel // block_size)
    per_block = block_size // tile
    padded = torch.zeros(nblocks * per_block, dtype=torch.int64, device=tile_counts.device)
    padded[: tile_counts.numel()] = tile_counts
    return padded.view(nblocks, per_block).sum(dim=1)


def block_counts_triton(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> np.ndarray:
    """Per-block counts from the count kernel alone when the tile divides ``block_size``."""
    check_pair(current, baseline, block_size)
    tile = tile_for(block_size)
    if block_size % tile:
        return xor_diff_device(current, baseline, block_size=block_size).block_counts.cpu().numpy()
    a, b = _flat_bits(current), _flat_bits(baseline)
    counts = _block_counts_from_tiles(_tile_counts(a, b, tile), a.numel(), block_size, tile)
    return counts.cpu().numpy()


def xor_diff_device(
    current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16, tile: int | None = None
) -> DeviceXorDiff:
    """The diff with device-resident results (one device->host sync, for the total)."""
    check_pair(current, baseline, block_size)
    if current.device != baseline.device:
        raise ValueError(f"current on {current.device}, baseline on {baseline.device}")
    tile = tile_for(block_size) if tile is None else tile
    if tile & (tile - 1) or tile < 16:
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    a, b = _flat_bits(current), _flat_bits(baseline)
    numel = a.numel()
    tile_counts = _tile_counts(a, b, tile)
    inclusive = torch.cumsum(tile_counts, dim=0, dtype=torch.int64)
    total = int(inclusive[-1]) if numel else 0
    positions = torch.empty(total, dtype=torch.int64, device=a.device)
    values = torch.empty(total, dtype=a.dtype, device=a.device)
    if total:
        _fill_kernel[(tile_counts.numel(),)](
            a, b, tile_counts, inclusive - tile_counts, positions, values, numel,
            TILE=tile, num_warps=8 if tile >= 2048 else 4,
        )
    if block_size % tile == 0:
        block_counts = _block_counts_from_tiles(tile_counts, numel, block_size, tile)
    else:
        block_counts = torch.bincount(positions // block_size, minlength=-(-numel // block_size))
    return DeviceXorDiff(positions, values, block_counts, block_size, numel)


def xor_diff_triton(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> XorDiff:
    return xor_diff_device(current, baseline, block_size=block_size).to_host()


def xor_diff_into_triton(
    current: torch.Tensor,
    baseline: torch.Tensor,
    out: DiffBuffers,
    *,
    block_size: int = 1 << 16,
    block_counts: np.ndarray | None = None,
) -> XorDiff:
    """Device diff copied into the caller's (ideally pinned) host buffers.

    Given ``block_counts`` are checked against the recomputed ones (the device pass
    recounts anyway; a mismatch means the caller's counts are stale)."""
    d = xor_diff_device(current, baseline, block_size=block_size)
    counts = d.block_counts.cpu().numpy().astype(np.int64, copy=False)
    if block_counts is not None and not np.array_equal(np.asarray(block_counts), counts):
        raise StaleCountsError("block_counts do not match current ^ baseline")
    total = d.positions.numel()
    width = d.xor_values.element_size()
    if out.xor_values.dtype != BITS_NP[width]:
        raise ValueError(f"buffers carry {out.xor_values.dtype}, the tensor needs {BITS_NP[width]}")
    if total > out.capacity:
        raise DiffCapacityError(total, out.capacity, counts)
    positions, values = out.positions[:total], out.xor_values[:total]
    torch.from_numpy(positions).copy_(d.positions)
    torch.from_numpy(values.view(BITS_TORCH_NP[width])).copy_(d.xor_values)
    return XorDiff(positions, values, counts, block_size, d.numel)
