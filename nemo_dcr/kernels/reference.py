"""Plain numpy XOR diff: the definition every fast path is tested against."""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.kernels.types import XorDiff, bits_view_np, check_pair


def xor_diff_reference(current: torch.Tensor, baseline: torch.Tensor, *, block_size: int = 1 << 16) -> XorDiff:
    """XOR over the whole tensor, then ``flatnonzero`` (two passes, an O(n) temporary)."""
    check_pair(current, baseline, block_size)
    a = bits_view_np(current.detach().contiguous().cpu())
    b = bits_view_np(baseline.detach().contiguous().cpu())
    x = np.bitwise_xor(a, b)
    pos = np.flatnonzero(x).astype(np.int64, copy=False)
    nblocks = -(-a.size // block_size)
    counts = np.bincount(pos // block_size, minlength=nblocks).astype(np.int64)
    return XorDiff(pos, x[pos], counts, block_size, int(a.size))
