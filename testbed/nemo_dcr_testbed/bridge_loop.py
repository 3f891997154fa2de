"""Megatron-Bridge 0.6.2's training loop as its callbacks see it, around the test bed's step.

``train()`` follows ``megatron/bridge/training/train.py`` event by event, through Bridge's
own ``CallbackManager`` / ``CallbackContext`` / ``should_fire`` (``bridge_release.load()``):

1. ``on_train_start`` (after any checkpoint restored ``train_state.step``);
2. per iteration: ``on_train_step_start``; the step; ``on_train_step_end`` with ``loss_dict``,
   ``grad_norm`` and ``skipped_iter=bool(...)``; THEN ``train_state.step += 1``; then, every
   ``save_interval`` iterations, the checkpoint save followed by ``on_checkpoint_save``.

What Bridge does beyond that (evaluation, logging, timers, rerun machine, async saves) is
not here.  ``GlobalState`` stands in for Bridge's: the fields callbacks read
(``train_state.step``, ``cfg.checkpoint.{save,load,async_save}``, ``tensorboard_logger``,
``wandb_logger``).  A checkpoint is laid out the way Bridge lays it out where the refit
callback looks: ``<save>/iter_<step:07d>/`` (``get_checkpoint_name``) and the tracker
``<save>/latest_checkpointed_iteration.txt`` (written after the directory, before the event);
what goes inside the directory is the caller's ``save_fn``.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class TrainState:
    step: int = 0
    """Iterations completed (Bridge restores it from a checkpoint before ``on_train_start``)."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Where checkpoints are written (``iter_<step:07d>`` directories)."""
    load: str | None = None
    """Where a restarted job loads from (Bridge's recipes set it to ``save``)."""
    save_interval: int = 0
    """Save every this many iterations (0: never)."""
    async_save: bool = False
    """Always False here: saves are synchronous."""


@dataclass
class Config:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class GlobalState:
    cfg: Config = field(default_factory=Config)
    train_state: TrainState = field(default_factory=TrainState)
    tensorboard_logger: Any = None
    """Bridge sets a ``SummaryWriter`` on the last rank when ``logger.tensorboard_dir`` is set."""
    wandb_logger: Any = None
    """Bridge sets a W&B run on the last rank when ``logger.wandb_project`` is set."""


@dataclass(frozen=True)
class Iteration:
    """What Bridge's ``train_step`` reports to ``on_train_step_end``."""

    loss_dict: dict
    grad_norm: float | None
    skipped: bool
    """The optimizer made no update (fp16 overflow, non-finite gradients)."""


def checkpoint_name(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_checkpoint(root: str) -> int | None:
    """The step in Bridge's tracker under ``root`` (None: no checkpoint)."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def train(*, bridge, callbacks, state: GlobalState, model: list, optimizer, train_iters: int,
          step_fn: Callable[[int], Iteration], save_fn: Callable[[str, int], None] | None = None,
          after_step_end: Callable[[int, Iteration], None] | None = None,
          after_checkpoint: Callable[[int], None] | None = None, exit_after: int = 0) -> None:
    """Run iterations until ``state.train_state.step == train_iters``.

    bridge: Bridge's callbacks module; callbacks: what ``pretrain(..., callbacks=...)`` takes.
    step_fn(iteration): run iteration ``train_state.step + 1`` (1-based) on every rank.
    save_fn(directory, step): write this rank's part of the checkpoint into ``directory``
        (created before the call); rank 0 then writes the tracker, and every rank meets at a
        barrier before ``on_checkpoint_save`` (Bridge's ``_post_save_global_barrier``).
    after_step_end(iteration, result): the caller's own check after ``on_train_step_end``.
    after_checkpoint(step): after ``on_checkpoint_save`` (e.g. a test kills the job there).
    exit_after: Bridge's exit condition (``exit_interval``, ``exit_duration_in_mins``, a
        signal) is met after this iteration (0: never): as ``train.py`` does, the loop breaks
        after the iteration's checkpoint and ``sys.exit(0)`` is called BEFORE ``on_train_end``.
    """
    import torch.distributed as dist

    manager = bridge.normalize_callbacks(callbacks)

    def fire(event: str, **extra) -> None:
        if bridge.should_fire(manager, event):
            manager.fire(event, bridge.CallbackContext(state=state, model=model, user_state=manager.user_state,
                                                       optimizer=optimizer, **extra))

    fire("on_train_start")
    interval = state.cfg.checkpoint.save_interval
    while state.train_state.step < train_iters:
        fire("on_train_step_start")
        result = step_fn(state.train_state.step + 1)
        fire("on_train_step_end", loss_dict=result.loss_dict, grad_norm=result.grad_norm,
             skipped_iter=bool(result.skipped))
        if after_step_end is not None:
            after_step_end(state.train_state.step + 1, result)
        state.train_state.step += 1
        step = state.train_state.step
        if save_fn is not None and interval and step % interval == 0:
            root = state.cfg.checkpoint.save
            directory = checkpoint_name(root, step)
            os.makedirs(directory, exist_ok=True)
            save_fn(directory, step)
            if dist.is_initialized():
                dist.barrier()
            if not dist.is_initialized() or dist.get_rank() == 0:
                with open(os.path.join(root, TRACKER), "w") as f:
                    f.write(str(step))
            if dist.is_initialized():
                dist.barrier()
            fire("on_checkpoint_save")
            if after_checkpoint is not None:
                after_checkpoint(step)
        if exit_after and step >= exit_after:  # train.py's checkpoint_and_decide_exit: break, then sys.exit
            break
    if exit_after and state.train_state.step >= exit_after:
        import sys

        sys.exit(0)  # train.py: `if should_exit: ... sys.exit(exit_code)`, on_train_end never fires
    fire("on_train_end")  # Bridge 0.6.2's train(): after the loop and its final save
