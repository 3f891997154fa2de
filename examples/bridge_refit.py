"""The refit as a Megatron-Bridge callback, on CPU: Bridge's own callback machinery around the
test bed's megatron-core training step.

Bridge's full ``pretrain()`` cannot run on a CPU-only machine: ``import megatron.bridge``
imports Transformer Engine's torch binding (``megatron/bridge/peft/lora_layers.py``), which
ships only as a source distribution built against CUDA.  For a GPU job on Bridge's
``pretrain(config, forward_step, callbacks=[...])`` see ``examples/bridge_pretrain_refit.py``.

This script registers ``RefitBridgeCallback`` through Megatron-Bridge 0.6.2's own
``callbacks.py`` (taken from the released wheel, sha256 pinned; ``make setup`` puts it in
``.cache/``) and fires its events in the order of Bridge's ``train.py``
(``testbed/nemo_dcr_testbed/bridge_loop.py``: ``on_train_step_end`` before ``train_state.step += 1``,
``on_checkpoint_save`` after a save) around the test bed's megatron-core step on CPU/gloo.
It is the driver ``tests/integration/test_bridge_callback.py`` checks bit for bit.

Trainer (TP=2, main .venv), 4 iterations, a Bridge-layout checkpoint every 2:

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/bridge_refit.py --iters 4 \\
        --ckpt runs/bridge/ckpt --save-interval 2 \\
        refit.store_uri=runs/bridge/store refit.model_id=bridge-demo refit.receivers=[r0]

Receiver (another shell, once ``runs/bridge/store/init/model.safetensors`` exists):

    .venv/bin/nemo-dcr receive --store runs/bridge/store --init-dir runs/bridge/store/init \\
        --receiver-id r0 --model-id bridge-demo --until-version 6

Then the trainer command again with ``--iters 6``: like Bridge it restarts from the latest
checkpoint in ``--ckpt`` (iteration 4); the callback reads the refit's run state from
``runs/bridge/ckpt/iter_0000004/nemo_dcr_refit.json`` and publishes versions 5 and 6 of the
same run.  Version numbers are Bridge's iteration counts.
"""
from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=4, help="Bridge's train.train_iters")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--ckpt", default=None, help="Bridge's checkpoint.save (= checkpoint.load)")
    p.add_argument("--save-interval", type=int, default=0, help="Bridge's checkpoint.save_interval")
    args, overrides = p.parse_known_args()

    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr_testbed import ModelConfig, TrainConfig, Trainer, bridge_loop, bridge_release

    cfg = ModelConfig(vocab_size=1003)
    trainer = Trainer(cfg, TrainConfig(lr=args.lr), tp=args.tp)
    callback = RefitBridgeCallback(overrides=[f"refit.vocab_size={cfg.vocab_size}", *overrides])
    state = bridge_loop.GlobalState()
    state.cfg.checkpoint = bridge_loop.CheckpointConfig(save=args.ckpt, load=args.ckpt,
                                                        save_interval=args.save_interval)
    latest = bridge_loop.latest_checkpoint(args.ckpt) if args.ckpt else None
    if latest is not None:  # what Bridge's setup does before on_train_start
        trainer.load_weights(bridge_loop.checkpoint_name(args.ckpt, latest))
        state.train_state.step = latest

    def step_fn(iteration: int) -> bridge_loop.Iteration:
        r = trainer.train_step()
        return bridge_loop.Iteration(loss_dict={"lm loss": r.loss}, grad_norm=r.grad_norm,
                                     skipped=not r.update_successful)

    bridge_loop.train(bridge=bridge_release.load(), callbacks=[callback], state=state, model=[trainer.model],
                      optimizer=trainer.optimizer, train_iters=args.iters, step_fn=step_fn,
                      save_fn=(lambda directory, step: trainer.save_weights(directory)) if args.ckpt else None)
    trainer.close()


if __name__ == "__main__":
    main()
