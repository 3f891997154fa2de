"""Megatron-Bridge ``pretrain()`` of a Bridge recipe with the refit callback: for a GPU machine.

NOT RUN IN THIS PROJECT.  Its machines have no CUDA, and ``import megatron.bridge`` needs
Transformer Engine's torch binding (``megatron/bridge/peft/lora_layers.py`` imports
``transformer_engine.pytorch`` unconditionally), which is published only as a source
distribution that builds against CUDA.  What is tested here is the callback under Bridge
0.6.2's own callback machinery, fired in its ``train.py`` order around a megatron-core CPU
loop (``tests/integration/test_bridge_callback.py``, ``examples/bridge_refit.py``).

Environment (Python 3.12, CUDA; or a NeMo Framework container that ships Bridge and TE):

    pip install "megatron-bridge[te]==0.6.2"      # brings megatron-core, transformers 5.8-5.12
    pip install --no-deps -e /path/to/nemo-dcr    # keep the environment's torch / megatron-core
    pip install zstandard safetensors hydra-core omegaconf  # nemo-dcr's other core dependencies
    huggingface-cli login                         # the recipe reads meta-llama/Llama-3.2-1B's config

Trainer (one node, 8 GPUs; the recipe's TP/PP/DP and mock data; checkpoints every 50
iterations to a shared directory; versions go to an S3 prefix):

    torchrun --nproc-per-node 8 examples/bridge_pretrain_refit.py --iters 200 --save-interval 50 \\
        --ckpt /shared/llama32-1b/ckpt \\
        refit.store_uri=s3://bucket/llama32-1b refit.model_id=llama32-1b refit.receivers=[r0] \\
        refit.key_file=/shared/refit.key

Receiver, beside it (any machine that reaches the store; this project's main environment,
transformers; ``--runtime vllm`` keeps a vLLM engine current instead):

    nemo-dcr receive --store s3://bucket/llama32-1b --receiver-id r0 --model-id llama32-1b \\
        --key-file /shared/refit.key --until-version 200

Version v is the model after Bridge's iteration v.  Killed and started again with the same
command, Bridge resumes from the latest checkpoint in ``--ckpt`` and the callback continues
the same refit run from the state it saved there (``iter_<step>/nemo_dcr_refit.json``).
Refit metrics (``refit/*``) appear in the recipe's TensorBoard directory (and W&B when
``logger.wandb_project`` is set).
"""
from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200, help="train.train_iters")
    p.add_argument("--save-interval", type=int, default=50, help="checkpoint.save_interval")
    p.add_argument("--ckpt", required=True, help="checkpoint.save and checkpoint.load (a shared directory)")
    args, overrides = p.parse_known_args()

    from megatron.bridge.recipes.llama import llama32_1b_pretrain_config
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from nemo_dcr.integrations.bridge import RefitBridgeCallback

    config = llama32_1b_pretrain_config()
    config.train.train_iters = args.iters
    config.train.global_batch_size = 64
    config.scheduler.lr_warmup_iters = min(config.scheduler.lr_warmup_iters, args.iters // 10)
    config.checkpoint.save = config.checkpoint.load = args.ckpt
    config.checkpoint.save_interval = args.save_interval
    # the recipe's NullTokenizer: Megatron pads the embedding beyond it; receivers get these rows
    callback = RefitBridgeCallback(overrides=[f"refit.vocab_size={config.tokenizer.vocab_size}", *overrides])
    pretrain(config, forward_step, callbacks=[callback])


if __name__ == "__main__":
    main()
