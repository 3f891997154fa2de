"""Run by test_xor_diff_triton_single_pass.py in a child process with TRITON_INTERPRET=1.

Checks the single-pass (decoupled look-back) kernel of ``nemo_dcr.kernels.triton_xor``,
run by the interpreter on CPU tensors, bit for bit against the C path, the numpy reference
and the two-pass kernels, in both probe forms (``tl.atomic_load`` and the RMW stand-in of
older Triton); the overflow completion at several capacities; the look-back step on its own
on hand-made status words (the interpreter runs programs in order, so the kernel itself never
meets a NOT_READY or AGGREGATE predecessor there); and that the interpreter does run programs
in program-id order.  Every equality has a perturbed negative control.  Prints one JSON line:
a list of {"check", "ok", ...} records.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton_interp_cases import CASES, pair  # noqa: E402

import nemo_dcr.kernels.triton_xor as tx  # noqa: E402
from nemo_dcr import dtypes  # noqa: E402
from nemo_dcr.kernels import DiffBuffers, XorDiff, xor_diff_reference  # noqa: E402
from nemo_dcr.kernels.cpu import xor_diff_c  # noqa: E402


def same_device(x: tx.DeviceXorDiff, y: tx.DeviceXorDiff) -> bool:
    """Exact equality of two device results: dtypes first, then integer contents."""
    return all(
        p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)
        for p, q in ((x.positions, y.positions), (x.xor_values, y.xor_values), (x.block_counts, y.block_counts))
    )


def flipped(d: XorDiff, i: int) -> XorDiff:
    """``d`` with one bit of its i-th XOR value flipped (a negative control)."""
    vals = d.xor_values.copy()
    vals[i] ^= 1
    return XorDiff(d.positions, vals, d.block_counts, d.block_size, d.numel)


def check_cases(atomic_load: bool) -> list[dict]:
    tx.HAS_ATOMIC_LOAD = atomic_load
    out = []
    for k, (dtype, n, rate, block_size, tile) in enumerate(CASES):
        cur, base = pair(dtype, n, rate, seed=k)
        want = xor_diff_reference(cur, base, block_size=block_size)
        one = tx.xor_diff_device(cur, base, block_size=block_size, tile=tile, impl="single_pass")
        two = tx.xor_diff_device(cur, base, block_size=block_size, tile=tile, impl="two_pass")
        got = one.to_host()
        ok = got.bit_equal(want) and got.bit_equal(xor_diff_c(cur, base, block_size=block_size))
        ok = ok and same_device(one, two) and one.block_counts.dtype == torch.int64
        buf = DiffBuffers.allocate(want.num_changed + 3, cur.element_size())
        into = tx.xor_diff_into_triton(cur, base, buf, block_size=block_size, impl="single_pass")
        ok = ok and into.bit_equal(want)
        neg = True
        if want.num_changed:
            # negative controls: one flipped bit in the expected output, and one flipped bit
            # in the input, must each be detected
            neg = not got.bit_equal(flipped(want, want.num_changed // 2))
            bits = dtypes.int_view(cur.clone())
            bits[int(want.positions[0])] ^= 1
            perturbed = tx.xor_diff_device(bits.view(dtype), base, block_size=block_size, tile=tile,
                                           impl="single_pass").to_host()
            neg = neg and not perturbed.bit_equal(want)
        out.append({"check": "case", "atomic_load": atomic_load, "case": k, "dtype": str(dtype), "numel": n,
                    "changed": want.num_changed, "ok": bool(ok), "negative_control_detected": bool(neg)})
    return out


def check_capacities() -> list[dict]:
    """Capacities below, at and above the total: the overflow completion must be exact."""
    out = []
    for dtype, n, rate, block_size, tile in [(torch.bfloat16, 20_000, 0.05, 4096, 256),
                                              (torch.float16, 5_000, 0.2, 1000, None),
                                              (torch.bfloat16, 3_000, 1.0, 512, None)]:
        cur, base = pair(dtype, n, rate, seed=99)
        want = xor_diff_reference(cur, base, block_size=block_size)
        k = want.num_changed
        for cap in sorted({0, 1, k // 3, k - 1, k, k + 1, n}):
            got = tx.xor_diff_device(cur, base, block_size=block_size, tile=tile, impl="single_pass",
                                     capacity=max(cap, 0))
            host = got.to_host()
            ok = host.bit_equal(want) and got.positions.dtype == torch.int64
            neg = not host.bit_equal(flipped(want, k - 1))
            out.append({"check": "capacity", "numel": n, "changed": k, "capacity": cap, "ok": bool(ok),
                        "negative_control_detected": bool(neg)})
    return out


@triton.jit
def _step_kernel(status_ptr, hi_ptr, excl_ptr, out_ptr, WINDOW: tl.constexpr, ATOMIC_LOAD: tl.constexpr):
    hi, excl = tx._look_back_step(status_ptr, tl.load(hi_ptr), tl.load(excl_ptr), WINDOW, ATOMIC_LOAD)
    tl.store(out_ptr, hi)
    tl.store(out_ptr + 1, excl)


def step(status: torch.Tensor, hi: int, excl: int, window: int, atomic_load: bool) -> tuple[int, int]:
    res = torch.zeros(2, dtype=torch.int64)
    _step_kernel[(1,)](status, torch.tensor([hi]), torch.tensor([excl]), res, WINDOW=window, ATOMIC_LOAD=atomic_load)
    return int(res[0]), int(res[1])


def model_step(status: np.ndarray, hi: int, excl: int, window: int) -> tuple[int, int]:
    """The look-back step written as a plain loop (what the kernel's vector form must equal)."""
    for lane in range(window):
        j = hi - lane
        word = int(status[j]) if j >= 0 else tx.INCLUSIVE
        flag, value = word & 3, word >> 2
        if flag == tx.NOT_READY:
            return j, excl
        excl += value
        if flag == tx.INCLUSIVE:
            return -1, excl
    return hi - window, excl


def check_look_back(window: int, atomic_load: bool, walks: int, seed: int) -> dict:
    """Random predecessors in every state; a walk that meets NOT_READY makes that word ready
    (as its owner eventually would) and steps again.  Each step must match the loop model and
    each walk must end at the true exclusive prefix.  Negative control: a status word with a
    wrong INCLUSIVE value gives a wrong prefix."""
    rng = np.random.default_rng(seed)
    ok, steps, not_ready_seen, aggregate_runs = True, 0, 0, 0
    for _ in range(walks):
        ntiles = int(rng.integers(1, 3 * window + 2))
        counts = rng.integers(0, 5000, ntiles)
        inclusive = np.cumsum(counts)
        tile = ntiles - 1
        # mixed states, or long AGGREGATE runs (whole windows summed, walks reaching tile 0)
        p_ready, p_inclusive = [(0.85, 0.2), (1.0, 0.02), (0.95, 0.0)][int(rng.integers(3))]
        p = [1 - p_ready, p_ready - p_inclusive, p_inclusive]
        flags = rng.choice([tx.NOT_READY, tx.AGGREGATE, tx.INCLUSIVE], size=ntiles, p=p)
        value = np.where(flags == tx.INCLUSIVE, inclusive, counts)
        status = torch.from_numpy((value << 2 | flags).astype(np.int64))
        hi, excl = tile - 1, 0
        while hi >= 0:
            want = model_step(status.numpy(), hi, excl, window)
            got = step(status, hi, excl, window, atomic_load)
            steps += 1
            ok = ok and got == want
            aggregate_runs += got[0] == hi - window
            if got[0] >= 0 and got[0] != hi - window:  # stopped at a NOT_READY word: make it ready
                j = got[0]
                not_ready_seen += 1
                ready = tx.INCLUSIVE if rng.random() < 0.5 else tx.AGGREGATE
                status[j] = (int(inclusive[j] if ready == tx.INCLUSIVE else counts[j]) << 2) | ready
            hi, excl = got
        ok = ok and excl == int(inclusive[tile] - counts[tile])
    # negative control: an INCLUSIVE predecessor carrying a value one too large is not hidden
    status = torch.tensor([(5 << 2) | tx.INCLUSIVE, (7 << 2) | tx.AGGREGATE], dtype=torch.int64)
    bad = torch.tensor([(6 << 2) | tx.INCLUSIVE, (7 << 2) | tx.AGGREGATE], dtype=torch.int64)
    neg = step(status, 1, 0, window, atomic_load) == (-1, 12) and step(bad, 1, 0, window, atomic_load) != (-1, 12)
    return {"check": "look_back", "window": window, "atomic_load": atomic_load, "steps": steps,
            "not_ready_seen": not_ready_seen, "aggregate_windows": aggregate_runs, "ok": bool(ok),
            "negative_control_detected": bool(neg)}


@triton.jit
def _order_kernel(ticket_ptr, out_ptr):
    t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    tl.store(out_ptr + tl.program_id(0), t)


def check_interpreter_order() -> dict:
    """The interpreter runs programs one by one in program-id order: ticket == program id."""
    tickets = torch.zeros(1, dtype=torch.int64)
    seen = torch.full((64,), -1, dtype=torch.int64)
    _order_kernel[(64,)](tickets, seen)
    return {"check": "interpreter_order", "ok": bool(torch.equal(seen, torch.arange(64))),
            "negative_control_detected": True}


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    print(f"{fn.__name__}{args}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main() -> int:
    has_atomic_load = tx.HAS_ATOMIC_LOAD
    forms = (True, False) if has_atomic_load else (False,)  # both where Triton has atomic_load
    results = [timed(check_interpreter_order)]
    for atomic_load in forms:
        results += timed(check_cases, atomic_load)
    tx.HAS_ATOMIC_LOAD = has_atomic_load
    results += timed(check_capacities)
    results.append(timed(check_look_back, 4, forms[0], walks=150, seed=1))
    results.append(timed(check_look_back, 32, forms[0], walks=80, seed=2))
    results.append(timed(check_look_back, 4, False, walks=60, seed=3))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
