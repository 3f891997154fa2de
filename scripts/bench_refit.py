"""End-to-end refit benchmark: the demo pipeline (Megatron-Core TP=2 under torchrun ->
local store -> Hugging Face receiver) at several learning rates, with the codec's context
mode on (``refit.coding=context``) and off (``refit.coding=plain``).

    .venv/bin/python scripts/bench_refit.py [--steps 4] [--lrs 1e-6,3e-6,1e-5] [overrides...]

Prints one row per (lr, step) and a summary per lr; writes
benchmarks/results/refit.{json,png}.  Every refit is verified bit-exact against a dense
refit (the run fails otherwise).  Stage times are wall-clock on whatever else the machine
is doing: read them as orders of magnitude on a 2-core VM, not as a speed claim.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml")
    args = ap.parse_args()

    from nemo_dcr_testbed.config import load_demo_config
    from nemo_dcr_testbed.demo import run

    out = {"steps": args.steps, "overrides": args.overrides, "runs": []}
    for lr in args.lrs.split(","):
        for context in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_demo_config([f"run_dir={tmp}/run", f"store.uri={tmp}/store", f"steps={args.steps}",
                                        f"train.lr={lr}", f"refit.coding={'context' if context else 'plain'}",
                                        "refit.verify_dense=true", *args.overrides])
                summary = run(cfg)
                with open(os.path.join(tmp, "run", "steps.jsonl")) as f:
                    rows = [json.loads(line) for line in f]
            if summary["bit_exact"] != args.steps:
                print(f"lr={lr}: only {summary['bit_exact']}/{args.steps} refits bit-exact", file=sys.stderr)
                return 1
            out["runs"].append({"lr": float(lr), "context": context, "summary": summary, "steps": rows,
                                "model": cfg.to_dict()["model"], "tp": cfg.parallel.tensor_model_parallel_size})
            print(f"# lr={lr} context={context}: {json.dumps(summary)}", flush=True)

    print("\n| lr | context | changed % | wire B / changed | dense / wire | diff ms | project ms | encode ms | receiver ms |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["runs"]:
        s, rows = r["summary"], r["steps"][1:] or r["steps"]  # step 1 includes warm-up
        med = lambda k: sorted(x[k] for x in rows)[len(rows) // 2] * 1e3  # noqa: E731
        rx = sorted(max(sum(a["stats"].get(k, 0.0) for k in ("download_s", "decode_s", "apply_s"))
                        for a in x["acks"]) for x in rows)[len(rows) // 2] * 1e3
        r["table"] = {"changed_pct": s["changed_pct_mean"], "bytes_per_changed": s["bytes_per_changed"],
                      "compression": s["compression"], "diff_ms": med("diff_s"), "project_ms": med("project_s"),
                      "encode_ms": med("encode_s"), "receiver_ms": rx}
        t = r["table"]
        print(f"| {r['lr']:g} | {'on' if r['context'] else 'off'} | {t['changed_pct']:.2f} | {t['bytes_per_changed']:.3f} | {t['compression']:.1f}x | "
              f"{t['diff_ms']:.1f} | {t['project_ms']:.1f} | {t['encode_ms']:.1f} | {t['receiver_ms']:.1f} |")

    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "refit.json"), "w") as f:
        json.dump(out, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {}
    for r in out["runs"]:
        steps = [x["step"] for x in r["steps"]]
        c = colors.setdefault(r["lr"], f"C{len(colors)}")
        style = "o-" if r["context"] else "s--"
        label = f"lr {r['lr']:g}, context {'on' if r['context'] else 'off'}"
        a1.plot(steps, [x["wire_bytes"] / x["changed"] for x in r["steps"]], style, color=c, label=label)
        a2.plot(steps, [x["dense_bytes"] / x["wire_bytes"] for x in r["steps"]], style, color=c, label=label)
    a1.set(xlabel="step", ylabel="wire bytes per changed element", title="size per change")
    a2.set(xlabel="step", ylabel="dense bytes / wire bytes", title="compression vs dense refit")
    for a in (a1, a2):
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "refit.png"), dpi=110)
    print(f"\nwrote {RESULTS}/refit.json and refit.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
