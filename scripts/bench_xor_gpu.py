#!/usr/bin/env python
"""GPU XOR diff throughput: the two Triton implementations of nemo_dcr.kernels.triton_xor
side by side on one CUDA device.

For BF16 tensors of several sizes and change rates, and several tile sizes, it times with
CUDA events (median of --repeats after warm-up):

  count        the count kernel alone (reads both tensors once: the streaming ceiling),
  two_pass     xor_diff_device(impl="two_pass"): count, cumsum, one scalar sync, exact
               allocation, fill (skips empty tiles), block counts -- results on the device,
  single_pass  xor_diff_device(impl="single_pass"): one decoupled look-back kernel (reads the
               tensors once) into default_capacity(numel) slots, one scalar sync; above the
               capacity (> ~12.5 % changed) the overflow fill completes it ("overflow" column),
  torch        the plain torch formulation (x = a ^ b; nonzero; gather) for comparison,
  to_host      copying the compact results to host memory (smallest size only; not in the
               diff times).

It reports parameter throughput (numel * 2 bytes / time, the number that matters to a refit)
and achieved memory bandwidth (bytes the implementation must move / time) as a percentage of
--peak-tbps (H200 HBM3e: 4.8 TB/s).  Bytes moved, n elements of w bytes, k changed, t tiles:
  two_pass     2nw + 2w * elements of non-empty tiles + k(8 + w) + 12t
  single_pass  2nw + k(8 + w) + 16t, plus on overflow 2w * elements of the non-empty tiles
               past the capacity (re-read by the fill) + 2 * capacity * (8 + w) (prefix copy)
Before timing, every configuration is checked bit for bit: both implementations against each
other and against a torch-on-device formulation at every size, and against the CPU C path on
the whole tensor at the smallest size and on a --window-element subsample (a random window
of the flat tensor) at the others.

    python scripts/bench_xor_gpu.py                   # 0.25, 1, 4 GiB; 0..100 %; tiles 1-4K
    python scripts/bench_xor_gpu.py --gib 1 --repeats 10 --out /tmp/x
    python scripts/bench_xor_gpu.py --interpret     # no GPU: exercise this script on tiny CPU
                                                    # tensors through the Triton interpreter
                                                    # (times are meaningless there)

Without a CUDA device (and without --interpret) it exits with status 2 and measures nothing.
Writes <out>/bench_xor_gpu.json and bench_xor_gpu.png (default out: benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
IMPLS = ("two_pass", "single_pass")

DEVICE = "cuda"


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `repeats` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":  # --interpret: wall clock, only to exercise the script
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_pair(numel: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 weights and a copy with a fraction `rate` of elements (i.i.d.) moved by 1-2 ulps."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    base = (torch.randn(numel, generator=g, device=DEVICE) * 0.02).to(torch.bfloat16)
    cur = base.clone()
    if rate > 0:
        bits = cur.view(torch.int16)
        step = torch.randint(1, 3, (numel,), generator=g, device=DEVICE, dtype=torch.int16)
        if rate < 1:
            step = step * (torch.rand(numel, generator=g, device=DEVICE) < rate)
        bits.add_(step)
    return cur, base


def torch_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = a.view(torch.int16) ^ b.view(torch.int16)
    pos = torch.nonzero(x).squeeze(1)
    return pos, x[pos]


def same(x, y) -> bool:
    """Exact equality of two DeviceXorDiff: dtypes, shapes, integer contents."""
    return all(
        p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)
        for p, q in ((x.positions, y.positions), (x.xor_values, y.xor_values), (x.block_counts, y.block_counts))
    )


def check_window(d, cur: torch.Tensor, base: torch.Tensor, start: int, length: int, block_size: int) -> None:
    """The device result restricted to [start, start + length) equals the CPU C path there."""
    import numpy as np

    from nemo_dcr.kernels.cpu import xor_diff_c

    host = xor_diff_c(cur[start:start + length].cpu(), base[start:start + length].cpu(), block_size=block_size)
    lo, hi = (int(torch.searchsorted(d.positions, v)) for v in (start, start + length))
    pos = d.positions[lo:hi].cpu().numpy() - start
    val = d.xor_values[lo:hi].cpu().numpy().view(np.uint16)
    assert np.array_equal(pos, host.positions) and np.array_equal(val, host.xor_values), \
        f"GPU and CPU paths differ in [{start}, {start + length})"


def bytes_moved(impl: str, numel: int, k: int, tile_counts: torch.Tensor, tile: int, capacity: int) -> tuple[int, bool]:
    """Bytes the implementation must move (module docstring) and whether the single pass overflowed."""
    w, t = 2, tile_counts.numel()
    busy = tile_counts > 0
    if impl == "two_pass":
        return 2 * numel * w + 2 * w * min(numel, int(busy.sum()) * tile) + k * (8 + w) + 12 * t, False
    moved = 2 * numel * w + k * (8 + w) + 16 * t
    if k <= capacity:
        return moved, False
    inclusive = torch.cumsum(tile_counts.to(torch.int64), 0)
    refill = int((busy & (inclusive > capacity)).sum())
    return moved + 2 * w * min(numel, refill * tile) + 2 * capacity * (8 + w), True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="BF16 tensor sizes in GiB")
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.005, 0.03, 0.10, 1.0])
    p.add_argument("--tiles", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--block-size", type=int, default=1 << 16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--window", type=int, default=1 << 22, help="elements of the CPU subsample check")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8 TB/s)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--interpret", action="store_true",
                   help="no GPU: tiny CPU tensors through TRITON_INTERPRET=1, results under /tmp")
    args = p.parse_args()
    global DEVICE
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported below
        DEVICE = "cpu"
        args.gib, args.tiles, args.repeats, args.window = [2.0**-16, 2.0**-14], [1024, 4096], 2, 1000
        args.out = Path("/tmp/bench_xor_gpu_interpret")
    elif not torch.cuda.is_available():
        print("bench_xor_gpu: FAILED: no CUDA device; nothing measured (see --interpret)", file=sys.stderr)
        return 2

    import triton

    from nemo_dcr.kernels import triton_xor
    from nemo_dcr.kernels.cpu import xor_diff_c
    from nemo_dcr.kernels.triton_xor import _flat_bits, _tile_counts, default_capacity, xor_diff_device

    peak = args.peak_tbps * 1e12
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    probe = "tl.atomic_load/atomic_store" if triton_xor.HAS_ATOMIC_LOAD else "RMW stand-ins (atomic_add 0 / atomic_xchg)"
    print(f"device: {dev}; triton {triton.__version__}; torch {torch.__version__}; peak assumed "
          f"{args.peak_tbps} TB/s; block_size {args.block_size}; single-pass look-back probes: {probe}")
    header = (f"{'GiB':>5} {'changed':>8} {'tile':>5} {'impl':>11} {'ms':>8} {'param GB/s':>11} "
              f"{'moved GB/s':>11} {'%peak':>6} {'overflow':>8} | {'count %peak':>11} {'torch ms':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    smallest = min(args.gib)
    for gib in args.gib:
        numel = int(gib * (1 << 30)) // 2
        for rate in args.rates:
            cur, base = make_pair(numel, rate, seed=0)
            ref_pos, ref_val = torch_diff(cur, base)
            k = ref_pos.numel()
            a, b = _flat_bits(cur), _flat_bits(base)
            t_torch = cuda_time(lambda: torch_diff(cur, base), args.repeats)
            host = xor_diff_c(cur.cpu(), base.cpu(), block_size=args.block_size) if gib == smallest else None
            capacity = default_capacity(numel)
            for tile in args.tiles:
                results = {impl: xor_diff_device(cur, base, block_size=args.block_size, tile=tile, impl=impl)
                           for impl in args.impls}
                for impl, d in results.items():
                    assert torch.equal(d.positions, ref_pos) and torch.equal(d.xor_values, ref_val), \
                        f"{impl}: mismatch with torch"
                    assert int(d.block_counts.sum()) == k, f"{impl}: block counts"
                    if host is not None:
                        assert d.to_host().bit_equal(host), f"{impl}: GPU and CPU paths differ"
                    else:
                        length = min(args.window, numel)
                        start = random.Random(f"{gib}/{rate}/{tile}").randrange(numel - length + 1)
                        check_window(d, cur, base, start, length, args.block_size)
                if len(results) == 2:
                    assert same(*results.values()), "two_pass and single_pass differ"
                tile_counts = _tile_counts(a, b, tile)
                t_count = cuda_time(lambda: _tile_counts(a, b, tile), args.repeats)
                t_host = (cuda_time(lambda: next(iter(results.values())).to_host(), max(3, args.repeats // 4), warmup=1)
                          if gib == smallest else None)
                del results
                for impl in args.impls:
                    t = cuda_time(lambda: xor_diff_device(cur, base, block_size=args.block_size, tile=tile,
                                                          impl=impl), args.repeats)
                    moved, overflow = bytes_moved(impl, numel, k, tile_counts, tile, capacity)
                    row = {
                        "gib": gib, "numel": numel, "rate": rate, "changed": k, "tile": tile, "impl": impl,
                        "diff_s": t, "param_gbps": 2 * numel / t / 1e9, "moved_bytes": moved,
                        "moved_gbps": moved / t / 1e9, "moved_bw_pct": 100 * moved / t / peak,
                        "overflow": overflow, "capacity": capacity if impl == "single_pass" else None,
                        "count_s": t_count, "count_bw_pct": 100 * 4 * numel / t_count / peak,
                        "torch_s": t_torch, "to_host_s": t_host,
                    }
                    rows.append(row)
                    print(f"{gib:5.2f} {rate * 100:7.1f}% {tile:5d} {impl:>11} {t * 1e3:8.3f} "
                          f"{row['param_gbps']:11.0f} {row['moved_gbps']:11.0f} {row['moved_bw_pct']:6.1f} "
                          f"{'yes' if overflow else '':>8} | {row['count_bw_pct']:11.1f} {t_torch * 1e3:9.3f}")
            del cur, base, ref_pos, ref_val, a, b, host
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    summarize(rows, args.impls)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev, "peak_tbps": args.peak_tbps, "block_size": args.block_size, "repeats": args.repeats,
            "torch": torch.__version__, "triton": triton.__version__, "look_back_probes": probe,
            "impls": list(args.impls), "interpret": bool(args.interpret)}
    (args.out / "bench_xor_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "bench_xor_gpu.png", meta)
    print(f"wrote {args.out / 'bench_xor_gpu.json'} and bench_xor_gpu.png")
    return 0


def summarize(rows: list[dict], impls) -> None:
    """Best tile per (size, rate) for each implementation, and the single/two-pass speedup."""
    print("\nbest tile per implementation, param GB/s (speedup single/two):")
    for gib in dict.fromkeys(r["gib"] for r in rows):
        for rate in dict.fromkeys(r["rate"] for r in rows):
            best = {impl: max((r for r in rows if r["gib"] == gib and r["rate"] == rate and r["impl"] == impl),
                              key=lambda r: r["param_gbps"]) for impl in impls}
            cells = "  ".join(f"{impl} {b['param_gbps']:7.0f} (tile {b['tile']})" for impl, b in best.items())
            ratio = (f"  x{best['single_pass']['param_gbps'] / best['two_pass']['param_gbps']:.2f}"
                     if len(best) == 2 else "")
            print(f"  {gib:5.2f} GiB {rate * 100:6.1f}%  {cells}{ratio}")


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"two_pass": "--", "single_pass": "-"}
    for color, gib in enumerate(dict.fromkeys(r["gib"] for r in rows)):
        for impl in meta["impls"]:
            pts = []
            for rate in dict.fromkeys(r["rate"] for r in rows):
                cands = [r for r in rows if r["gib"] == gib and r["impl"] == impl and r["rate"] == rate]
                pts.append(max(cands, key=lambda r: r["param_gbps"]))  # best tile
            label = f"{impl}, {gib:g} GiB"
            ax1.plot([r["rate"] * 100 for r in pts], [r["param_gbps"] for r in pts], styles[impl], marker="o",
                     color=f"C{color}", label=label)
            ax2.plot([r["rate"] * 100 for r in pts], [r["moved_bw_pct"] for r in pts], styles[impl], marker="o",
                     color=f"C{color}", label=label)
    peak_gbps = meta["peak_tbps"] * 1e3
    ax1.axhline(peak_gbps / 4, color="grey", linestyle=":", linewidth=1, label="HBM/4 (two-pass bound)")
    ax1.axhline(peak_gbps / 2, color="black", linestyle=":", linewidth=1, label="HBM/2 (single-pass bound)")
    ax2.axhline(70, color="grey", linestyle="--", linewidth=1, label="target 70%")
    for ax in (ax1, ax2):
        ax.set_xscale("symlog", linthresh=0.5)
        ax.set_xlim(left=0)
        ax.set_xlabel("elements changed (%)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("GB/s of BF16 parameters (best tile)")
    ax2.set_ylabel(f"bytes moved / time, % of {meta['peak_tbps']} TB/s")
    ax1.legend(fontsize=6)
    ax2.legend(fontsize=6)
    fig.suptitle(f"xor_diff_device, two_pass vs single_pass, on {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
