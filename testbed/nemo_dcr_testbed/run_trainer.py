"""Trainer processes of the demo: ``torchrun ... -m nemo_dcr_testbed.run_trainer --config C``.

Every rank trains the Megatron-Core model and runs the refit hook after each step; rank 0
appends one JSON line per step to ``<run_dir>/steps.jsonl`` (what ``nemo-dcr demo`` prints).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch.distributed as dist

from nemo_dcr_testbed.config import DemoConfig
from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
from nemo_dcr_testbed.train import Trainer
from nemo_dcr.transport.store import open_store


def build_trainer(cfg: DemoConfig) -> tuple[Trainer, MegatronRefitHook]:
    """Collective (every rank): the megatron-core trainer of ``cfg`` and the refit hook on
    its model, version 0 written to the store.  The hook is not registered yet."""
    par = cfg.parallel
    trainer = Trainer(cfg.model, cfg.train, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                      ep=par.expert_model_parallel_size, first_stage_layers=par.num_layers_in_first_pipeline_stage,
                      last_stage_layers=par.num_layers_in_last_pipeline_stage)
    store = open_store(cfg.store.uri)
    sender_cfg = cfg.refit.refit_options()  # every setting of the refit schema, none mapped by hand
    # the hook sees only the model: family, dims and sharding come from it; the tokenizer's
    # vocabulary size is the one fact the padded model does not hold
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=sender_cfg,
                                        vocab_size=cfg.model.vocab_size, verify_dense=cfg.refit.verify_dense)
    hook.export_initial()
    return trainer, hook


def wait_for_joins(store, cfg: DemoConfig, rank: int) -> None:
    """Collective, a scenario aid of the demo (``refit.late_after``): hold this step until
    every late receiver has written its join request, so the next version admits them."""
    from nemo_dcr.protocol.manifest import join_key

    error = None
    if rank == 0:
        missing = cfg.refit.late_receiver_ids()
        deadline = time.monotonic() + cfg.refit.ack_timeout_s
        while missing and time.monotonic() < deadline:
            missing = [rid for rid in missing if not store.exists(join_key(rid))]
            time.sleep(0.1)
        if missing:
            error = f"late receivers {missing} did not ask to join within {cfg.refit.ack_timeout_s:g}s"
        else:
            print(f"nemo_dcr demo: {cfg.refit.late_receivers} late receiver(s) asked to join", flush=True)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise SystemExit(f"nemo_dcr demo trainer: {box[0]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.run_trainer")
    ap.add_argument("--config", required=True, help="resolved DemoConfig as JSON")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = DemoConfig.from_dict(json.load(f))

    trainer, hook = build_trainer(cfg)
    decided: list = []  # the stats of each version when its decision is settled
    trainer.add_post_step_hook(lambda tr, step: decided.append(hook(tr, step)))
    rank = dist.get_rank()
    steps_path = os.path.join(cfg.run_dir, "steps.jsonl")
    losses: dict[int, float] = {}

    def write_rows() -> None:
        # pipelined (refit.pipeline, the default): a step's row is written when its version
        # is decided, at the next step's hook or at finish(); synchronous: at its own hook
        for stats in filter(None, decided):
            if rank == 0:
                row = {"step": stats.version, "loss": losses.pop(stats.version), "pipeline": cfg.refit.pipeline,
                       "canonical_numel": hook.sender.canonical_numel, "family": hook.family.name, **asdict(stats)}
                with open(steps_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        decided.clear()

    for step in range(1, cfg.steps + 1):
        if cfg.refit.late_receivers and step == cfg.refit.late_after + 2:
            wait_for_joins(hook.store, cfg, rank)
        result = trainer.train_step()
        losses[result.step] = result.loss
        write_rows()
    decided.append(hook.finish())
    write_rows()
    trainer.close()
    return 0


def entry(argv: list[str] | None = None) -> int:
    """``main``, with a refit failure (``DcrError``: a receiver refused, the store failed, a
    setting the refit refuses) as one line on stderr and exit status 1, not a traceback in
    torchrun's log (the demo reports the last error line of ``trainer.log``)."""
    from nemo_dcr.errors import DcrError

    try:
        return main(argv)
    except DcrError as e:
        who = f"rank {dist.get_rank()}" if dist.is_initialized() else "trainer"
        print(f"nemo_dcr demo trainer ({who}): {type(e).__name__}: {' '.join(str(e).split())}",
              file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(entry())
