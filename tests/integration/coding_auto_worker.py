"""torchrun worker (2 ranks, TP=2) for test_coding_auto.py: ``refit.coding=auto`` on a real
megatron-core model, pipelined, with a receiver thread on rank 0 that decodes every chunk
against the canonical bits it holds, applies it and acks with its decode times.

Usage: torchrun --nproc-per-node 2 coding_auto_worker.py OUT_DIR STORE_DIR

Rank 0's chooser is the real one (its probe, its measurements, its projections) except that
its choice is replaced by a fixed cycle (fast, plain, context, ...), so one short run codes
versions under every candidate and switches between them (what auto chooses from which
rates is test_coding_auto.py's unit tests).  Each rank writes OUT_DIR/rank<r>.json: the
coding of every version it published, the decisions it settled, and (rank 0) the
receiver's comparison with the trainer's final canonical state (integer views) and its
negative control, and the codings found in the chunks on the store.
"""
import json
import os
import sys
import threading
import time

import numpy as np
import torch.distributed as dist

VERSIONS = 6
CYCLE = ("fast", "plain", "context")


def bits(t) -> np.ndarray:
    """A tensor's bits as a flat unsigned array (integer view, copied)."""
    from nemo_dcr.dtypes import int_view

    return int_view(t.contiguous().view(-1)).numpy().view(f"u{t.element_size()}").copy()


def receive(store, sealer, run_id, held: dict, stop: threading.Event, log: list) -> None:
    """Apply versions 1, 2, ... to ``held`` (canonical name -> flat bits) in order, acking each."""
    from nemo_dcr.codec import apply_delta_, decode_chunk
    from nemo_dcr.protocol.manifest import Ack, Manifest, ack_key, doc_digest, manifest_key

    v = 1
    while not stop.is_set():
        try:
            raw = store.get(manifest_key(v))
        except Exception:  # noqa: BLE001 - not written yet
            time.sleep(0.01)
            continue
        m = Manifest.from_json(raw, sealer)
        t0 = time.thread_time()
        deltas = [d for c in m.chunks for d in decode_chunk(store.get(c.key), base=held).deltas]
        decode_s = time.thread_time() - t0
        for d in deltas:  # every chunk decoded against the held version before the first write
            apply_delta_(held[d.name], d)
        store.put(ack_key("r0", v), Ack(run_id=run_id, receiver="r0", version=v, ok=True, held_version=v,
                                        manifest_digest=doc_digest(raw),
                                        stats={"decode_cpu_s": decode_s, "fetch_threads": 1,
                                               "download_s": 0.0}).to_json(sealer))
        log.append(v)
        v += 1


def main() -> int:
    out_dir, store_dir = sys.argv[1], sys.argv[2]
    from pipeline_worker import tiny_tp2_trainer

    from nemo_dcr.codec import Coding, read_chunk_index
    from nemo_dcr.sender import coding_choice
    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr.protocol.manifest import Manifest, manifest_key
    from nemo_dcr.transport.store import LocalDirStore

    trainer, key = tiny_tp2_trainer(out_dir)
    rank = dist.get_rank()
    store = LocalDirStore(store_dir)
    sender_cfg = RefitOptions(model_id="auto", receivers=("r0",), key_file=key, ack_timeout_s=30, ack_poll_s=0.01,
                              chunk_bytes=16 << 10, pipeline=True, coding="auto")
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=sender_cfg, vocab_size=256)
    run_id = hook.export_initial()
    v0 = hook.dense_state()  # collective: the canonical state of version 0 on rank 0

    class Cycling(coding_choice.CodingChooser):
        """The real chooser, its choice replaced by CYCLE (rank 0 only: the others must learn
        it from the decision broadcast)."""

        def choose(self, current):
            _, projections = super().choose(current)
            self.history.append(current)
            return CYCLE[(len(self.history) - 1) % len(CYCLE)], projections

    stop = threading.Event()
    held, received = {}, []
    if rank == 0:
        hook.sender.coding.chooser = Cycling(encode_parallel=1)
        held = {name: bits(t) for name, t in v0.items()}
        threading.Thread(target=receive, args=(store, hook.sender.sealer, run_id, held, stop, received),
                         daemon=True).start()
    seen = {"settled": [], "coding": []}
    for step in range(1, VERSIONS + 1):
        trainer.train_step()
        settled = hook(step=step)
        if settled is not None:
            seen["settled"].append([settled.version, settled.committed, settled.coding, settled.next_coding,
                                    sorted(settled.coding_walls)])
    last = hook.finish()
    seen["settled"].append([last.version, last.committed, last.coding, last.next_coding, sorted(last.coding_walls)])
    final = hook.dense_state()  # collective: the trainer's canonical state (every version committed)
    stop.set()
    if rank == 0:
        def equal(a: dict) -> bool:
            return sorted(a) == sorted(final) and all(
                np.array_equal(a[n], bits(final[n])) for n in final)

        seen["received"] = received
        seen["bit_exact"] = equal(held)
        flipped = {n: b.copy() for n, b in held.items()}
        name = sorted(flipped)[0]
        flipped[name][0] ^= 1
        seen["negative_control_detected"] = not equal(flipped)
        seen["changed_vs_v0"] = sum(int(np.count_nonzero(held[n] != bits(v0[n])))
                                    for n in held)
        per_version = {}
        for v in range(1, VERSIONS + 1):
            m = Manifest.from_json(store.get(manifest_key(v)), hook.sender.sealer)
            infos = [i for c in m.chunks for i in read_chunk_index(store.get(c.key)).records]
            per_version[v] = {"context": any(i.context for i in infos),
                              "codings": sorted({Coding(i.coding).name for i in infos})}
        seen["chunks"] = per_version
        seen["history"] = hook.sender.coding.chooser.history
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
