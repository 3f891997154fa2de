"""CUDA path of the XOR diff: Triton kernels, in two implementations with identical output.

Both work on integer views of the tensors (the kernels never see a float, so the XOR values
are the exact bits), split the flat tensor into tiles of ``TILE`` elements, rank the changed
lanes of a tile with an in-tile ``tl.cumsum`` and store (position, xor value) at the tile's
output offset plus that rank.  Tiles are disjoint and their offsets are the prefix sum of the
tile counts in tile order, so positions come out sorted and every run writes the same bytes
(no output-order race, whatever order the programs run in).  Under ``TRITON_INTERPRET=1`` the
same code runs on CPU tensors; the tests compare both implementations with the C path and
the numpy reference there, bit for bit.

``impl="two_pass"`` (the default): two kernels around a device prefix sum.
  1. ``_count_kernel``: one program per tile loads both tiles, XORs them and stores the
     tile's changed count (int32).
  2. ``torch.cumsum`` of the tile counts gives each tile's output offset; one scalar copy to
     the host sizes the outputs exactly.
  3. ``_fill_kernel``: a tile whose count is zero returns at once (block skipping); the
     others reload their tile and scatter to ``offset + rank``.
  Traffic for n elements of w bytes, k changed, t tiles: reads 2nw (count) + up to 2nw
  (fill; non-empty tiles only) + 8t, writes k(8 + w) + 12t.  At a few percent changed
  nearly every tile is non-empty, so the parameters are read twice and BF16 parameter
  throughput is capped at a quarter of HBM bandwidth.

``impl="single_pass"``: one kernel, a decoupled look-back scan (Merrill & Garland, "Single-pass
Parallel Prefix Scan with Decoupled Look-back", 2016, as in CUB), ``_single_pass_kernel``.
  Each program:
  1. takes a ticket, ``tile = atomic_add(ticket, 1)``, and works on that tile (the ticket,
     not ``program_id``, is the tile: see forward progress below);
  2. loads its tile of both tensors ONCE, XORs, counts the changed lanes and publishes
     ``status[tile] = AGGREGATE(count)``;
  3. looks back over its predecessors ``tile-1, tile-2, ...``, WINDOW status words per step
     (one vector load): it adds up AGGREGATE values until it meets an INCLUSIVE word (a
     predecessor that already knows its own inclusive prefix), whose value ends the walk;
     on a NOT_READY word it re-reads from there (spin).  The sum is the tile's exclusive
     offset; it publishes ``status[tile] = INCLUSIVE(offset + count)``;
  4. scatters its changed lanes to ``offset + rank`` from the registers it loaded in 2, and
     adds its count to its block's count (integer atomics: the sum is order-independent).
  A status word is one int64, ``value << 2 | flag`` (flag 0 NOT_READY, 1 AGGREGATE,
  2 INCLUSIVE), so a flag and its value are published and read together by one 64-bit
  access, never torn.  The ticket counter, the status words and the block counts live in one
  zeroed int64 buffer (one memset per call).
  Traffic: reads 2nw once + look-back words (a few WINDOW-word reads per tile, L2-resident),
  writes k(8 + w) + 16t (two status publishes per tile) + 8(1 + t + B) (the memset) + one
  block-count atomic per non-empty tile.  Parameter throughput is then bounded by half of
  HBM bandwidth, twice the two-pass bound.  Output slots must exist before the pass, so the kernel writes into a buffer of
  ``capacity`` slots (default ``default_capacity(numel)``, numel/8 + one tile), one whole
  tile at a time: a tile whose inclusive prefix exceeds the capacity writes nothing.  After
  the kernel one scalar copy reads the total (the last tile's INCLUSIVE word).  If it exceeds
  the capacity (more than ~12.5 % changed at the default), the written prefix is copied into
  an exact-size buffer and ``_fill_kernel`` (the two-pass fill) completes the tiles that did
  not fit, from the offsets the scan left in the status words: correct at any rate, with a
  second read of the tiles that did not fit.  The returned arrays are views of the first
  ``total`` slots of the capacity-sized buffers.

Memory ordering and forward progress of the single pass (the PTX memory model, scope "gpu"):
  * Publishes are ``tl.atomic_store(sem="release")`` (Triton >= 3.9; ``tl.atomic_xchg(...,
    sem="release")`` on an older Triton); look-back reads are ``tl.atomic_load(sem="acquire")``
    (``tl.atomic_add(ptr, 0, sem="acquire")``, an RMW, on an older Triton: correct, but every
    probe then is an L2 atomic on a few hot lines, expect it slower).  The data a tile passes
    to its successors is entirely inside the status word, so atomicity plus coherence (a
    reader eventually sees the last write; two reads of one word never see it go backwards:
    AGGREGATE may be seen before INCLUSIVE, never after) is what correctness needs; the
    release/acquire pairs additionally order each tile's loads before its publishes and keep
    the compiler from hoisting a probe out of the spin loop.  Output stores and block-count
    atomics are read only after the kernel ends (stream order), so they need no ordering
    here; the block-count atomics are relaxed.
  * The ticket ``atomic_add`` is relaxed: it only hands out distinct tile numbers.  A program
    that drew ticket i is running, and so are (or were) all programs that drew tickets < i,
    because they drew them earlier.  A tile waits only on lower tiles, tile 0 waits on
    nothing, and a CTA that has started keeps its SM until it finishes (it is never swapped
    out for good in favour of one not yet started), so by induction every wait ends: no
    deadlock, whatever order the hardware launches programs in.
    With ``program_id`` as the tile this would not hold (CTA launch order is unspecified:
    tile i could wait on a tile i-1 that cannot start until tile i's SM frees up).
  * The ticket, status words and block counts are zeroed by a memset on the same stream
    before the kernel, so each call starts from NOT_READY everywhere.
  * The Triton interpreter runs programs one after another in program-id order
    (``GridExecutor.__call__`` loops over the grid), so there every predecessor is already
    INCLUSIVE and no spin happens; the look-back step (``_look_back_step``) is tested on
    its own on hand-made status arrays with NOT_READY and AGGREGATE words.

GPU status: NEITHER implementation has run on a GPU yet (no device in the sessions that
wrote them); both are verified bit-exact only through the interpreter.  The single-pass
kernel is compiled for sm_90 without a device in the tests (``triton.compile`` with a
``GPUTarget``); with Triton 3.9 the ticket lowers to one ``atom.relaxed.gpu.add``, each
publish to ``fence.release.gpu`` + ``st.relaxed.gpu`` by one thread, each probe to
``ld.relaxed.gpu`` + ``fence.acquire.gpu`` inside the loop, the block count to
``red.relaxed.gpu.add``.  ``two_pass`` stays the default because it has no inter-program
waits, so a compilation or memory-model mistake can make it wrong but not hang;
``single_pass`` becomes a candidate default once ``scripts/gpu_check.sh`` has passed on a
GPU (tests, then the side-by-side benchmark).

``block_counts`` are tile counts summed per block when ``block_size`` is a multiple of the
tile (two_pass: a reshape-sum of the tile counts; single_pass: in-kernel atomics), else a
bincount of the positions on device (both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import triton
import triton.language as tl

from nemo_dcr import dtypes
from nemo_dcr.errors import ValidationError
from nemo_dcr.kernels.types import (
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    check_pair,
)

#: Largest tile; a tile is the largest power of two <= MAX_TILE that divides block_size.
MAX_TILE = 4096
_MIN_TILE = 128
#: Status words one look-back step reads (one vector load).
LOOK_BACK_WINDOW = 32
#: ``tl.atomic_load``/``tl.atomic_store`` exist (Triton >= 3.9); else RMW stand-ins.
#: Module-level so the tests can run both forms.
HAS_ATOMIC_LOAD = hasattr(tl, "atomic_load") and hasattr(tl, "atomic_store")

Impl = Literal["two_pass", "single_pass"]
IMPLS: tuple[str, ...] = ("two_pass", "single_pass")
#: Verified default (see the module docstring, "GPU status").
DEFAULT_IMPL: Impl = "two_pass"

# Status word flags (low two bits; the value is the word >> 2).
NOT_READY = 0
AGGREGATE = 1
INCLUSIVE = 2


@triton.jit
def _tile_xor(a_ptr, b_ptr, tile, numel, TILE: tl.constexpr):
    """(element indices, XOR, changed mask) of one tile; lanes past ``numel`` read as equal."""
    offs = tile * TILE + tl.arange(0, TILE)
    inside = offs < numel
    a = tl.load(a_ptr + offs, mask=inside, other=0)
    b = tl.load(b_ptr + offs, mask=inside, other=0)
    x = a ^ b
    return offs, x, x != 0


@triton.jit
def _count_kernel(a_ptr, b_ptr, tile_counts_ptr, numel, TILE: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    _, _, changed = _tile_xor(a_ptr, b_ptr, tile, numel, TILE)
    tl.store(tile_counts_ptr + tile, tl.sum(changed.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["done_below"])
def _fill_kernel(
    a_ptr, b_ptr, tile_counts_ptr, tile_offsets_ptr, pos_ptr, val_ptr, numel, done_below, TILE: tl.constexpr
):
    """Scatter each non-empty tile to its offset; tiles ending at or below ``done_below``
    output slots are already written (the single pass's overflow completion) and skipped."""
    tile = tl.program_id(0).to(tl.int64)
    count = tl.load(tile_counts_ptr + tile)
    start = tl.load(tile_offsets_ptr + tile)
    if (count > 0) & (start + count > done_below):
        offs, x, changed = _tile_xor(a_ptr, b_ptr, tile, numel, TILE)
        rank = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        dst = start + rank.to(tl.int64)
        tl.store(pos_ptr + dst, offs, mask=changed)
        tl.store(val_ptr + dst, x, mask=changed)


@triton.jit
def _publish(word_ptr, word, ATOMIC_LOAD: tl.constexpr):
    if ATOMIC_LOAD:
        tl.atomic_store(word_ptr, word, sem="release")
    else:
        tl.atomic_xchg(word_ptr, word, sem="release")


@triton.jit
def _look_back_step(status_ptr, hi, excl, WINDOW: tl.constexpr, ATOMIC_LOAD: tl.constexpr):
    """One look-back step over the status words ``hi, hi-1, ..., hi-WINDOW+1`` (one load).

    Returns ``(hi, excl)``: the AGGREGATE values in front of the first word that is not an
    AGGREGATE are added to ``excl``; an INCLUSIVE word is added too and ends the walk
    (``hi = -1``); a NOT_READY word becomes the next ``hi`` (the caller re-reads it: spin);
    a window of AGGREGATEs moves ``hi`` down by WINDOW.  Indices below 0 read as
    INCLUSIVE(0), so the walk always ends at tile 0."""
    lane = tl.arange(0, WINDOW)
    idx = hi - lane
    valid = idx >= 0
    if ATOMIC_LOAD:
        word = tl.atomic_load(status_ptr + idx, mask=valid, sem="acquire")
    else:
        word = tl.atomic_add(status_ptr + idx, tl.zeros([WINDOW], dtype=tl.int64), mask=valid, sem="acquire")
    word = tl.where(valid, word, 2)  # INCLUSIVE, value 0
    flag = word & 3
    stop = tl.min(tl.where(flag != 1, lane, WINDOW), axis=0)  # first non-AGGREGATE lane
    stop_flag = tl.sum(tl.where(lane == stop, flag, 0), axis=0)  # 0 when stop == WINDOW
    done = stop_flag == 2
    take = (lane < stop) | ((lane == stop) & done)
    excl = excl + tl.sum(tl.where(take, word >> 2, 0), axis=0)
    hi = tl.where(done, -1, hi - stop)
    return hi, excl


@triton.jit(do_not_specialize=["capacity", "block_counts_offset", "tiles_per_block"])
def _single_pass_kernel(
    a_ptr, b_ptr, ctrl_ptr, pos_ptr, val_ptr, numel, capacity, block_counts_offset, tiles_per_block,
    TILE: tl.constexpr, WINDOW: tl.constexpr, COUNT_BLOCKS: tl.constexpr, ATOMIC_LOAD: tl.constexpr,
):
    """ctrl: int64, zeroed: [0] ticket counter, [1, 1 + tiles) status words, then (when
    COUNT_BLOCKS) one count per block at ``block_counts_offset``.  Design and memory ordering:
    module docstring.  Hot path, per tile: 2*TILE*w bytes read once, its outputs written once."""
    tile = tl.atomic_add(ctrl_ptr, 1, sem="relaxed").to(tl.int64)  # dynamic tile id (ticket)
    status_ptr = ctrl_ptr + 1
    offs, x, changed = _tile_xor(a_ptr, b_ptr, tile, numel, TILE)
    count = tl.sum(changed.to(tl.int32), axis=0).to(tl.int64)
    _publish(status_ptr + tile, count * 4 + 1, ATOMIC_LOAD)  # AGGREGATE(count)
    hi = tile - 1
    excl = tile * 0
    while hi >= 0:
        hi, excl = _look_back_step(status_ptr, hi, excl, WINDOW, ATOMIC_LOAD)
    _publish(status_ptr + tile, (excl + count) * 4 + 2, ATOMIC_LOAD)  # INCLUSIVE(excl + count)
    if (count > 0) & (excl + count <= capacity):  # whole tiles only: the fitted tiles are a prefix
        rank = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        dst = excl + rank.to(tl.int64)
        tl.store(pos_ptr + dst, offs, mask=changed)
        tl.store(val_ptr + dst, x, mask=changed)
    if COUNT_BLOCKS:
        if count > 0:
            tl.atomic_add(ctrl_ptr + block_counts_offset + tile // tiles_per_block, count, sem="relaxed")


def tile_for(block_size: int) -> int:
    """Tile size for a block size: its largest power-of-two divisor, clipped to the tile range."""
    low_bit = block_size & -block_size
    return min(MAX_TILE, max(_MIN_TILE, low_bit))


def default_capacity(numel: int) -> int:
    """Output slots the single pass allocates up front: numel/8 + one tile (at most numel).

    Real BF16 optimizer steps change 0.5-10 % of the elements; above the capacity the
    single pass falls back to a second read of the tiles that did not fit."""
    return min(numel, numel // 8 + MAX_TILE)


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
            self.xor_values.cpu().numpy().view(dtypes.bits_of_width(width)),
            self.block_counts.cpu().numpy().astype(np.int64, copy=False),
            self.block_size,
            self.numel,
        )


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return dtypes.int_view(t.detach().contiguous().reshape(-1))


def _num_warps(tile: int) -> int:
    return 8 if tile >= 2048 else 4


def _tile_counts(a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor:
    ntiles = triton.cdiv(a.numel(), tile)
    counts = torch.empty(ntiles, dtype=torch.int32, device=a.device)
    if ntiles:
        _count_kernel[(ntiles,)](a, b, counts, a.numel(), TILE=tile, num_warps=_num_warps(tile))
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


def _two_pass(a: torch.Tensor, b: torch.Tensor, block_size: int, tile: int) -> DeviceXorDiff:
    numel = a.numel()
    tile_counts = _tile_counts(a, b, tile)
    inclusive = torch.cumsum(tile_counts, dim=0, dtype=torch.int64)
    total = int(inclusive[-1]) if numel else 0
    positions = torch.empty(total, dtype=torch.int64, device=a.device)
    values = torch.empty(total, dtype=a.dtype, device=a.device)
    if total:
        _fill_kernel[(tile_counts.numel(),)](
            a, b, tile_counts, inclusive - tile_counts, positions, values, numel, 0,
            TILE=tile, num_warps=_num_warps(tile),
        )
    if block_size % tile == 0:
        block_counts = _block_counts_from_tiles(tile_counts, numel, block_size, tile)
    else:
        block_counts = torch.bincount(positions // block_size, minlength=-(-numel // block_size))
    return DeviceXorDiff(positions, values, block_counts, block_size, numel)


def _single_pass(a: torch.Tensor, b: torch.Tensor, block_size: int, tile: int, capacity: int) -> DeviceXorDiff:
    numel = a.numel()
    ntiles = triton.cdiv(numel, tile)
    nblocks = -(-numel // block_size)
    count_blocks = block_size % tile == 0
    # one memset: [ticket | status words | block counts]
    ctrl = torch.zeros(1 + ntiles + (nblocks if count_blocks else 0), dtype=torch.int64, device=a.device)
    positions = torch.empty(capacity, dtype=torch.int64, device=a.device)
    values = torch.empty(capacity, dtype=a.dtype, device=a.device)
    if ntiles:
        _single_pass_kernel[(ntiles,)](
            a, b, ctrl, positions, values, numel, capacity, 1 + ntiles, block_size // tile if count_blocks else 1,
            TILE=tile, WINDOW=LOOK_BACK_WINDOW, COUNT_BLOCKS=count_blocks, ATOMIC_LOAD=HAS_ATOMIC_LOAD,
            num_warps=_num_warps(tile),
        )
    total = int(ctrl[ntiles]) >> 2 if ntiles else 0  # the last tile's INCLUSIVE word: one sync
    if total > capacity:  # overflow: keep the fitted prefix, fill the rest from the scan's offsets
        inclusive = ctrl[1 : 1 + ntiles] >> 2
        tile_counts = torch.diff(inclusive, prepend=inclusive.new_zeros(1))
        full_pos = torch.empty(total, dtype=torch.int64, device=a.device)
        full_val = torch.empty(total, dtype=a.dtype, device=a.device)
        full_pos[:capacity].copy_(positions)
        full_val[:capacity].copy_(values)
        _fill_kernel[(ntiles,)](
            a, b, tile_counts, inclusive - tile_counts, full_pos, full_val, numel, capacity,
            TILE=tile, num_warps=_num_warps(tile),
        )
        positions, values = full_pos, full_val
    else:
        positions, values = positions[:total], values[:total]
    if count_blocks:
        block_counts = ctrl[1 + ntiles :]
    else:
        block_counts = torch.bincount(positions // block_size, minlength=nblocks)
    return DeviceXorDiff(positions, values, block_counts, block_size, numel)


def xor_diff_device(
    current: torch.Tensor,
    baseline: torch.Tensor,
    *,
    block_size: int = 1 << 16,
    tile: int | None = None,
    impl: Impl = DEFAULT_IMPL,
    capacity: int | None = None,
) -> DeviceXorDiff:
    """The diff with device-resident results (one device->host sync, for the total).

    ``impl``: "two_pass" or "single_pass" (module docstring).  ``capacity``: single pass
    only, output slots allocated before the pass (default ``default_capacity``); a larger
    diff is still exact, through the overflow fill."""
    check_pair(current, baseline, block_size)
    if current.device != baseline.device:
        raise ValidationError(f"current on {current.device}, baseline on {baseline.device}")
    if impl not in IMPLS:
        raise ValidationError(f"impl must be one of {IMPLS}, got {impl!r}")
    if capacity is not None and (impl != "single_pass" or capacity < 0):
        raise ValidationError(f"capacity is a non-negative slot count for impl='single_pass', got {capacity} for {impl!r}")
    tile = tile_for(block_size) if tile is None else tile
    if tile & (tile - 1) or tile < 16:
        raise ValidationError(f"tile must be a power of two >= 16, got {tile}")
    a, b = _flat_bits(current), _flat_bits(baseline)
    if impl == "two_pass":
        return _two_pass(a, b, block_size, tile)
    capacity = default_capacity(a.numel()) if capacity is None else min(capacity, a.numel())
    return _single_pass(a, b, block_size, tile, capacity)


def xor_diff_triton(
    current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16, impl: Impl = DEFAULT_IMPL
) -> XorDiff:
    return xor_diff_device(current, baseline, block_size=block_size, impl=impl).to_host()


def xor_diff_into_triton(
    current: torch.Tensor,
    baseline: torch.Tensor,
    out: DiffBuffers,
    *,
    block_size: int = 1 << 16,
    block_counts: np.ndarray | None = None,
    impl: Impl = DEFAULT_IMPL,
) -> XorDiff:
    """Device diff copied into the caller's (ideally pinned) host buffers.

    Given ``block_counts`` are checked against the recomputed ones (the device pass
    recounts anyway; a mismatch means the caller's counts are stale)."""
    d = xor_diff_device(current, baseline, block_size=block_size, impl=impl)
    counts = d.block_counts.cpu().numpy().astype(np.int64, copy=False)
    if block_counts is not None and not np.array_equal(np.asarray(block_counts), counts):
        raise StaleCountsError("block_counts do not match current ^ baseline")
    total = d.positions.numel()
    width = d.xor_values.element_size()
    if out.xor_values.dtype != dtypes.bits_of_width(width):
        raise ValidationError(f"buffers carry {out.xor_values.dtype}, the tensor needs {dtypes.bits_of_width(width)}")
    if total > out.capacity:
        raise DiffCapacityError(total, out.capacity, counts)
    positions, values = out.positions[:total], out.xor_values[:total]
    torch.from_numpy(positions).copy_(d.positions)
    torch.from_numpy(values.view(dtypes.torch_int_np(width))).copy_(d.xor_values)
    return XorDiff(positions, values, counts, block_size, d.numel)
