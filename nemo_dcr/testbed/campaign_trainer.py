"""Trainer ranks of the fault campaign: ``torchrun --nproc-per-node=2 -m
nemo_dcr.testbed.campaign_trainer --dir D --store URI``.

A tiny megatron-core model (TP=2, gloo) with the product's ``MegatronRefitHook`` on a
:class:`~nemo_dcr.testbed.faults.FaultyStore`.  Step ``s`` (= version ``s``) is taken only
once the driver wrote ``D/go/<s>`` (after ``D/plan/v<s>.json``); before the refit, rank 0
writes the trainer's canonical dense state of the step to ``D/dense/v<s>.safetensors``,
and after the joint commit one JSON row to ``D/steps.jsonl``.  ``D/stop`` ends the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist
from safetensors.torch import save_file

MODEL_ID = "fault-campaign"
RECEIVERS = ("r0", "r1")


def model_config():
    from nemo_dcr.testbed.model import ModelConfig

    return ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=2,
                       ffn_hidden_size=128, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr.testbed.campaign_trainer")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--ack-timeout-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.integrations.sender import SenderConfig
    from nemo_dcr.protocol.signing import load_key
    from nemo_dcr.testbed.faults import FaultyStore, Plans
    from nemo_dcr.testbed.train import TrainConfig, Trainer
    from nemo_dcr.transport.store import open_store

    trainer = Trainer(model_config(), TrainConfig(lr=3e-4, data_seed=args.seed), tp=2)
    rank = dist.get_rank()
    store = FaultyStore(open_store(args.store), Plans(os.path.join(args.dir, "plan"), f"rank{rank}"), load_key(None))
    cfg = SenderConfig(model_id=MODEL_ID, receivers=RECEIVERS, chunk_bytes=256 << 10, upload_workers=2,
                       ack_timeout_s=args.ack_timeout_s, ack_poll_s=0.02, on_refusal="retry",
                       max_consecutive_failures=1_000_000, pipeline=False)  # one trial = one decided step
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=cfg, vocab_size=256)
    dense_dir = os.path.join(args.dir, "dense")
    os.makedirs(dense_dir, exist_ok=True)

    def dump_dense(version: int) -> None:
        state = hook.dense_state()  # collective
        if rank == 0:
            path = os.path.join(dense_dir, f"v{version}.safetensors")
            save_file({k: v.contiguous() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)

    dump_dense(0)
    run_id = hook.export_initial()
    trainer.add_post_step_hook(lambda tr, step: dump_dense(step))
    trainer.add_post_step_hook(hook)
    if rank == 0:
        with open(os.path.join(args.dir, "ready.json"), "w") as f:
            json.dump({"run_id": run_id}, f)
    steps_path = os.path.join(args.dir, "steps.jsonl")
    step = 0
    while True:
        step += 1
        go = os.path.join(args.dir, "go", str(step))
        while not os.path.exists(go):
            if os.path.exists(os.path.join(args.dir, "stop")):
                trainer.close()
                return 0
            time.sleep(0.01)
        trainer.train_step()
        if rank == 0:
            s = hook.last_stats
            row = {"step": step, "version": s.version, "base_version": s.base_version, "committed": s.committed,
                   "reason": s.reason, "changed": s.changed, "chunks": s.chunks, "wire_bytes": s.wire_bytes,
                   "commit_wait_s": s.commit_wait_s, "t_decided": time.time()}
            with open(steps_path, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
