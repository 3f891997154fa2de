"""Catch-up of a receiver that is N committed versions behind: replay them one by one, or
write one composed delta (``receiver/catchup.py``)?  Both through the real path: a
signed store written by the real sender (context-mode chunks), a transformers Llama
receiver (``DeltaApplier``), fetch + decode + journal + apply.

    .venv/bin/python scripts/bench_catchup.py [--hidden 512 --layers 4 --changed 0.03]

For each N it times both modes from the same version 0 and checks both end with the same
bits as the trainer (integer views); it prints one row per N and writes
``benchmarks/results/catchup.json`` and ``catchup.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 128 or 1, intermediate_size=hidden * 3, vocab_size=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _sender(store, state, key):
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr_testbed.flat_sender import flat_sender

    params = {n: t.clone() for n, t in state.items()}
    cfg = RefitOptions(model_id="bench", receivers=("r0",), key_file=key, ack_timeout_s=0.05, ack_poll_s=0.01,
                       max_consecutive_failures=10**6)
    return flat_sender(params, store, cfg), params


def _step(params, rng, frac):
    for t in params.values():
        b = t.view(torch.int16).reshape(-1)
        k = max(1, int(b.numel() * frac))
        idx = torch.from_numpy(rng.choice(b.numel(), k, replace=False))
        b[idx] ^= torch.from_numpy(rng.integers(1, 1 << 7, k).astype(np.int16))  # low mantissa bits, like Adam


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--changed", type=float, default=0.03)
    ap.add_argument("--versions", default="1,2,4,8,16")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from nemo_dcr.integrations.hf_export import write_checkpoint
    from nemo_dcr.protocol.manifest import Manifest, manifest_key
    from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
    from nemo_dcr.receiver.bootstrap import build_receiver
    from nemo_dcr.receiver.engine import ReceiverConfig
    from nemo_dcr.transport.store import LocalDirStore

    ns = [int(x) for x in args.versions.split(",")]
    tmp = tempfile.mkdtemp(prefix="dcr-catchup-")
    try:
        key = new_key_file(os.path.join(tmp, "key"))
        sealer = Sealer(load_key(key))
        model = _model(args.hidden, args.layers)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        store = LocalDirStore(os.path.join(tmp, "store"))
        sender, params = _sender(store, state, key)
        sender.set_root(write_checkpoint(store, model.config.to_dict(), state, sealer=sealer, run_id=sender.claim()))
        init_dir = os.path.join(tmp, "store", "init")
        numel = sum(t.numel() for t in state.values())
        rng = np.random.default_rng(0)
        # publish max(ns) versions; each is aborted by the sender (no receiver), so commit
        # them by hand: baseline + decision record, as the trainer would on acks
        from nemo_dcr.protocol.manifest import Decision, decision_key, doc_digest

        for v in range(1, max(ns) + 1):
            _step(params, rng, args.changed)
            refs, _ = sender.publish(v)
            m = Manifest(run_id=sender.run_id, model_id="bench", version=v, base_version=v - 1,
                         base_digest=sender.committed_digest, chunks=tuple(refs))
            store.put(manifest_key(v), m.to_json(sealer))
            decision = Decision(sender.run_id, v, v - 1, True, ("r0",),
                                manifest_digest=doc_digest(store.get(manifest_key(v)))).to_json(sealer)
            store.put(decision_key(v), decision)
            sender.baseline.commit(v)
            sender.committed_digest = doc_digest(decision)
        manifests = [Manifest.from_json(store.get(manifest_key(v)), sealer) for v in range(1, max(ns) + 1)]
        rows = []
        for n in ns:
            want = {}
            result = {"versions": n}
            for mode in ("replay", "composed"):
                session = build_receiver(store, sealer, ReceiverConfig(receiver_id="r0", model_id="bench"),
                                         state_dir=os.path.join(tmp, f"r0-{n}-{mode}"), init_dir=init_dir)
                rx = session.receiver
                adapter = rx.served.applier.adapter  # the hf runtime's in-process model
                t0 = time.perf_counter()
                if mode == "replay":
                    for m in manifests[:n]:
                        rx.apply_committed(m, "")
                else:
                    rx.apply_chain(manifests[:n], "")
                result[f"{mode}_s"] = round(time.perf_counter() - t0, 4)
                got = {k: v.view(torch.int16).clone() for k, v in adapter.module.state_dict().items() if k in state}
                want[mode] = got
            # both modes hold the same bits, and those are the trainer's bits after n versions
            exact = all(torch.equal(want["replay"][k], want["composed"][k]) for k in want["replay"])
            if n == max(ns):
                exact = exact and all(torch.equal(want["composed"][k], params[k].view(torch.int16)) for k in params)
            result["bit_exact"] = bool(exact)
            result["speedup_composed"] = round(result["replay_s"] / max(result["composed_s"], 1e-9), 2)
            rows.append(result)
            print(json.dumps(result), flush=True)
        out = {"params": numel, "changed_per_version": args.changed, "hidden": args.hidden, "layers": args.layers,
               "rows": rows}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "catchup.json"), "w") as f:
            json.dump(out, f, indent=1)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(ns, [r["replay_s"] for r in rows], "o-", label="replay (one apply per version)")
        ax.plot(ns, [r["composed_s"] for r in rows], "s-", label="one composed delta")
        ax.set_xlabel("committed versions behind")
        ax.set_ylabel("catch-up seconds")
        ax.set_title(f"catch-up, {numel / 1e6:.0f}M params, {args.changed:.0%} changed/version", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "catchup.png"), dpi=120)
        return 0 if all(r["bit_exact"] for r in rows) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
