"""Receiver prewarm (``DeltaApplier.prewarm``: probe the loader, classify, check overlaps) on
the link benchmark's model, with its parameters as transformers allocates them and with
every parameter mapped on one file (``--persistent-weights``, ``runtimes/persistent.py``).

    .venv/bin/python scripts/bench_prewarm.py [--repeats 3] [--masks] [--out-dir benchmarks/results]

Each measurement runs in a fresh process, so its peak RSS is its own: the model (hidden 1024,
8 layers, FFN 2816, 16 heads / 4 KV groups, vocabulary 32000, untied: 155.7 M parameters,
BF16) is built, optionally bound to a weights file in a temporary directory, then prewarmed.
Reported per case: prewarm seconds and the process's peak RSS before and after prewarm
(``ru_maxrss``), medians over ``--repeats``.  ``--masks`` also runs each case with the
overlap check forced to its element-by-element path (a boolean mask of the storage per
tensor), the cost the span check avoids.  Prints a table; writes
``<out-dir>/prewarm.{json,png}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def child(mode: str, masks: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_dcr.receiver import placement
    from nemo_dcr.receiver.apply import DeltaApplier
    from nemo_dcr.runtimes.hf import HFTransformersAdapter
    from nemo_dcr.runtimes.persistent import bind_persistent

    if masks:
        placement._spans_overlap = lambda writes: True
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "persistent":
            bind_persistent(model, os.path.join(tmp, "weights"), "bench")
        storages = len({p.untyped_storage().data_ptr() for p in model.parameters()})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        placements = DeltaApplier(HFTransformersAdapter(model)).prewarm()
        spent = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kinds = sorted({p.kind.value for p in placements.values()})
    return {"mode": mode, "masks": masks, "prewarm_s": spent, "peak_rss_before_mb": before / 1024,
            "peak_rss_after_mb": after / 1024, "storages": storages, "tensors": len(placements), "kinds": kinds,
            "params": sum(p.numel() for p in model.parameters())}


def run_one(mode: str, masks: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, *(["--masks"] if masks else [])],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_prewarm: the {mode} case failed (exit {out.returncode}): "
                         f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['mode']}\n{'masks' if c['masks'] else 'spans'}" for c in cases]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(labels, [c["prewarm_s"] for c in cases])
    a.set_ylabel("prewarm s (median)")
    b.bar(labels, [c["peak_rss_after_mb"] / 1024 for c in cases], label="after prewarm")
    b.bar(labels, [c["peak_rss_before_mb"] / 1024 for c in cases], label="before")
    b.set_ylabel("process peak RSS, GB")
    b.legend()
    fig.suptitle("receiver prewarm, 155.7 M-parameter Llama (BF16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--masks", action="store_true", help="also force the element-by-element overlap check")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--child", choices=["memory", "persistent"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.masks)))
        return 0
    load = os.getloadavg()
    cases = []
    for mode in ("memory", "persistent"):
        for masks in ((False, True) if args.masks else (False,)):
            runs = []
            for i in range(args.repeats):
                runs.append(run_one(mode, masks))
                print(f"[bench_prewarm] {mode} {'masks' if masks else 'spans'} {i + 1}/{args.repeats}: "
                      f"{runs[-1]['prewarm_s']:.2f} s, peak {runs[-1]['peak_rss_after_mb']:.0f} MB",
                      file=sys.stderr, flush=True)
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("prewarm_s", "peak_rss_before_mb", "peak_rss_after_mb")}
            cases.append({**runs[0], **med, "runs": runs})
    print(f"{'weights':>10} {'check':>6} {'storages':>8} {'prewarm s':>9} {'peak MB before':>14} {'peak MB after':>13}  kinds")
    for c in cases:
        print(f"{c['mode']:>10} {'masks' if c['masks'] else 'spans':>6} {c['storages']:>8} {c['prewarm_s']:>9.2f} "
              f"{c['peak_rss_before_mb']:>14.0f} {c['peak_rss_after_mb']:>13.0f}  {','.join(c['kinds'])}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load, "loadavg_end": os.getloadavg(),
                        "python": platform.python_version()}}
    (out / "prewarm.json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))
    plot(cases, out / "prewarm.png")
    print(f"[bench_prewarm] wrote {out / 'prewarm.json'} and prewarm.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
