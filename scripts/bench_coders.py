"""MODEL (coding 3, the previous default) against BUCKET (coding 4, the default) on the same
real delta pairs, in one process: bytes per changed element, ratio to the per-tensor i.i.d.
bound, and encode / decode GB/s of parameter bytes on one thread (process CPU time, best of
``--repeat``), for both modes.  Whole chunks through ``encode_chunk`` / ``decode_chunk``; the
decoded arrays are checked against the input.  Saves benchmarks/results/coders.json.

    .venv/bin/python scripts/bench_coders.py [--pairs minilm_lr1e-06,...] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file

from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, bucket, decode_chunk, encode_chunk
from nemo_dcr.codec.bound import iid_bound_bytes
from nemo_dcr.kernels import bits_view_np, xor_diff


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def bench_pair(d: pathlib.Path, repeat: int) -> dict:
    base, target = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
    deltas, bits, bound, nbytes = [], {}, 0.0, 0
    for name in sorted(base):
        b, t = base[name].contiguous(), target[name].contiguous()
        diff = xor_diff(t, b)
        deltas.append(TensorDelta(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                                  op=DeltaOp.XOR, positions=diff.positions, values=diff.xor_values))
        bits[name] = bits_view_np(b)
        bound += iid_bound_bytes(bits[name].size, diff.xor_values)
        nbytes += bits[name].size * bits[name].itemsize
    nnz = sum(x.nnz for x in deltas)
    row = {"pair": d.name, "param_bytes": nbytes, "changed_pct": 100 * nnz / (nbytes / 2), "bound_bytes": bound}
    for coder, codings in (("model", [Coding.MODEL]), ("bucket", None)):
        for mode, base_map in (("free", None), ("context", bits)):
            t_enc, chunk = _best(lambda: encode_chunk(deltas, base=base_map, codings=codings), repeat)
            t_dec, dec = _best(lambda: decode_chunk(chunk, base=base_map), repeat)
            for a, b in zip(deltas, dec.deltas):
                if not (np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)):
                    raise SystemExit(f"{d.name} {coder} {mode}: {a.name} does not round-trip")
            key = f"{coder}_{mode}"
            row[f"{key}_bytes"] = len(chunk)
            row[f"{key}_x_bound"] = len(chunk) / bound
            row[f"{key}_encode_gbps"] = nbytes / t_enc / 1e9
            row[f"{key}_decode_gbps"] = nbytes / t_dec / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="benchmarks/data")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--pairs", default="", help="comma-separated pair names (default: all)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    index = pathlib.Path(args.data) / "index.json"
    if not index.is_file():
        print(f"no {index}: run scripts/make_real_deltas.py first", file=sys.stderr)
        return 2
    names = [p["dir"] for p in json.loads(index.read_text())["pairs"]]
    if args.pairs:
        names = [n for n in names if n in args.pairs.split(",")]
    rows = []
    load_start = os.getloadavg()[0]
    print(f"{'pair':18s} {'chg%':>5s}  {'coder mode':16s} {'x bound':>8s} {'enc GB/s':>9s} {'dec GB/s':>9s}")
    for n in names:
        r = bench_pair(pathlib.Path(args.data) / n, args.repeat)
        rows.append(r)
        for key in ("model_free", "bucket_free", "model_context", "bucket_context"):
            print(f"{n:18s} {r['changed_pct']:5.2f}  {key:16s} {r[key + '_x_bound']:8.4f} "
                  f"{r[key + '_encode_gbps']:9.3f} {r[key + '_decode_gbps']:9.3f}", flush=True)
    meta = {"command": "scripts/bench_coders.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": platform.machine(), "simd": bucket.simd(), "python": platform.python_version(),
            "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0]}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coders.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out / 'coders.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
