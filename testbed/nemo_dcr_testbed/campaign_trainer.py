"""Trainer ranks of the fault campaign: ``torchrun --nproc-per-node=2 -m
nemo_dcr_testbed.campaign_trainer --dir D --store URI``.

A tiny megatron-core model (TP=2, gloo) with the product's ``MegatronRefitHook`` on a
:class:`~nemo_dcr_testbed.faults.FaultyStore`.  Step ``s`` (= version ``s``) is taken only
once the driver wrote ``D/go/<s>`` (after ``D/plan/v<s>.json``); before the refit, rank 0
writes the trainer's canonical dense state of the step to ``D/dense/v<s>.safetensors``,
and after the joint commit one JSON row to ``D/steps.jsonl``.  ``D/stop`` ends the run.

``--pipeline`` (the pipelined-refit epochs: ``--classes pipeline``): the hook runs with
``refit.pipeline=true`` (and ``--membership elastic`` with its settings), is called without
a step number (each version is one past the last number in use, so a resumed run goes on
above every number an earlier incarnation used), and version ``v`` waits for ``D/go/<v>``.
Right after the hook call of ``v`` the trainer takes a checkpoint's run state
(``hook.run_state()``, which waits for ``v``, in flight, to be decided); when ``v``
committed it writes a checkpoint ``D/ckpt/v<v>/`` (every rank's ``save_weights`` + the
run state with ``weights_version=v``, in a temporary directory renamed into place, then
``D/ckpt/LATEST`` replaced atomically): only committed steps are resumable.  The row of
``v`` is written once its decision is known there; the stats of ``v`` (with the reason),
which the hook returns at the next call, go to ``D/settled.jsonl``.  ``--resume`` starts
from ``D/ckpt/LATEST`` (``load_weights`` + ``hook.resume(RunState.from_dict(...))``)
instead of exporting version 0; ``D/ready-<incarnation>.json`` names the next version.
When ``D/exit/<v>`` exists (the campaign's exit_without_finish), every rank leaves the loop
right after the hook call of ``v`` (``v`` in flight) with ``sys.exit(0)``, after the
file's ``delay_s``, and calls neither ``finish()`` nor anything else of the hook: what
Megatron-Bridge's ``train.py`` does on ``exit_duration_in_mins`` (``sys.exit`` before
``on_train_end``).
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
    from nemo_dcr_testbed.model import ModelConfig

    return ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=2,
                       ffn_hidden_size=128, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.campaign_trainer")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--ack-timeout-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline", action="store_true", help="the pipelined refit, checkpointed at committed steps")
    ap.add_argument("--membership", choices=("static", "elastic"), default="static")
    ap.add_argument("--min-receivers", type=int, default=1)
    ap.add_argument("--evict-after", type=int, default=3)
    ap.add_argument("--resume", action="store_true", help="--pipeline: continue the run of D/ckpt/LATEST")
    ap.add_argument("--incarnation", type=int, default=1)
    args = ap.parse_args(argv)

    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr.protocol.signing import load_key
    from nemo_dcr_testbed.faults import FaultyStore, Plans
    from nemo_dcr_testbed.train import TrainConfig, Trainer
    from nemo_dcr.transport.store import open_store

    trainer = Trainer(model_config(), TrainConfig(lr=3e-4, data_seed=args.seed), tp=2)
    rank = dist.get_rank()
    restored = None
    if args.pipeline and args.resume:
        # the weights first: the hook's committed baseline is a copy of the parameters as they
        # are when it is built (built before the load, it would diff against the fresh init)
        restored = load_checkpoint(args.dir, trainer)
    store = FaultyStore(open_store(args.store), Plans(os.path.join(args.dir, "plan"), f"rank{rank}"), load_key(None))
    cfg = RefitOptions(model_id=MODEL_ID, receivers=RECEIVERS, chunk_bytes=256 << 10, upload_workers=2,
                       ack_timeout_s=args.ack_timeout_s, ack_poll_s=0.02, on_refusal="retry",
                       max_consecutive_failures=1_000_000, pipeline=args.pipeline,  # sync: one trial = one decided step
                       membership=args.membership, min_receivers=args.min_receivers, evict_after=args.evict_after)
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=cfg, vocab_size=256)
    dense_dir = os.path.join(args.dir, "dense")
    os.makedirs(dense_dir, exist_ok=True)

    def dump_dense(version: int) -> None:
        state = hook.dense_state()  # collective
        if rank == 0:
            path = os.path.join(dense_dir, f"v{version}.safetensors")
            save_file({k: v.contiguous() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)

    if args.pipeline:
        return pipelined(args, trainer, hook, dump_dense, restored)
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


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def load_checkpoint(directory: str, trainer):
    """Every rank: the weights of ``directory/ckpt/LATEST``; returns (its run state, where)."""
    from nemo_dcr.protocol.history import RunState

    with open(os.path.join(directory, "ckpt", "LATEST")) as f:
        where = json.load(f)
    path = os.path.join(directory, "ckpt", where["dir"])
    trainer.load_weights(path)
    with open(os.path.join(path, "state.json")) as f:
        return RunState.from_dict(json.load(f)), where


def pipelined(args, trainer, hook, dump_dense, restored) -> int:
    """The loop of a pipelined epoch (module docstring)."""
    import dataclasses
    import shutil

    from nemo_dcr.protocol.history import RunState

    rank = dist.get_rank()
    ckpt_root = os.path.join(args.dir, "ckpt")
    latest = os.path.join(ckpt_root, "LATEST")

    def checkpoint(version: int, state: RunState) -> None:
        """Collective: weights of every rank + the run state, in place only when complete."""
        tmp = os.path.join(ckpt_root, f"v{version}.tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        trainer.save_weights(tmp)
        dist.barrier()
        if rank == 0:
            _write_json(os.path.join(tmp, "state.json"), dataclasses.replace(state, weights_version=version).to_dict())
            os.replace(tmp, os.path.join(ckpt_root, f"v{version}"))
            _write_json(latest, {"dir": f"v{version}", "version": version})
        dist.barrier()

    resumed_from = None
    if args.resume:
        state, where = restored
        try:
            hook.resume(state)  # collective; refused on every rank alike
        except Exception as e:  # noqa: BLE001 - the driver reads the refusal
            if rank == 0:
                _write_json(os.path.join(args.dir, f"refused-{args.incarnation}.json"),
                            {"error": f"{type(e).__name__}: {e}", "checkpoint": where})
            trainer.close()
            return 3
        resumed_from = state.committed_version
        committed = state.committed_version
    else:
        if rank == 0:
            os.makedirs(ckpt_root, exist_ok=True)
        dump_dense(0)
        hook.export_initial()
        committed = 0
        checkpoint(0, hook.run_state())
    trainer.add_post_step_hook(lambda tr, step: dump_dense(hook.sender.published_version + 1))
    settled: list = []
    trainer.add_post_step_hook(lambda tr, step: settled.append(hook()))  # numbered past every version in use
    steps_path = os.path.join(args.dir, "steps.jsonl")
    if rank == 0:
        _write_json(os.path.join(args.dir, f"ready-{args.incarnation}.json"),
                    {"run_id": hook.run_id, "next_version": hook.sender.published_version + 1,
                     "committed": committed, "resumed_from": resumed_from, "pid": os.getpid()})
    while True:
        v = hook.sender.published_version + 1
        go = os.path.join(args.dir, "go", str(v))
        while not os.path.exists(go):
            if os.path.exists(os.path.join(args.dir, "stop")):
                hook.finish()
                trainer.close()
                return 0
            time.sleep(0.01)
        settled.clear()
        trainer.train_step()  # returns with v in flight
        t_returned = time.time()
        exit_at = os.path.join(args.dir, "exit", str(v))
        if os.path.exists(exit_at):  # a job's time limit: out without finish(), v in flight
            with open(exit_at) as f:
                time.sleep(json.load(f)["delay_s"])
            sys.exit(0)
        state = hook.run_state()  # waits for v's decision
        ok = state.committed_version == v
        if ok:
            checkpoint(v, state)
        if rank == 0:
            s = settled[0] if settled else None  # the previous version's stats, settled by this call
            if s is not None:
                with open(os.path.join(args.dir, "settled.jsonl"), "a") as f:
                    f.write(json.dumps({"version": s.version, "committed": s.committed, "reason": s.reason,
                                        "changed": s.changed, "chunks": s.chunks, "joined": list(s.joined),
                                        "evicted": list(s.evicted), "members": list(s.members)}) + "\n")
            row = {"step": trainer.steps_done, "version": v, "base_version": committed, "committed": ok,
                   "reason": "" if ok else "aborted (the reason is in settled.jsonl at the next version)",
                   "changed": None, "chunks": None, "t_returned": t_returned, "t_decided": time.time(),
                   "checkpoint": ok, "incarnation": args.incarnation}
            with open(steps_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        committed = state.committed_version


if __name__ == "__main__":
    sys.exit(main())
