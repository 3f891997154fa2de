#!/usr/bin/env python
"""CPU XOR diff throughput: numpy reference vs the C passes, by change rate and thread count.

Throughput is parameter bytes per second (numel * 2 for BF16: the size of the tensor being
diffed, not counting the baseline it is read against).  The methods of one change rate are
timed in interleaved rounds and each reports the best of --repeats rounds (the machine is
shared; the median is printed too).  Every C result is checked bit for bit against the
reference before it is timed.

    .venv/bin/python scripts/bench_xor.py                  # 256 MiB BF16, 0 / 0.5 / 3 / 10 / 100 %
    .venv/bin/python scripts/bench_xor.py --mib 64 --repeats 3

Writes benchmarks/results/bench_xor.json and bench_xor.png (--replot: only redraw the PNG
from the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from nemo_dcr.kernels import DiffBuffers, _cxor, xor_diff_reference
from nemo_dcr.kernels.cpu import block_counts_c, xor_diff_c, xor_diff_into_c

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def make_pair(numel: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 weights and a copy in which a fraction ``rate`` of elements, at i.i.d. positions,
    moved by one or two ulps (what a small optimizer step does to a stored BF16 value)."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
    cur = base.clone()
    bits = cur.view(torch.int16)
    if rate >= 1.0:
        idx = torch.arange(numel)
    else:
        idx = torch.nonzero(torch.rand(numel, generator=g) < rate).squeeze(1)
    step = torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
    bits[idx] = bits[idx] + step
    return cur, base


def timed_rounds(methods: dict, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, fn in methods.items():
        fn()  # warm-up: first-call allocations and the C scratch are not what is measured
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="BF16 tensor size in MiB")
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.005, 0.03, 0.10, 1.0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-size", type=int, default=1 << 16)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    args = p.parse_args()
    if args.replot:
        saved = json.loads((args.out / "bench_xor.json").read_text())
        plot(saved["rows"], args.out / "bench_xor.png", saved["meta"])
        return 0

    numel = args.mib * (1 << 20) // 2
    nbytes = numel * 2
    bs = args.block_size
    rows = []
    header = f"{'changed':>8} {'method':<40} {'best GB/s':>10} {'median GB/s':>12}"
    print(f"BF16 tensor: {args.mib} MiB ({numel} elements), block_size {bs}, C loop: {_cxor.simd()}, "
          f"cpus: {os.cpu_count()}, load avg at start: {os.getloadavg()[0]:.2f}")
    print(header)
    print("-" * len(header))
    for rate in args.rates:
        cur, base = make_pair(numel, rate, seed=0)
        ref = xor_diff_reference(cur, base, block_size=bs)
        a, b = cur.view(torch.int16).numpy(), base.view(torch.int16).numpy()
        out = DiffBuffers.allocate(ref.num_changed, 2)
        methods = {
            "numpy XOR only (no compaction)": lambda: np.bitwise_xor(a, b),
            "numpy reference (xor+flatnonzero)": lambda: xor_diff_reference(cur, base, block_size=bs),
        }
        for nt in args.threads:
            assert xor_diff_c(cur, base, block_size=bs, num_threads=nt).bit_equal(ref)
            counts = block_counts_c(cur, base, block_size=bs, num_threads=nt)
            assert xor_diff_into_c(cur, base, out, block_size=bs, num_threads=nt, block_counts=counts).bit_equal(ref)
            methods[f"C xor_diff, {nt} thr"] = lambda nt=nt: xor_diff_c(cur, base, block_size=bs, num_threads=nt)
            methods[f"C xor_diff_into, reused buf, {nt} thr"] = lambda nt=nt: xor_diff_into_c(
                cur, base, out, block_size=bs, num_threads=nt
            )
            methods[f"C count pass only, {nt} thr"] = lambda nt=nt: block_counts_c(
                cur, base, block_size=bs, num_threads=nt
            )
            methods[f"C fill pass only (given counts), {nt} thr"] = lambda nt=nt, c=counts: xor_diff_into_c(
                cur, base, out, block_size=bs, num_threads=nt, block_counts=c
            )
        times = timed_rounds(methods, args.repeats)
        for name in methods:
            best, med = min(times[name]), statistics.median(times[name])
            row = {"rate": rate, "changed": ref.num_changed, "method": name, "best_s": best, "median_s": med,
                   "best_gbps": nbytes / best / 1e9, "median_gbps": nbytes / med / 1e9}
            rows.append(row)
            print(f"{rate * 100:7.1f}% {name:<40} {row['best_gbps']:10.2f} {row['median_gbps']:12.2f}")
        del cur, base, ref, out, a, b

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load avg at end: {os.getloadavg()[0]:.2f}")
    meta = {"load_avg_end": os.getloadavg()[0], "mib": args.mib, "numel": numel, "block_size": bs, "repeats": args.repeats, "simd": _cxor.simd(),
            "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads()}
    (args.out / "bench_xor.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "bench_xor.png", meta)
    print(f"wrote {args.out / 'bench_xor.json'} and bench_xor.png")
    return 0


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 5))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = {r["rate"]: r["best_gbps"] for r in rows if r["method"] == name}
        style = "--" if "only" in name else "-"
        ax.plot(range(len(rates)), [pts[x] for x in rates], style, marker="o", label=name)
    ax.axhline(4.0, color="black", linestyle=":", linewidth=1, label="target 4 GB/s")
    ax.set_xticks(range(len(rates)), [f"{x * 100:g}%" for x in rates])
    ax.set_yscale("log")
    ax.set_xlabel("elements changed")
    ax.set_ylabel("GB/s of BF16 parameters (best round, log scale)")
    ax.set_title(f"xor_diff on CPU, {meta['mib']} MiB BF16, {meta['cpus']} cores, C loop {meta['simd']}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
