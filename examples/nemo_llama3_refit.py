"""A NeMo 2 recipe (``llm.llama3_8b.pretrain_recipe``, shrunk to a tiny Llama 3) with the
refit callback appended the way a user would, launched with torchrun.

The NeMo side runs in its own virtualenv (``make setup-nemo`` builds ``.venv-nemo`` with
``nemo-dcr[nemo]``: NeMo 2.7.3 pins transformers 4.x, the project's main ``.venv`` has 5.x);
receivers run in the main ``.venv``.  Trainer (TP=2, CPU/gloo), from the repository root:

    .venv-nemo/bin/torchrun --standalone --nproc-per-node 2 examples/nemo_llama3_refit.py \\
        --tp 2 --steps 3 --log-dir runs/nemo/logs \\
        refit.store_uri=runs/nemo/store refit.model_id=nemo-llama3 refit.receivers=[r0]

Receiver (another shell, once ``runs/nemo/store/init/model.safetensors`` exists):

    .venv/bin/nemo-dcr receive --store runs/nemo/store --init-dir runs/nemo/store/init \\
        --receiver-id r0 --model-id nemo-llama3 --until-version 3

The recipe's TensorBoard logger is kept: every version's ``refit/*`` scalars (pause, wall,
wire bytes, compression, changed %, committed, receivers) land at step = the version next to
NeMo's ``reduced_train_loss``, under ``--log-dir`` (``tensorboard --logdir runs/nemo/logs``).

TP=2 x DP=2 is ``--nproc-per-node 4 ... --tp 2 --dp 2``; PP=2 x virtual PP=2 is
``--nproc-per-node 2 ... --tp 1 --pp 2 --vpp 2`` (4 layers, one per model chunk).  Arguments of the form
``refit.KEY=VALUE`` are Hydra overrides of ``nemo_dcr/configs/refit.yaml`` (the callback's settings);
``--set KEY=VALUE`` sets any recipe field by its dotted path (``--set trainer.max_steps=5``),
NeMo-run style.  ``refit.vocab_size`` is set here from the recipe's tokenizer.

On a CPU-only machine the script applies the test bed's CPU patches for NeMo and megatron-core
first (``testbed/nemo_dcr_testbed/nemo_cpu.py``, listed in ``docs/megatron-on-cpu.md``); with CUDA it
runs the recipe as it is (drop the CPU-only overrides in ``tiny_llama3_recipe``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

# What the tiny model is (the recipe's Llama3Config8B with these fields replaced).
TINY = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
            num_query_groups=2, kv_channels=32, seq_length=64)
VOCAB = 1000  # NullTokenizer(VOCAB): token ids 0..VOCAB (VOCAB + 1 ids, EOD included)


def tiny_llama3_recipe(*, tp: int, dp: int, steps: int, log_dir: str, lr: float = 1e-5, pp: int = 1,
                       vpp: int = 1):
    """``llm.llama3_8b.pretrain_recipe`` with a tiny model, mock data and CPU settings.
    ``pp`` pipeline stages of ``vpp`` virtual stages each (one layer per virtual stage when
    that is more than two)."""
    import nemo_run as run
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

    on_cpu = not torch.cuda.is_available()
    recipe = llm.llama3_8b.pretrain_recipe(dir=log_dir, name="tiny_llama3", num_nodes=1,
                                           num_gpus_per_node=tp * pp * dp)
    for k, v in TINY.items():
        setattr(recipe.model.config, k, v)
    recipe.model.config.num_layers = max(TINY["num_layers"], pp * vpp)
    tokenizer = run.Config(NullTokenizer, vocab_size=VOCAB)
    recipe.data = run.Config(llm.MockDataModule, seq_length=TINY["seq_length"], micro_batch_size=1,
                             global_batch_size=2 * pp * dp, tokenizer=tokenizer, num_workers=0, pin_memory=False)
    # the model's own tokenizer too: NeMo rebuilds the model for each virtual pipeline stage
    # from its constructor arguments, where the data module's tokenizer is not seen
    recipe.model.tokenizer = tokenizer
    recipe.trainer.max_steps = steps
    recipe.trainer.strategy.tensor_model_parallel_size = tp
    recipe.trainer.strategy.context_parallel_size = 1  # the recipe's default is 2
    if pp > 1:
        recipe.trainer.strategy.pipeline_model_parallel_size = pp
        recipe.trainer.strategy.pipeline_dtype = torch.bfloat16
    if vpp > 1:
        recipe.trainer.strategy.virtual_pipeline_model_parallel_size = vpp
    recipe.trainer.log_every_n_steps = 1
    recipe.trainer.num_sanity_val_steps = 0
    recipe.trainer.limit_val_batches = 0
    recipe.trainer.enable_checkpointing = False
    recipe.log.ckpt = None
    recipe.resume = None
    recipe.optim.config.lr = lr
    recipe.optim.lr_scheduler.warmup_steps = 0  # the 2000-step warm-up would start at lr 0
    recipe.optim.lr_scheduler.min_lr = lr
    if on_cpu:
        recipe.trainer.accelerator = "cpu"
        recipe.trainer.strategy.ckpt_async_save = False
        for fusion in ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm",
                       "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion",
                       "gradient_accumulation_fusion"):
            setattr(recipe.model.config, fusion, False)  # CUDA kernels (Apex / TE)
        # draw each full weight on the CPU, then keep this rank's slice (CUDA-free init)
        recipe.model.config.use_cpu_initialization = True
    return recipe


def vocab_size() -> int:
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

    return NullTokenizer(VOCAB).vocab_size


def _set(cfg, dotted: str, value: str) -> None:
    import ast

    *path, last = dotted.split(".")
    for p in path:
        cfg = getattr(cfg, p)
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    setattr(cfg, last, parsed)


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per pipeline stage")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--log-dir", default="runs/nemo/logs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe field override")
    args, rest = p.parse_known_args(argv)
    refit = [a for a in rest if a.startswith(("refit.", "+refit."))]
    unknown = [a for a in rest if a not in refit]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, refit


def build(argv: list[str]):
    """The recipe with the refit callback appended (what ``main`` runs)."""
    import nemo_run as run

    from nemo_dcr.integrations.nemo import RefitCallback

    args, refit_overrides = parse_args(argv)
    recipe = tiny_llama3_recipe(tp=args.tp, dp=args.dp, pp=args.pp, vpp=args.vpp, steps=args.steps,
                                log_dir=args.log_dir, lr=args.lr)
    for item in args.set:
        key, _, value = item.partition("=")
        _set(recipe, key, value)
    recipe.trainer.callbacks.append(run.Config(
        RefitCallback, overrides=[f"refit.vocab_size={vocab_size()}", *refit_overrides]))
    return recipe


def main(argv: list[str] | None = None) -> None:
    import nemo_run as run

    if not torch.cuda.is_available():
        from nemo_dcr_testbed import nemo_cpu

        nemo_cpu.apply()
    recipe = build(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("NEMO_RUN_DIR", os.path.abspath(os.path.join(recipe.log.log_dir or ".", ".nemo_run")))
    run.run(recipe, direct=True)


if __name__ == "__main__":
    main()
