"""torchrun worker (TP=2) for test_callbacks.py: the test bed's megatron-core training loop
calls a framework callback the way the framework would, and the refit follows.

Usage: torchrun --nproc-per-node 2 callback_worker.py KIND STORE DENSE_DIR STEPS
KIND: ``bridge`` (``RefitBridgeCallback``: ``on_train_start(context)``,
``on_train_step_end(context)`` with a context shaped like Megatron-Bridge's) or ``nemo``
(``RefitCallback``: Lightning's ``on_train_start(trainer, pl_module)`` and
``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)`` with ``pl_module``
holding the model under ``.module`` as NeMo's does).  The callback is configured the way a
user would: Hydra overrides of configs/refit.yaml.  After each step the worker also writes
the dense reference (full Megatron tensors gathered and converted by the dense transforms)
to DENSE_DIR/v<step>.safetensors for the test's oracle.
"""
import os
import sys
from types import SimpleNamespace

import torch.distributed as dist


def main() -> None:
    kind, store, dense_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    from safetensors.torch import save_file

    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr.integrations.nemo import RefitCallback
    from nemo_dcr.testbed import ModelConfig, TrainConfig, Trainer

    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=256, vocab_size=1003, seq_length=32)
    trainer = Trainer(cfg, TrainConfig(lr=3e-6), tp=2)
    overrides = [f"refit.store_uri={store}", "refit.model_id=cb", "refit.receivers=[r0]",
                 f"refit.vocab_size={cfg.vocab_size}", "refit.ack_timeout_s=300"]
    if kind == "bridge":
        callback = RefitBridgeCallback(overrides=overrides)
        context = SimpleNamespace(model=[trainer.model], optimizer=trainer.optimizer, user_state={},
                                  state=SimpleNamespace(train_state=SimpleNamespace(step=0)))
        callback.on_train_start(context)
    else:
        callback = RefitCallback(overrides=overrides)
        pl_module = SimpleNamespace(module=trainer.model)
        callback.on_train_start(SimpleNamespace(global_step=0), pl_module)
    for _ in range(steps):
        result = trainer.train_step()
        if kind == "bridge":
            context.state.train_state.step = result.step
            callback.on_train_step_end(context)
        else:
            callback.on_train_batch_end(SimpleNamespace(global_step=result.step), pl_module, None, None, 0)
        state = callback.refit.hook.dense_state()
        if dist.get_rank() == 0:
            assert callback.refit.hook.last_stats.committed
            save_file(state, os.path.join(dense_dir, f"v{result.step}.safetensors"))
    trainer.close()


if __name__ == "__main__":
    main()
