"""XOR diff kernels: which elements of a tensor changed against its committed baseline.

Entry points (all give results bit-identical to ``xor_diff_reference``; tests check it):

``xor_diff(current, baseline, *, block_size=65536) -> XorDiff``
    Allocating form.  Positions (sorted int64 flat indices), XOR values (unsigned, element
    width) and per-block counts, as host numpy arrays.
``xor_block_counts(current, baseline, *, block_size=65536) -> np.ndarray``
    Counting pass only: reads both tensors, writes nothing but one int64 per block.  Lets
    the caller decide before any output exists: a tensor whose delta would be larger than
    its dense bytes goes dense, and the fill can be sized exactly.
``xor_diff_into(current, baseline, out: DiffBuffers, *, block_counts=None, ...) -> XorDiff``
    Non-allocating form for the trainer hook: writes into caller-owned, reusable (pinned)
    buffers and returns views of them.  Given the counts from ``xor_block_counts`` it skips
    the count pass, and blocks whose count is zero are never read again (block skipping).
    Buffers too small -> ``DiffCapacityError`` (carries the counts, to retry without
    recounting); counts that do not match the tensors -> ``StaleCountsError``.

Dispatch: CPU tensors go to the C passes (``cpu.py``, ``csrc/xor_diff.c``), CUDA tensors
to the Triton kernels (``triton_xor.py``).  With one operand on CUDA and the other on the
CPU (a pinned host baseline) the CPU operand is copied to the device first: numel * w bytes
over PCIe, which the caller avoids by keeping the baseline where the parameter lives.

Hot path, for n elements of w bytes of which k changed, B blocks (CPU; the GPU form is in
``triton_xor.py``):
  xor_diff, xor_diff_into without counts: ONE pass.  Each thread scans its blocks (fused
      XOR + compaction) into a private scratch kept between calls, then copies its piece to
      its offset in the exact output.  Reads 2nw, writes k(8 + w) twice.  O(n + k).  The
      scratch is capped (128 MiB per thread, ``cpu.release_scratch()`` frees it); blocks
      past the cap are only counted in the pass and filled in place afterwards.
  xor_block_counts: reads 2nw, writes 8B.  O(n), branch-light word/SIMD scan.
  xor_diff_into with counts (the second of two passes): reads 2w per element of non-empty
      blocks only, writes k(8 + w) in place.
  No O(n) temporary anywhere (the numpy reference writes an n*w XOR array and reads it
  again); only a non-contiguous input is first copied to a contiguous one.  Blocks go to
  threads (CPU) or tiles (GPU) with no atomics deciding any output order, so the output is
  deterministic.
Measured throughput: docs/benchmarks.md, "Diff kernel".
"""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.kernels.reference import xor_diff_reference
from nemo_dcr.kernels.types import (
    DiffBuffers,
    DiffCapacityError,
    StaleCountsError,
    XorDiff,
    bits_view_np,
    check_pair,
)

__all__ = [
    "DiffBuffers",
    "DiffCapacityError",
    "StaleCountsError",
    "XorDiff",
    "bits_view_np",
    "xor_block_counts",
    "xor_diff",
    "xor_diff_into",
    "xor_diff_reference",
]


def _placed(current: torch.Tensor, baseline: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Both operands on one device; True when that device is CUDA."""
    cur_cuda, base_cuda = current.device.type == "cuda", baseline.device.type == "cuda"
    if cur_cuda and not base_cuda:
        baseline = baseline.to(current.device, non_blocking=True)
    elif base_cuda and not cur_cuda:
        current = current.to(baseline.device, non_blocking=True)
    elif not cur_cuda and current.device != baseline.device:
        raise ValidationError(f"xor_diff: unsupported devices {current.device} / {baseline.device}")
    if (cur_cuda or base_cuda) and current.device != baseline.device:
        raise ValidationError(f"xor_diff: current on {current.device}, baseline on {baseline.device}")
    return current, baseline, cur_cuda or base_cuda


def xor_diff(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> XorDiff:
    check_pair(current, baseline, block_size)
    current, baseline, on_cuda = _placed(current, baseline)
    if on_cuda:
        from nemo_dcr.kernels.triton_xor import xor_diff_triton

        return xor_diff_triton(current, baseline, block_size=block_size)
    from nemo_dcr.kernels.cpu import xor_diff_c

    return xor_diff_c(current, baseline, block_size=block_size)


def xor_block_counts(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> np.ndarray:
    check_pair(current, baseline, block_size)
    current, baseline, on_cuda = _placed(current, baseline)
    if on_cuda:
        from nemo_dcr.kernels.triton_xor import block_counts_triton

        return block_counts_triton(current, baseline, block_size=block_size)
    from nemo_dcr.kernels.cpu import block_counts_c

    return block_counts_c(current, baseline, block_size=block_size)


def xor_diff_into(
    current: torch.Tensor,
    baseline: torch.Tensor,
    out: DiffBuffers,
    *,
    block_size: int = 1 << 16,
    block_counts: np.ndarray | None = None,
) -> XorDiff:
    check_pair(current, baseline, block_size)
    current, baseline, on_cuda = _placed(current, baseline)
    if on_cuda:
        from nemo_dcr.kernels.triton_xor import xor_diff_into_triton

        return xor_diff_into_triton(current, baseline, out, block_size=block_size, block_counts=block_counts)
    from nemo_dcr.kernels.cpu import xor_diff_into_c

    return xor_diff_into_c(current, baseline, out, block_size=block_size, block_counts=block_counts)
