"""The refit as a Megatron-Bridge callback -- by PROTOCOL ONLY.

Megatron-Bridge cannot be installed in this project's environments (it needs Transformer
Engine, and transformers < 5), so nothing here imports Bridge and nothing has been run
inside Bridge's trainer.  ``RefitBridgeCallback`` implements Bridge's callback protocol
(``on_train_start(context)``, ``on_train_step_end(context)``, with ``context.model`` the list
of model chunks and ``context.state.train_state.step`` the step); this script drives it the
way Bridge's training loop would, from the project's own megatron-core CPU loop (the test
bed), at TP=2.  ``tests/integration/test_callbacks.py`` does the same with a receiver
checking every version bit for bit, also with virtual-pipeline chunks (PP=2 x VPP=2).

In a Megatron-Bridge script the callback is one line (a sketch; not run here):

    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    callbacks = [RefitBridgeCallback(overrides=["refit.store_uri=/shared/run7", "refit.receivers=[r0]",
                                                "refit.vocab_size=128256"])]
    # ... hand `callbacks` to Bridge's pretrain / finetune entry point with your ConfigContainer

Here (trainer, TP=2, CPU/gloo, main .venv):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/bridge_refit.py --steps 3 \\
        refit.store_uri=runs/bridge/store refit.model_id=bridge-demo refit.receivers=[r0]

Receiver (another shell, once ``runs/bridge/store/init/model.safetensors`` exists):

    .venv/bin/nemo-dcr receive --store runs/bridge/store --init-dir runs/bridge/store/init \\
        --receiver-id r0 --model-id bridge-demo --until-version 3
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-6)
    args, overrides = p.parse_known_args()

    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr.testbed import ModelConfig, TrainConfig, Trainer

    cfg = ModelConfig(vocab_size=1003)
    trainer = Trainer(cfg, TrainConfig(lr=args.lr), tp=args.tp)
    callback = RefitBridgeCallback(overrides=[f"refit.vocab_size={cfg.vocab_size}", *overrides])
    # what Bridge hands its callbacks: the model chunks, the optimizer, the training state
    context = SimpleNamespace(model=[trainer.model], optimizer=trainer.optimizer, user_state={},
                              state=SimpleNamespace(train_state=SimpleNamespace(step=0)))
    callback.on_train_start(context)
    for _ in range(args.steps):
        result = trainer.train_step()
        context.state.train_state.step = result.step
        callback.on_train_step_end(context)
    trainer.close()


if __name__ == "__main__":
    main()
