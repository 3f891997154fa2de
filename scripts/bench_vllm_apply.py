"""In-place delta apply into a running vLLM (CPU) engine vs a dense reload of the same engine.

    .venv/bin/python scripts/bench_vllm_apply.py [--tp 1 2] [--changed-pct 3] [--repeats 5]

Builds a Llama checkpoint (random init, BF16; default ~62 M parameters: hidden 1024, 4
layers, FFN 2816, vocabulary 8192, 16 heads of 64, 4 KV heads), starts
``VLLMRuntime`` on it per TP size and, per repeat, applies an XOR delta changing
``--changed-pct`` % of every tensor's elements (low mantissa bits), timing
``VLLMRuntime.apply`` (validation in every worker, XOR of the changed elements into the
plain / staging weights, repack of every touched layer by vLLM's
``process_weights_after_loading``).  Alternate repeats apply the same delta again, so the
engine goes v0 -> v1 -> v0 ...; the last state is checked bit-exact (digest) against a
dense reload.  The dense baseline is ``VLLMRuntime.dense_reload``: every tensor of the
checkpoint through the model's ``load_weights`` plus the same repacks (read time reported
apart).  Prints the numbers and writes benchmarks/results/vllm_apply.{json,png}.
Wall-clock on a shared 2-core VM: orders of magnitude, not a speed claim.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _median(xs):
    return float(sorted(xs)[len(xs) // 2])


def build_checkpoint(root: Path, args) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden, num_attention_heads=args.hidden // 64, num_key_value_heads=args.kv_heads,
        head_dim=64, intermediate_size=args.ffn, num_hidden_layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "v0")
    return root / "v0"


def make_delta(ckpt: Path, pct: float, seed: int = 1):
    from safetensors.torch import load_file

    from nemo_dcr.codec.types import DeltaOp, TensorDelta

    rng = np.random.default_rng(seed)
    deltas, total = [], 0
    for name, t in sorted(load_file(str(ckpt / "model.safetensors")).items()):
        n = t.numel()
        total += n
        k = max(1, int(n * pct / 100))
        pos = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        deltas.append(TensorDelta(name, "bfloat16", tuple(t.shape), DeltaOp.XOR, pos,
                                  rng.integers(1, 8, size=k).astype(np.uint16)))
        del t
    return deltas, total


def bench_tp(tp: int, ckpt: Path, deltas, repeats: int) -> dict:
    from nemo_dcr.runtimes.vllm import VLLMRuntime

    t0 = time.perf_counter()
    rt = VLLMRuntime.start(str(ckpt), tensor_parallel_size=tp, max_model_len=256)
    start_s = time.perf_counter() - t0
    try:
        pre = rt.prewarm()
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
        base_gen = rt.generate(prompts)
        base_digest = rt.weight_digest()
        applies = []
        for _ in range(repeats):
            r = rt.apply(deltas)
            applies.append({"apply_s": r["apply_s"], "worker_apply_s": [w["apply_s"] for w in r["workers"]]})
        if repeats % 2:
            rt.apply(deltas)  # back to v0
        back_to_v0 = rt.weight_digest() == base_digest and rt.generate(prompts) == base_gen
        dense = []
        for _ in range(max(1, repeats // 2)):
            dense.append(rt.dense_reload(str(ckpt)))
        dense_exact = rt.weight_digest() == base_digest and rt.generate(prompts) == base_gen
        return {
            "tp": tp,
            "start_s": start_s,
            "prewarm": pre["workers"],
            "staging_bytes_per_worker": [w["staging_bytes"] for w in pre["workers"]],
            "mirror_bytes_per_worker": [w["mirror_bytes"] for w in pre["workers"]],
            "apply_s": [a["apply_s"] for a in applies],
            "apply_s_median": _median([a["apply_s"] for a in applies]),
            "worker_apply_s": [a["worker_apply_s"] for a in applies],
            "dense_reload_load_s_median": _median([max(w["load_s"] for w in d) for d in dense]),
            "dense_reload_read_s_median": _median([max(w["read_s"] for w in d) for d in dense]),
            "apply_round_trip_bit_exact": back_to_v0,
            "dense_reload_bit_exact": dense_exact,
        }
    finally:
        rt.close()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    labels = [f"TP={r['tp']}" for r in runs]
    x = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [r["apply_s_median"] for r in runs], 0.4, label=f"delta apply ({results['changed_pct']}% changed)")
    ax.bar(x + 0.2, [r["dense_reload_load_s_median"] for r in runs], 0.4, label="dense load_weights reload")
    ax.set_xticks(x, labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"vLLM CPU, Llama {results['params'] / 1e6:.0f} M params, in place")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--changed-pct", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", default=str(RESULTS / "vllm_apply"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    try:
        ckpt = build_checkpoint(root, args)
        deltas, params = make_delta(ckpt, args.changed_pct)
        runs = []
        for tp in args.tp:
            r = bench_tp(tp, ckpt, deltas, args.repeats)
            runs.append(r)
            print(
                f"TP={tp}: apply {r['apply_s_median'] * 1e3:.1f} ms (median of {args.repeats}), dense reload "
                f"{r['dense_reload_load_s_median'] * 1e3:.1f} ms (+ read {r['dense_reload_read_s_median'] * 1e3:.1f} ms), "
                f"staging {r['staging_bytes_per_worker']} B/worker, canonical mirror {r['mirror_bytes_per_worker']} B, "
                f"kinds {[w['kinds'] for w in r['prewarm']]}, round trip exact {r['apply_round_trip_bit_exact']}, "
                f"dense exact {r['dense_reload_bit_exact']}",
                flush=True,
            )
        results = {
            "params": params,
            "checkpoint_bytes": params * 2,
            "changed_pct": args.changed_pct,
            "changed_elements": int(sum(d.nnz for d in deltas)),
            "model": {k: getattr(args, k) for k in ("hidden", "kv_heads", "ffn", "layers", "vocab")},
            "runs": runs,
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.json')} and .png")
        ok = all(r["apply_round_trip_bit_exact"] and r["dense_reload_bit_exact"] for r in runs)
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
