"""MoE apply at 256 experts: nemo_dcr's in-place apply against the loader paths a refit
without it takes, on a transformers v5 Qwen3-MoE receiver (fused 3-D expert parameters,
per-expert checkpoint names).

    .venv/bin/python scripts/bench_moe_apply.py [--experts 256] [--layers 2] [--sizes 64x32,256x128,512x384]
        [--changed 0.03] [--repeats 5]

The same version (``--changed`` of every expert tensor's elements set to new bit patterns,
the other tensors unchanged) is applied three ways, each from the same base, median of
``--repeats``:

* ``nemo_dcr``: ``DeltaApplier.apply`` of the version's XOR records (experts are TRACED
  placements: the changed elements are XORed into the fused parameters in place, no
  loader call);
* ``loader per layer``: one call of the runtime's loader (``load_weights``, transformers'
  own converters then ``load_state_dict``) per layer with the layer's whole new expert
  tensors -- the fused group the converter needs at once (the loader refuses a part of it);
* ``per-expert copy``: what a per-expert weight loader does (vLLM's ``FusedMoE.weight_loader``,
  SGLang's loop): one ``copy_`` of each new expert tensor into its slice of the fused
  parameter.

After each, every canonical tensor is compared with the version bit for bit (integer
views); the first comparison is repeated with one bit flipped, which must be reported.
Writes ``benchmarks/results/moe_apply.{json,png}``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).reshape(-1).numpy()


def build(path: str, experts: int, layers: int, hidden: int = 64, inter: int = 32) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=inter,
                         intermediate_size=64, vocab_size=256)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(path)


def version(adapter, applier, changed: float, seed: int):
    """(XOR records, the new canonical tensors) of a version changing ``changed`` of every
    expert tensor's elements."""
    from nemo_dcr.codec.types import DeltaOp, TensorDelta

    rng = np.random.default_rng(seed)
    records, new = [], {}
    for name, spec in adapter.tensor_specs().items():
        if ".mlp.experts." not in name:
            continue
        base = applier.canonical_bits(name).copy()
        k = max(1, int(changed * base.size))
        pos = np.sort(rng.choice(base.size, size=k, replace=False)).astype(np.int64)
        xor = rng.integers(1, 1 << 16, size=k, dtype=np.uint32).astype(np.uint16)
        records.append(TensorDelta(name, spec.dtype, spec.shape, DeltaOp.XOR, pos, xor))
        target = base
        target[pos] ^= xor
        new[name] = torch.from_numpy(target.view(np.int16).copy()).view(torch.bfloat16).reshape(spec.shape)
    return records, new


def mismatches(applier, want: dict[str, torch.Tensor], flip: bool = False) -> list[str]:
    bad = []
    for name, t in want.items():
        got = applier.canonical_bits(name).view(np.int16).copy()
        if flip and not bad:
            got[0] ^= 1
        if not np.array_equal(got, _bits(t)):
            bad.append(name)
    return bad


def expert_slices(module, name: str) -> torch.Tensor:
    """The slice of a fused expert parameter that holds checkpoint tensor ``name``
    (transformers v5 Qwen3-MoE: gate_up_proj[e] = cat(gate, up), down_proj[e])."""
    parts = name.split(".")
    layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
    experts = module.model.layers[layer].mlp.experts
    if proj == "down_proj":
        return experts.down_proj[e]
    half = experts.gate_up_proj.shape[1] // 2
    return experts.gate_up_proj[e, :half] if proj == "gate_proj" else experts.gate_up_proj[e, half:]


def measure(experts: int, layers: int, hidden: int, inter: int, changed_frac: float, repeats: int) -> dict:
    """One model size: the three methods' median times, bit-exactness and the control."""
    from nemo_dcr.receiver.apply import DeltaApplier
    from nemo_dcr.runtimes.hf import HFTransformersAdapter

    tmp = tempfile.mkdtemp(prefix="moe-apply-")  # the checkpoint, kept while the runtime lives
    try:
        build(tmp, experts, layers, hidden, inter)
        adapter = HFTransformersAdapter.from_pretrained(tmp)
        applier = DeltaApplier(adapter)
        t = time.perf_counter()
        placements = applier.prewarm()
        prewarm_s = time.perf_counter() - t
        kinds: dict[str, int] = {}
        for n, p in placements.items():
            if ".mlp.experts." in n:
                kinds[p.kind.name] = kinds.get(p.kind.name, 0) + 1
        base = {n: applier.canonical_bits(n).copy() for n in adapter.tensor_specs() if ".mlp.experts." in n}
        records, new = version(adapter, applier, changed_frac, seed=1)
        changed = sum(r.nnz for r in records)
        expert_elems = sum(t.numel() for t in new.values())
        print(f"{layers} layers x {experts} experts of {hidden}x{inter}: {len(records)} expert tensors, "
              f"{expert_elems:,} elements, {changed:,} changed; prewarm {prewarm_s:.1f} s; placements {kinds}",
              file=sys.stderr)

        def restore() -> None:
            with torch.no_grad():
                for name, bits in base.items():
                    expert_slices(adapter.module, name).copy_(
                        torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(new[name].shape))
            assert not [n for n in base if not np.array_equal(applier.canonical_bits(n), base[n])], "restore failed"

        layer_names: dict[int, list[str]] = {}
        for name in new:
            layer_names.setdefault(int(name.split(".")[2]), []).append(name)

        def nemo_dcr() -> None:
            applier.apply(records)

        def loader_per_layer() -> None:
            with torch.no_grad():
                for names in layer_names.values():
                    adapter.load_weights([(n, new[n]) for n in names])

        def per_expert_copy() -> None:
            with torch.no_grad():
                for n in new:
                    expert_slices(adapter.module, n).copy_(new[n])

        methods = {"nemo_dcr": nemo_dcr, "loader per layer": loader_per_layer, "per-expert copy": per_expert_copy}
        out = {"experts": experts, "layers": layers, "hidden": hidden, "moe_intermediate": inter,
               "expert_tensors": len(records), "expert_elements": expert_elems, "changed": changed,
               "prewarm_s": prewarm_s, "expert_placements": kinds, "methods": {}}
        control = None
        for label, fn in methods.items():
            times, exact = [], True
            for _ in range(repeats):
                restore()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
                exact = exact and not mismatches(applier, new)
                if control is None:
                    control = bool(mismatches(applier, new, flip=True))  # must see the flipped bit
            out["methods"][label] = {"median_s": statistics.median(times), "times_s": times, "bit_exact": exact,
                                     "per_tensor_us": statistics.median(times) / len(records) * 1e6}
            print(f"  {label:18s} median {statistics.median(times) * 1e3:8.1f} ms  bit-exact {exact}", file=sys.stderr)
        out["negative_control_detected"] = control
        ref = out["methods"]["nemo_dcr"]["median_s"]
        for m in out["methods"].values():
            m["vs_nemo_dcr"] = m["median_s"] / ref
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sizes", default="64x32,256x128,512x384",
                    help="HIDDENxMOE_INTERMEDIATE of the expert sizes measured (one model each)")
    ap.add_argument("--changed", type=float, default=0.03)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    out = {"meta": {"experts": args.experts, "layers": args.layers, "changed_frac": args.changed,
                    "repeats": args.repeats, "loadavg_start": os.getloadavg(), "torch_threads": 1,
                    "runtime": "transformers (HFTransformersAdapter)", "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "sizes": [measure(args.experts, args.layers, h, f, args.changed, args.repeats) for h, f in sizes]}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "moe_apply.json"), "w") as f:
        json.dump(out, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    labels = list(out["sizes"][0]["methods"])
    xs = [f"{s['hidden']}x{s['moe_intermediate']}\n({s['expert_elements'] / 1e6:.1f} M el.)" for s in out["sizes"]]
    w = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar([j + i * w for j in range(len(xs))], [s["methods"][label]["median_s"] * 1e3 for s in out["sizes"]],
               w, label=label)
    ax.set_xticks([j + w for j in range(len(xs))], xs)
    ax.set_yscale("log")
    ax.set_ylabel("ms per version (median)")
    ax.set_title(f"MoE apply, {args.layers} layers x {args.experts} experts, {args.changed:.0%} of expert elements "
                 "changed (transformers)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "moe_apply.png"), dpi=110)
    print(json.dumps([{k: round(v["median_s"], 4) for k, v in s["methods"].items()} for s in out["sizes"]]))
    ok = all(m["bit_exact"] for s in out["sizes"] for m in s["methods"].values()) and \
        all(s["negative_control_detected"] for s in out["sizes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
