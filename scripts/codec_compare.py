"""Two coders side by side from repeated ``bench_codec.py`` runs: per pair, the median over the
runs of each run's best-of-repeat speed (a noisy VM moves whole runs up and down; alternate the
runs of the two coders so drift hits both alike).

    # before: a worktree of the old commit with its extensions built; after: this checkout
    git worktree add /tmp/before <rev> && (cd /tmp/before && $PWD/.venv/bin/python setup.py -q build_ext --inplace)
    for i in 1 2 3 4 5 6 7; do
      PYTHONPATH=/tmp/before .venv/bin/python /tmp/before/scripts/bench_codec.py --repeat 5 --clock cpu --out /tmp/codec_before$i
      .venv/bin/python scripts/bench_codec.py --repeat 5 --clock cpu --out /tmp/codec_after$i
    done
    .venv/bin/python scripts/codec_compare.py --before /tmp/codec_before* --after /tmp/codec_after*

(Run the old tree's script by path with PYTHONPATH: then its own ``nemo_dcr`` is imported, not
this checkout's editable install.)  Prints a Markdown table: the default context coder's size
and speeds, LANES context alone, and gap16+xor+zstd1 from the "after" runs; GB/s of parameter
bytes on one core.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

CTX, LANES, GAP16 = "nemo_dcr context", "lanes context", "gap16+xor+zstd1"


def load(dirs: list[str]) -> list[dict]:
    return [json.loads((pathlib.Path(d) / "codec.json").read_text()) for d in dirs]


def median(runs: list[dict], pair: str, fmt: str, key: str) -> float:
    return statistics.median(next(r for r in run["rows"] if r["pair"] == pair)["formats"][fmt][key] for run in runs)


def table(before: list[dict], after: list[dict]) -> list[str]:
    out = ["| pair | changed % | x bound | encode GB/s, before → after | decode GB/s, before → after "
           "| LANES context: x bound, encode / decode | gap16+xor+zstd1: encode / decode |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for row in after[0]["rows"]:
        p, f = row["pair"], row["formats"]

        def ba(fmt: str, key: str, bold: bool = False) -> str:
            a = f"{median(after, p, fmt, key):.2f}"
            return f"{median(before, p, fmt, key):.2f} → {f'**{a}**' if bold else a}"

        out.append(f"| {p} | {row['changed_pct']:.2f} | {f[CTX]['x_bound']:.3f} | {ba(CTX, 'encode_gbps', True)} "
                   f"| {ba(CTX, 'decode_gbps', True)} | {f[LANES]['x_bound']:.3f}, {ba(LANES, 'encode_gbps')} / "
                   f"{ba(LANES, 'decode_gbps')} | {median(after, p, GAP16, 'encode_gbps'):.2f} / "
                   f"{median(after, p, GAP16, 'decode_gbps'):.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", required=True, help="output dirs of the old coder's runs")
    ap.add_argument("--after", nargs="+", required=True, help="output dirs of the new coder's runs")
    args = ap.parse_args(argv)
    before, after = load(args.before), load(args.after)
    pairs = {r["pair"] for r in after[0]["rows"]}
    for run in before + after:
        if {r["pair"] for r in run["rows"]} != pairs:
            print("codec_compare: the runs cover different pairs", file=sys.stderr)
            return 2
    simd = sorted({run["meta"].get("bucket_simd", "?") for run in before + after})
    loads = [round(run["meta"]["load_avg_start"], 2) for run in before + after]
    print(f"{len(before)} runs before, {len(after)} after; CPU paths {simd}; load average at the starts "
          f"{min(loads)}-{max(loads)}; medians of each run's best of repeat\n")
    print("\n".join(table(before, after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
