"""Run by test_xor_diff_triton.py in a child process with TRITON_INTERPRET=1 (the variable
must be set before triton is imported).  Compares the Triton kernels, run by the
interpreter on CPU tensors, with the C path and the reference; prints one JSON line."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from nemo_dcr.kernels import DiffBuffers, XorDiff, xor_diff_reference  # noqa: E402
from nemo_dcr.kernels.cpu import xor_diff_c  # noqa: E402
from nemo_dcr.kernels.triton_xor import (  # noqa: E402
    block_counts_triton,
    xor_diff_device,
    xor_diff_into_triton,
    xor_diff_triton,
)


def pair(dtype: torch.dtype, n: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    if n == 0:
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    base = raw.reshape(n, width).copy()
    idx = np.flatnonzero(rng.random(n) < rate)
    base[idx, rng.integers(0, width, idx.size)] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype), torch.from_numpy(base.reshape(-1)).view(dtype)


#: (dtype, numel, change rate, block_size, tile override); also used by triton_single_pass_cases.py
CASES = [
    (torch.bfloat16, 0, 0.1, 1024, None),
    (torch.bfloat16, 1, 1.0, 1024, None),
    (torch.bfloat16, 20_000, 0.03, 4096, None),  # tile 4096, several tiles, ragged end
    (torch.bfloat16, 9_000, 0.0, 2048, None),  # nothing changed: the fill kernel never runs
    (torch.bfloat16, 3_000, 1.0, 512, None),
    (torch.float16, 5_000, 0.2, 1000, None),  # 1000 is no multiple of a tile: bincount route
    (torch.float32, 7_777, 0.05, 256, None),
    (torch.float32, 7_777, 0.05, 1 << 16, 128),  # explicit small tile, many tiles per block
    (torch.uint8, 6_001, 0.1, 384, None),
    (torch.float8_e4m3fn, 6_001, 0.5, 1 << 16, None),
    (torch.int64, 4_099, 0.3, 4096, None),
    (torch.float64, 1_000, 0.05, 128, None),
]


def main() -> int:
    results = []
    for k, (dtype, n, rate, block_size, tile) in enumerate(CASES):
        cur, base = pair(dtype, n, rate, seed=k)
        want = xor_diff_reference(cur, base, block_size=block_size)
        if tile is None:
            got = xor_diff_triton(cur, base, block_size=block_size)
        else:
            got = xor_diff_device(cur, base, block_size=block_size, tile=tile).to_host()
        ok = got.bit_equal(want) and got.bit_equal(xor_diff_c(cur, base, block_size=block_size))
        ok = ok and np.array_equal(block_counts_triton(cur, base, block_size=block_size), want.block_counts)
        out = DiffBuffers.allocate(want.num_changed + 5, cur.element_size())
        ok = ok and xor_diff_into_triton(cur, base, out, block_size=block_size).bit_equal(want)
        # negative control on the same comparison: one position dropped must not compare equal
        if want.num_changed:
            counts = got.block_counts.copy()
            counts[int(got.positions[0]) // block_size] -= 1
            dropped = XorDiff(got.positions[1:], got.xor_values[1:], counts, block_size, got.numel)
            ok = ok and not dropped.bit_equal(want)
        results.append({"case": k, "dtype": str(dtype), "numel": n, "changed": want.num_changed, "ok": bool(ok)})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
