"""torchrun worker (2 ranks, TP=2) for test_pipeline_ranks.py: the pipelined hook on a real
megatron-core model, every rank alike.

Usage: torchrun --nproc-per-node 2 pipeline_worker.py OUT_DIR STORE_DIR
Versions 1..3 commit (acks from a stamping thread on rank 0, standing in for receivers: this
worker checks the trainer ranks' agreement, not the receivers, which the demo tests cover);
rank 1's upload fails at version 4 (aborted on both ranks, the next version is diffed
against version 3); rank 0's decision step breaks at version 6 (both ranks raise the same
error at the next call).  Each rank writes what it saw to OUT_DIR/rank<r>.json.
"""
import json
import os
import sys
import threading
import time

import torch.distributed as dist


def stamp_acks(store, sealer, run_id, stop: threading.Event) -> None:
    """Ack every published manifest as receiver r0 (signed): a stand-in receiver."""
    from nemo_dcr.protocol.manifest import HEAD_KEY, Ack, Head, ack_key, doc_digest, manifest_key

    done = set()
    while not stop.is_set():
        try:
            head = Head.from_json(store.get(HEAD_KEY), sealer)
        except Exception:  # noqa: BLE001 - not written yet
            time.sleep(0.01)
            continue
        if head.version not in done:
            digest = doc_digest(store.get(manifest_key(head.version)))
            store.put(ack_key("r0", head.version), Ack(run_id=run_id, receiver="r0", version=head.version, ok=True,
                                                       held_version=head.version,
                                                       manifest_digest=digest).to_json(sealer))
            done.add(head.version)
        time.sleep(0.01)


def tiny_tp2_trainer(out_dir: str):
    """The workers' model under torchrun (2 ranks, gloo): one layer, hidden 64, vocab 256,
    TP=2; and the run's signing key, written by rank 0 into ``out_dir/key``.  Returns
    (trainer, key path)."""
    from nemo_dcr.protocol.signing import new_key_file
    from nemo_dcr_testbed.model import ModelConfig
    from nemo_dcr_testbed.train import TrainConfig, Trainer

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=2,
                      ffn_hidden_size=128, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=64)
    trainer = Trainer(cfg, TrainConfig(lr=3e-4), tp=2)
    key = os.path.join(out_dir, "key")
    if dist.get_rank() == 0:
        new_key_file(key)
    dist.barrier()
    return trainer, key


def main() -> int:
    out_dir, store_dir = sys.argv[1], sys.argv[2]
    from nemo_dcr.errors import ProtocolError
    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr.transport.store import LocalDirStore

    trainer, key = tiny_tp2_trainer(out_dir)
    rank = dist.get_rank()

    class Store(LocalDirStore):
        fail_at: int | None = None

        def put(self, k, data):
            if self.fail_at is not None and k.startswith(f"v/{self.fail_at:08d}/chunks/"):
                raise OSError(f"injected: rank {rank} cannot upload {k}")
            return super().put(k, data)

    store = Store(store_dir)
    sender_cfg = RefitOptions(model_id="pipe", receivers=("r0",), key_file=key, ack_timeout_s=20, ack_poll_s=0.01,
                              chunk_bytes=16 << 10, pipeline=True)
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=sender_cfg, vocab_size=256)
    run_id = hook.export_initial()
    stop = threading.Event()
    if rank == 0:
        threading.Thread(target=stamp_acks, args=(store, hook.sender.sealer, run_id, stop), daemon=True).start()
    seen = {"settled": [], "pause_s": [], "error": None}
    store.fail_at = 4 if rank == 1 else None
    decide = hook.sender.decider.decide if rank == 0 else None

    def broken_at_6(version, *a, **k):
        if version == 6:
            raise RuntimeError("injected: rank 0's decision step broke")
        return decide(version, *a, **k)

    if rank == 0:
        hook.sender.decider.decide = broken_at_6
    for step in range(1, 8):
        trainer.train_step()  # runs the post-step hooks: none registered; the hook is called here
        try:
            settled = hook(step=step)
        except ProtocolError as e:
            seen["error"] = f"{type(e).__name__}: {e}"
            break
        if settled is not None:
            seen["settled"].append([settled.version, settled.base_version, settled.committed, settled.reason])
            seen["pause_s"].append(settled.pause_s)
        seen.setdefault("in_flight", []).append(hook.sender.in_flight)
    seen["baseline"] = hook.sender.baseline.version
    stop.set()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
