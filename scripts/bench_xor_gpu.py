#!/usr/bin/env python
"""GPU XOR diff throughput (Triton kernels of nemo_dcr.kernels.triton_xor) on one CUDA device.

For BF16 tensors of several sizes and change rates, and several tile sizes, it times with
CUDA events (median of --repeats after warm-up):

  count     the count kernel alone (reads both tensors once: the streaming ceiling),
  diff      xor_diff_device end to end: count, cumsum, one scalar sync, exact allocation,
            fill (skips empty tiles), block counts -- results left on the device,
  torch     the plain torch formulation (x = a ^ b; nonzero; gather) for comparison,
  to_host   copying the compact results to host memory (reported, not in `diff`).

and reports parameter throughput (numel * 2 bytes / time) and achieved memory bandwidth
(bytes the kernels must move / time) as a percentage of --peak-tbps (H200 HBM3e: 4.8 TB/s).
Bytes moved by `diff` = 2nw (count) + 2w * elements of non-empty tiles (fill) + k(8 + w)
(outputs) + per-tile counts.  Before timing, every configuration's result is checked bit for
bit: against a torch-on-device formulation at every size, and against the CPU C path at
the smallest size.

    python scripts/bench_xor_gpu.py                   # 0.25, 1, 4 GiB; 0..100 %; tiles 1-4K
    python scripts/bench_xor_gpu.py --gib 1 --repeats 10
    python scripts/bench_xor_gpu.py --interpret     # no GPU: exercise this script on tiny CPU
                                                    # tensors through the Triton interpreter
                                                    # (times are meaningless there)

Writes benchmarks/results/bench_xor_gpu.json and bench_xor_gpu.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="BF16 tensor sizes in GiB")
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.005, 0.03, 0.10, 1.0])
    p.add_argument("--tiles", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--block-size", type=int, default=1 << 16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8 TB/s)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--interpret", action="store_true",
                   help="no GPU: tiny CPU tensors through TRITON_INTERPRET=1, results under /tmp")
    args = p.parse_args()
    global DEVICE
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported below
        DEVICE = "cpu"
        args.gib, args.tiles, args.repeats = [2.0**-16, 2.0**-14], [1024, 4096], 2
        args.out = Path("/tmp/bench_xor_gpu_interpret")
    elif not torch.cuda.is_available():
        print("bench_xor_gpu: no CUDA device; nothing measured (see --interpret)", file=sys.stderr)
        return 2

    from nemo_dcr.kernels.cpu import xor_diff_c
    from nemo_dcr.kernels.triton_xor import _flat_bits, _tile_counts, xor_diff_device

    peak = args.peak_tbps * 1e12
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {dev}; peak assumed {args.peak_tbps} TB/s; block_size {args.block_size}")
    header = (f"{'GiB':>5} {'changed':>8} {'tile':>5} {'count GB/s':>11} {'%peak':>6} {'diff ms':>8} "
              f"{'param GB/s':>11} {'moved GB/s':>11} {'%peak':>6} {'torch ms':>9} {'to_host ms':>10}")
    print(header)
    print("-" * len(header))
    rows = []
    for gib in args.gib:
        numel = int(gib * (1 << 30)) // 2
        for rate in args.rates:
            cur, base = make_pair(numel, rate, seed=0)
            ref_pos, ref_val = torch_diff(cur, base)
            a, b = _flat_bits(cur), _flat_bits(base)
            t_torch = cuda_time(lambda: torch_diff(cur, base), args.repeats)
            for tile in args.tiles:
                d = xor_diff_device(cur, base, block_size=args.block_size, tile=tile)
                assert torch.equal(d.positions, ref_pos) and torch.equal(d.xor_values, ref_val), "mismatch"
                assert int(d.block_counts.sum()) == ref_pos.numel()
                if gib == min(args.gib):
                    host = xor_diff_c(cur.cpu(), base.cpu(), block_size=args.block_size)
                    assert d.to_host().bit_equal(host), "GPU and CPU paths differ"
                tile_counts = _tile_counts(a, b, tile)
                busy_tiles = int((tile_counts > 0).sum())
                k = ref_pos.numel()
                moved = 4 * numel + 4 * min(numel, busy_tiles * tile) + 10 * k + 12 * tile_counts.numel()
                t_count = cuda_time(lambda: _tile_counts(a, b, tile), args.repeats)
                t_diff = cuda_time(lambda: xor_diff_device(cur, base, block_size=args.block_size, tile=tile),
                                   args.repeats)
                t_host = cuda_time(lambda: d.to_host(), max(3, args.repeats // 4), warmup=1)
                row = {
                    "gib": gib, "numel": numel, "rate": rate, "changed": k, "tile": tile,
                    "count_s": t_count, "diff_s": t_diff, "torch_s": t_torch, "to_host_s": t_host,
                    "count_bw_pct": 100 * 4 * numel / t_count / peak,
                    "param_gbps": 2 * numel / t_diff / 1e9,
                    "moved_bytes": moved, "moved_gbps": moved / t_diff / 1e9,
                    "moved_bw_pct": 100 * moved / t_diff / peak,
                }
                rows.append(row)
                print(f"{gib:5.2f} {rate * 100:7.1f}% {tile:5d} {4 * numel / t_count / 1e9:11.0f} "
                      f"{row['count_bw_pct']:6.1f} {t_diff * 1e3:8.3f} {row['param_gbps']:11.0f} "
                      f"{row['moved_gbps']:11.0f} {row['moved_bw_pct']:6.1f} {t_torch * 1e3:9.3f} {t_host * 1e3:10.3f}")
                del d
            del cur, base, ref_pos, ref_val, a, b
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev, "peak_tbps": args.peak_tbps, "block_size": args.block_size, "repeats": args.repeats,
            "torch": torch.__version__}
    (args.out / "bench_xor_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "bench_xor_gpu.png", meta)
    print(f"wrote {args.out / 'bench_xor_gpu.json'} and bench_xor_gpu.png")
    return 0


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for gib in dict.fromkeys(r["gib"] for r in rows):
        for tile in dict.fromkeys(r["tile"] for r in rows):
            pts = [r for r in rows if r["gib"] == gib and r["tile"] == tile]
            label = f"{gib:g} GiB, tile {tile}"
            ax1.plot([r["rate"] * 100 for r in pts], [r["moved_bw_pct"] for r in pts], marker="o", label=label)
            ax2.plot([r["rate"] * 100 for r in pts], [r["param_gbps"] for r in pts], marker="o", label=label)
    ax1.axhline(70, color="grey", linestyle="--", linewidth=1, label="target 70%")
    for ax in (ax1, ax2):
        ax.set_xscale("symlog", linthresh=0.5)
        ax.set_xlabel("elements changed (%)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel(f"bytes moved / time, % of {meta['peak_tbps']} TB/s")
    ax2.set_ylabel("GB/s of BF16 parameters")
    ax1.legend(fontsize=6)
    fig.suptitle(f"xor_diff_device on {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
