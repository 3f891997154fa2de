"""Result and buffer types of the XOR diff, and the bit views every implementation uses."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import DcrError, ValidationError

# Bit views come from ``nemo_dcr.dtypes``: ``bits_of_width`` (unsigned numpy),
# ``torch_int_of_width`` (signed torch where torch lacks full unsigned support; for
# device-side views, never for arithmetic) and ``torch_int_np`` (its numpy twin, to copy
# device bits into host buffers without a cast).
_UNSIGNED = frozenset(dtypes.bits_of_width(w) for w in dtypes.WIDTHS)


class StaleCountsError(DcrError, RuntimeError):
    """Block counts handed to a fill pass do not describe ``current ^ baseline``.

    Raised when a block's rescan disagrees with its count (the tensors changed between the
    passes, or the counts came from another pair).  The output buffers then hold partial
    data and must not be used."""


class DiffCapacityError(ValidationError):
    """Caller-provided ``DiffBuffers`` are too small for this diff.

    ``needed`` is the number of changed elements and ``block_counts`` the counts already
    computed, so the caller can grow its buffers and retry with
    ``xor_diff_into(..., block_counts=err.block_counts)`` without a second count pass."""

    def __init__(self, needed: int, capacity: int, block_counts: np.ndarray):
        super().__init__(f"diff has {needed} changed elements, buffers hold {capacity}")
        self.needed = needed
        self.capacity = capacity
        self.block_counts = block_counts


@dataclass(frozen=True, eq=False)
class XorDiff:
    """Changed elements of one flat tensor (``current`` vs ``baseline``).

    positions: int64 flat indices where the bits differ, strictly increasing.
    xor_values: ``current_bits ^ baseline_bits`` at those positions, unsigned, same width as
        the element (so NaN payloads, signed zeros and subnormals survive).
    block_counts: int64, changed elements in each ``block_size`` block of the flat tensor;
        ``len == ceil(numel / block_size)`` and the counts sum to ``len(positions)``.

    Construction checks shapes, dtypes and the count sum (O(number of blocks)); ordering of
    ``positions`` is the producer's contract (``bit_equal`` compares exactly).
    """

    positions: np.ndarray
    xor_values: np.ndarray
    block_counts: np.ndarray
    block_size: int
    numel: int

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.numel < 0:
            raise ValidationError(f"block_size {self.block_size} / numel {self.numel} out of range")
        pos, val, cnt = self.positions, self.xor_values, self.block_counts
        if pos.ndim != 1 or pos.dtype != np.int64:
            raise ValidationError(f"positions must be 1-D int64, got {pos.dtype}{pos.shape}")
        if val.ndim != 1 or val.dtype not in _UNSIGNED or val.shape != pos.shape:
            raise ValidationError(
                f"xor_values must be 1-D unsigned like positions {pos.shape}, got {val.dtype}{val.shape}"
            )
        nblocks = -(-self.numel // self.block_size)
        if cnt.dtype != np.int64 or cnt.shape != (nblocks,):
            raise ValidationError(f"block_counts must be int64[{nblocks}], got {cnt.dtype}{cnt.shape}")
        if int(cnt.sum()) != pos.size:
            raise ValidationError(f"block_counts sum to {int(cnt.sum())}, positions has {pos.size}")

    @property
    def num_changed(self) -> int:
        return int(self.positions.size)

    def bit_equal(self, other: XorDiff) -> bool:
        """Exact equality: same geometry, value dtype, positions, XOR bits and counts."""
        return (
            self.numel == other.numel
            and self.block_size == other.block_size
            and self.xor_values.dtype == other.xor_values.dtype
            and np.array_equal(self.positions, other.positions)
            and np.array_equal(self.xor_values, other.xor_values)
            and np.array_equal(self.block_counts, other.block_counts)
        )


@dataclass(frozen=True, eq=False)
class DiffBuffers:
    """Caller-owned output storage for ``xor_diff_into``, reused from step to step.

    The ``XorDiff`` that ``xor_diff_into`` returns holds views of these arrays: the next
    call into the same buffers overwrites it.  ``allocate(..., pin_memory=True)`` backs them
    with page-locked torch storage, so a CUDA diff lands in them by DMA.
    """

    positions: np.ndarray
    xor_values: np.ndarray

    def __post_init__(self) -> None:
        pos, val = self.positions, self.xor_values
        if pos.ndim != 1 or pos.dtype != np.int64 or not pos.flags.c_contiguous:
            raise ValidationError(f"positions must be contiguous 1-D int64, got {pos.dtype}{pos.shape}")
        if val.ndim != 1 or val.dtype not in _UNSIGNED or not val.flags.c_contiguous:
            raise ValidationError(f"xor_values must be contiguous 1-D unsigned, got {val.dtype}{val.shape}")
        if val.shape != pos.shape:
            raise ValidationError(f"positions {pos.shape} and xor_values {val.shape} differ in length")
        if not (pos.flags.writeable and val.flags.writeable):
            raise ValidationError("DiffBuffers must be writable")

    @classmethod
    def allocate(cls, capacity: int, element_size: int, *, pin_memory: bool = False) -> DiffBuffers:
        if capacity < 0 or element_size not in dtypes.WIDTHS:
            raise ValidationError(f"capacity {capacity} / element_size {element_size} out of range")
        pos = torch.empty(capacity, dtype=torch.int64, pin_memory=pin_memory)
        val = torch.empty(capacity, dtype=dtypes.torch_int_of_width(element_size), pin_memory=pin_memory)
        return cls(pos.numpy(), val.numpy().view(dtypes.bits_of_width(element_size)))

    @property
    def capacity(self) -> int:
        return int(self.positions.size)


def bits_view_np(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view (no copy) of a contiguous CPU tensor's bits."""
    if t.device.type != "cpu":
        raise ValidationError("bits_view_np needs a CPU tensor")
    if not t.is_contiguous():
        raise ValidationError("bits_view_np needs a contiguous tensor")
    width = t.element_size()
    if width not in dtypes.WIDTHS:
        raise ValidationError(f"no bit view for {t.dtype} ({width}-byte elements)")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=dtypes.bits_of_width(width))
    return dtypes.int_view(dtypes.int_view(flat).numpy())


def check_pair(current: torch.Tensor, baseline: torch.Tensor, block_size: int) -> None:
    """The argument contract shared by every implementation."""
    if current.dtype != baseline.dtype or current.shape != baseline.shape:
        raise ValidationError(
            f"xor_diff: current {current.dtype}{tuple(current.shape)} vs baseline "
            f"{baseline.dtype}{tuple(baseline.shape)}"
        )
    if current.element_size() not in dtypes.WIDTHS:
        raise ValidationError(f"xor_diff: unsupported element size {current.element_size()} ({current.dtype})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 1 << 62:
        raise ValidationError(f"xor_diff: block_size must be an int in [1, 2**62], got {block_size!r}")
