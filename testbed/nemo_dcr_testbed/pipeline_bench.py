"""Trainer of the pipelined-refit benchmark (``scripts/bench_pipeline.py``): test bed only.

One trainer process (Megatron-Core GPT under torchrun) runs *phases* the driver asks for,
each a number of optimizer steps back to back -- the trainer does not wait for the driver
between steps, as a real training loop does not:

* ``off``: no refit (the hook is not called; the weights move on uncommitted);
* ``sync``: ``MegatronRefitHook`` with ``refit.pipeline=false`` (the hook returns after
  the joint commit decision of the version it published);
* ``pipelined``: the same hook with ``refit.pipeline=true`` (the hook settles the previous
  version, diffs + projects this one and returns; the rest runs in the background), and
  ``hook.finish()`` after the phase's last step (outside the timed steps).

The mode is switched between phases, when nothing is in flight, by giving the sender a copy
of its configuration with ``pipeline`` set (the one setting that differs); the hook reads it
at every call.  Versions are numbered consecutively over the refits (``hook(trainer)``
without a step), so an ``off`` phase leaves no gap in the chain.

Per step and rank: ``step_s`` = wall of ``trainer.train_step()`` (forward/backward over the
micro-batches, optimizer step, post-step hooks: the refit hook included), ``hook_s`` = wall
of the refit hook call alone (the trainer's pause).  Rank 0 gathers every rank's values at
the end of a phase (one collective, outside the timed steps) and joins them with the stats
of the version each step published (``PublishStats``: diff_s/project_s are the slowest
rank's).

A ``verify`` phase runs a dense refit of the last committed version through
``link_refit._dense_refit``: the receiver (``python -m nemo_dcr_testbed.link_refit
receiver``) loads it into a second model and compares its delta-refit model with it bit for
bit, with a one-bit negative control on its first comparison.

Driver protocol (files in ``--dir``): ``go/<n>.json`` is phase ``n`` (``{"kind": "run",
"mode": ..., "steps": int, "lr": float, "link_mbit": float|None}``, ``{"kind": "verify"}``
or ``{"kind": "stop"}``); after each, rank 0 appends one JSON line to ``phases.jsonl``.

    torchrun --nproc-per-node 2 -m nemo_dcr_testbed.pipeline_bench --config C --dir D
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

MODES = ("off", "sync", "pipelined")
STAT_FIELDS = ("version", "base_version", "changed", "numel", "wire_bytes", "chunks", "diff_s", "project_s",
               "encode_s", "upload_s", "publish_s", "commit_wait_s", "committed", "reason", "pause_s", "refit_s")


def _stats_row(stats) -> dict:
    return {k: getattr(stats, k) for k in STAT_FIELDS}


def _run_phase(trainer, hook, plan: dict, state: dict) -> dict:
    """Collective: ``plan["steps"]`` steps in ``plan["mode"]``; rank 0 returns the phase's row."""
    import torch.distributed as dist

    mode = plan["mode"]
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    for group in trainer.optimizer.param_groups:  # constant lr (no scheduler)
        group["lr"] = float(plan["lr"])
    if mode != "off":
        assert hook.sender.in_flight is None, "a mode switch with a version in flight"
        hook.sender.cfg = dataclasses.replace(hook.sender.cfg, pipeline=(mode == "pipelined"))
    state.update(mode=mode, decided=[], published=None, hook_s=0.0)
    local = []
    for _ in range(int(plan["steps"])):
        state.update(published=None, hook_s=0.0)
        t0 = time.monotonic()
        result = trainer.train_step()
        t1 = time.monotonic()
        local.append({"step": result.step, "loss": result.loss, "t_start": t0, "step_s": t1 - t0,
                      "hook_s": state["hook_s"], "version": state["published"]})
        if dist.get_rank() == 0:  # progress in the trainer's log
            print(f"pipeline_bench: {mode} step {result.step}: {t1 - t0:.2f}s, hook {state['hook_s']:.2f}s",
                  file=sys.stderr, flush=True)
    t0 = time.monotonic()
    if mode == "pipelined":
        last = hook.finish()
        if last is not None:
            state["decided"].append(last)
    finish_s = time.monotonic() - t0
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)  # outside the timed steps
    if dist.get_rank() != 0:
        return {}
    by_version = {s.version: _stats_row(s) for s in state["decided"]}
    steps = []
    for i, mine in enumerate(local):
        per_rank = [r[i] for r in ranks]
        steps.append({"step": mine["step"], "loss": mine["loss"], "t_start": mine["t_start"],
                      "version": mine["version"],
                      "step_s": max(r["step_s"] for r in per_rank), "pause_s": max(r["hook_s"] for r in per_rank),
                      "step_s_ranks": [r["step_s"] for r in per_rank], "pause_s_ranks": [r["hook_s"] for r in per_rank],
                      "stats": by_version.get(mine["version"])})
    return {"kind": "run", "plan": plan, "mode": mode, "steps": steps, "finish_s": finish_s,
            "canonical_numel": hook.sender.canonical_numel, "committed_version": hook.sender.baseline.version}


def trainer_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.pipeline_bench")
    ap.add_argument("--config", required=True, help="resolved DemoConfig as JSON")
    ap.add_argument("--dir", required=True, help="driver directory (go/<n>.json in, phases.jsonl out)")
    ap.add_argument("--driver-pid", type=int, default=0, help="stop when this process is gone")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from nemo_dcr_testbed.config import DemoConfig
    from nemo_dcr_testbed.link_refit import _dense_refit, _wait_json
    from nemo_dcr_testbed.run_trainer import build_trainer

    with open(args.config) as f:
        cfg = DemoConfig.from_dict(json.load(f))
    if cfg.refit.verify_dense:
        raise SystemExit("pipeline_bench trainer: refit.verify_dense must be false (a dense copy per step would "
                         "sit in the timed hook call; the verify phase checks the receivers instead)")
    trainer, hook = build_trainer(cfg)
    state: dict = {"mode": "off", "decided": [], "published": None, "hook_s": 0.0}

    def refit(tr, step):  # post-step hook: right after optimizer.step() wrote the BF16 params
        if state["mode"] == "off":
            return
        t0 = time.monotonic()
        settled = hook(tr)  # the next version number, consecutive over refits
        state["hook_s"] = time.monotonic() - t0
        state["published"] = hook.sender.published_version
        if settled is not None:
            state["decided"].append(settled)

    trainer.add_post_step_hook(refit)
    rank = dist.get_rank()
    n = 0
    while True:
        plan = _wait_json(os.path.join(args.dir, "go", f"{n}.json"), args.driver_pid)
        if plan is None:
            print(f"pipeline_bench trainer: driver {args.driver_pid} is gone; stopping", file=sys.stderr, flush=True)
            return 1
        if plan["kind"] == "stop":
            break
        if plan["kind"] == "verify":
            version = hook.sender.baseline.version
            dense = _dense_refit(hook, version, cfg.refit.receivers, cfg.refit.ack_timeout_s)
            row = {"kind": "verify", "plan": plan, "version": version, "dense": dense}
        else:
            row = _run_phase(trainer, hook, plan, state)
        if rank == 0:
            with open(os.path.join(args.dir, "phases.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        n += 1
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(trainer_main(sys.argv[1:]))
