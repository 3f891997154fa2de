"""Dense vs MoE refit at the same scale, in one run: the demo pipeline (Megatron-Core under
torchrun -> local store -> transformers receiver) for a dense Qwen3 and a Qwen3-MoE with
expert parallelism 2, same width, depth, vocabulary, learning rate and world size (2 ranks).

    .venv/bin/python scripts/bench_families.py [--steps 4] [--lr 2e-6] [overrides...]

The MoE model routes each token to top-2 of 8 experts whose width is half the dense FFN,
so a token sees the same FFN width (active parameters per token match); its total
parameter count is larger.  Prints one row per (family, step) and a summary per family;
writes benchmarks/results/families.{json,png}.  Every refit is verified bit-exact against a
dense refit (the run fails otherwise).  Stage times are wall-clock on a shared 2-core VM:
orders of magnitude, not a speed claim.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
SCALE = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=512", "model.vocab_size=1000", "parallel.tensor_model_parallel_size=1",
         "parallel.data_parallel_size=2"]
FAMILIES = {
    "qwen3 (dense), DP=2": ["model.family=qwen3"],
    "qwen3_moe 8x256 top-2, EP=2": ["model.family=qwen3_moe", "model.num_moe_experts=8", "model.moe_router_topk=2",
                                    "model.moe_ffn_hidden_size=256", "parallel.expert_model_parallel_size=2"],
}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", default="2e-6")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml")
    args = ap.parse_args()

    from nemo_dcr_testbed.config import load_demo_config
    from nemo_dcr_testbed.demo import run

    out = {"steps": args.steps, "lr": float(args.lr), "scale": SCALE, "overrides": args.overrides, "runs": []}
    for label, fam in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_demo_config([f"run_dir={tmp}/run", f"store.uri={tmp}/store", f"steps={args.steps}",
                                    f"train.lr={args.lr}", "refit.verify_dense=true", *SCALE, *fam, *args.overrides])
            summary = run(cfg)
            with open(os.path.join(tmp, "run", "steps.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        if summary["bit_exact"] != args.steps:
            print(f"{label}: only {summary['bit_exact']}/{args.steps} refits bit-exact", file=sys.stderr)
            return 1
        out["runs"].append({"label": label, "summary": summary, "steps": rows, "model": cfg.to_dict()["model"]})
        print(f"# {label}: {json.dumps(summary)}", flush=True)

    print("\n| model | step | params (canonical) | changed % | wire B | dense B | dense/wire | B/changed "
          "| diff ms | project ms | encode ms | upload ms | receiver ms |")
    print("|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in out["runs"]:
        for x in r["steps"]:
            rx = max(sum(a["stats"].get(k, 0.0) for k in ("download_s", "decode_s", "apply_s")) for a in x["acks"])
            x["receiver_s"] = rx
            print(f"| {r['label']} | {x['step']} | {x['canonical_numel']:,} | {100 * x['changed'] / x['canonical_numel']:.2f} | "
                  f"{x['wire_bytes']:,} | {x['dense_bytes']:,} | {x['dense_bytes'] / x['wire_bytes']:.1f}x | "
                  f"{x['wire_bytes'] / x['changed']:.3f} | {x['diff_s'] * 1e3:.1f} | {x['project_s'] * 1e3:.1f} | "
                  f"{x['encode_s'] * 1e3:.1f} | {x['upload_s'] * 1e3:.1f} | {rx * 1e3:.1f} |")
    print("\nsummary (steps 2.. ; step 1 includes warm-up):")
    for r in out["runs"]:
        rows = r["steps"][1:] or r["steps"]
        s = r["summary"]
        r["table"] = {"changed_pct": s["changed_pct_mean"], "bytes_per_changed": s["bytes_per_changed"],
                      "compression": s["compression"],
                      **{f"{k}_ms": _median([x[f"{k}_s"] for x in rows]) * 1e3
                         for k in ("diff", "project", "encode", "upload", "receiver")}}
        print(f"  {r['label']}: {json.dumps(r['table'])}")

    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "families.json"), "w") as f:
        json.dump(out, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for i, r in enumerate(out["runs"]):
        steps = [x["step"] for x in r["steps"]]
        kw = dict(color=f"C{i}", label=r["label"], marker="o")
        axes[0].plot(steps, [100 * x["changed"] / x["canonical_numel"] for x in r["steps"]], **kw)
        axes[1].plot(steps, [x["wire_bytes"] / x["changed"] for x in r["steps"]], **kw)
        axes[2].plot(steps, [x["dense_bytes"] / x["wire_bytes"] for x in r["steps"]], **kw)
    axes[0].set(xlabel="step", ylabel="changed elements (%)", title="changed per step")
    axes[1].set(xlabel="step", ylabel="wire bytes per changed element", title="size per change")
    axes[2].set(xlabel="step", ylabel="dense bytes / wire bytes", title="compression vs dense refit")
    for a in axes:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "families.png"), dpi=110)
    print(f"\nwrote {RESULTS}/families.json and families.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
