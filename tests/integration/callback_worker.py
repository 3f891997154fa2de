"""torchrun worker (2 ranks) for test_callbacks.py: the test bed's megatron-core training loop
calls a framework callback the way the framework would, and the refit follows.

Usage: torchrun --nproc-per-node 2 callback_worker.py KIND STORE DENSE_DIR STEPS [CKPT_DIR]
KIND ``nemo_save`` / ``nemo_resume``: the NeMo callback, saving a checkpoint (params, FP32
masters, step, the callback's ``state_dict``) to CKPT_DIR after STEPS steps / restarting
from it and training STEPS more.  KIND: ``bridge`` (``RefitBridgeCallback``: ``on_train_start(context)``,
``on_train_step_end(context)`` with a context shaped like Megatron-Bridge's) or ``nemo``
(``RefitCallback``: Lightning's ``on_train_start(trainer, pl_module)`` and
``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)`` with ``pl_module``
holding the model under ``.module`` as NeMo's does), both at TP=2; or ``bridge_vpp``: the
Bridge callback with ``context.model`` = the two model chunks of an interleaved pipeline
(PP=2 x virtual PP=2, 4 layers, one per chunk), trained by megatron's interleaved 1F1B
schedule.  The callback is configured the way a user would: Hydra overrides of
configs/refit.yaml.  After each step the worker also writes the dense reference (full
Megatron tensors gathered and converted by the dense transforms) to
DENSE_DIR/v<step>.safetensors for the test's oracle.
"""
import dataclasses
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

VPP = 2


class InterleavedTrainer:
    """PP=2 x VPP=2 on 2 ranks (TP=1): one megatron DDP-wrapped ``GPTModel`` chunk per virtual
    stage, megatron's mixed-precision AdamW over both, ``forward_backward_pipelining_with_interleaving``.
    The test bed's ``Trainer`` builds one chunk; this reuses its config, batches and loss."""

    def __init__(self, cfg, lr: float):
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from nemo_dcr.testbed import cpu_shim
        from nemo_dcr.testbed.model import init_parallel, padded_vocab_size, transformer_config

        self.cfg = cfg
        init_parallel(1, 2)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(VPP)
        config = dataclasses.replace(transformer_config(cfg, tp=1, pp=2), virtual_pipeline_model_parallel_size=VPP)
        cpu_shim.seed_model_parallel_rng(cfg.seed)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        self.chunks = []
        for vp in range(VPP):
            gpt = GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size(cfg, 1),
                max_sequence_length=cfg.seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                parallel_output=True, share_embeddings_and_output_weights=False,
                position_embedding_type="rope", rotary_base=cfg.rotary_base, vp_stage=vp)
            self.chunks.append(DistributedDataParallel(
                config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                module=Float16Module(config, gpt), disable_bucketing=vp > 0))
        config.finalize_model_grads_func = finalize_model_grads
        self.config = config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.01, decoupled_weight_decay=True,
                            clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16),
            self.chunks)
        self.steps_done = 0

    def _batches(self, step: int):
        from nemo_dcr.testbed import token_batch

        pos = torch.arange(self.cfg.seq_length).unsqueeze(0)
        for mb in range(2):
            tokens, labels = token_batch(data_seed=1, step=step, microbatch=mb, micro_batch_size=1,
                                         seq_length=self.cfg.seq_length, vocab_size=self.cfg.vocab_size)
            yield {"tokens": tokens, "labels": labels, "position_ids": pos}

    def train_step(self) -> int:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_dcr.testbed import Trainer

        step = self.steps_done + 1
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=Trainer._forward_step, data_iterator=[self._batches(step) for _ in self.chunks],
            model=self.chunks, num_microbatches=2, seq_length=self.cfg.seq_length, micro_batch_size=1,
            forward_only=False)
        update_successful, _, _ = self.optimizer.step()
        assert update_successful
        self.steps_done = step
        return step

    def check_global_layers(self, state) -> None:
        """Collective: each chunk's layers landed at their global index (``layer_number``
        counts the virtual stages) in the dense canonical state on rank 0."""
        from nemo_dcr.integrations.megatron_model import unwrap_gpt

        mine = {}
        for chunk in self.chunks:
            for layer in unwrap_gpt(chunk).decoder.layers:
                w = layer.self_attention.linear_proj.weight.detach().clone()
                mine[f"model.layers.{layer.layer_number - 1}.self_attn.o_proj.weight"] = w
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() == 0:
            seen = {k: v for part in gathered for k, v in part.items()}
            assert sorted(seen) == [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(self.cfg.num_layers)]
            for name, w in seen.items():
                assert torch.equal(state[name].view(torch.int16), w.view(torch.int16)), name

    def close(self) -> None:
        from nemo_dcr.testbed.model import destroy_parallel

        destroy_parallel()


def save_checkpoint(trainer, callback, directory: str) -> None:
    """What a framework checkpoint holds for this test: each rank's BF16 params and FP32
    masters, the step, and the callback's state (Lightning saves ``state_dict()`` with it)."""
    import json

    rank = dist.get_rank()
    torch.save({"bf16": {n: p.detach().clone() for n, p in trainer.bf16_params().items()},
                "master": {n: m.detach().clone() for n, m in trainer.master_params().items()},
                "step": trainer.steps_done}, os.path.join(directory, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(directory, "callbacks.json"), "w") as f:
            json.dump({"RefitCallback": callback.state_dict()}, f)
    dist.barrier()


def load_checkpoint(trainer, callback, directory: str) -> None:
    import json

    saved = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"))
    with torch.no_grad():
        for n, p in trainer.bf16_params().items():
            p.copy_(saved["bf16"][n])
        for n, m in trainer.master_params().items():
            m.copy_(saved["master"][n])
    trainer.steps_done = saved["step"]
    with open(os.path.join(directory, "callbacks.json")) as f:
        callback.load_state_dict(json.load(f)["RefitCallback"])


def main() -> None:
    kind, store, dense_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ckpt = sys.argv[5] if len(sys.argv) > 5 else None
    from safetensors.torch import save_file

    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr.integrations.nemo import RefitCallback
    from nemo_dcr.testbed import ModelConfig, TrainConfig, Trainer

    if kind == "bridge_vpp":
        cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, vocab_size=1003, seq_length=16)
        trainer = InterleavedTrainer(cfg, lr=3e-6)
        model = trainer.chunks  # Megatron-Bridge hands callbacks the list of model chunks
    else:
        cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=256, vocab_size=1003, seq_length=32)
        trainer = Trainer(cfg, TrainConfig(lr=3e-6), tp=2)
        model = [trainer.model]
    overrides = [f"refit.store_uri={store}", "refit.model_id=cb", "refit.receivers=[r0]",
                 f"refit.vocab_size={cfg.vocab_size}", "refit.ack_timeout_s=300"]
    if kind.startswith("bridge"):
        callback = RefitBridgeCallback(overrides=overrides)
        context = SimpleNamespace(model=model, optimizer=trainer.optimizer, user_state={},
                                  state=SimpleNamespace(train_state=SimpleNamespace(step=0)))
        callback.on_train_start(context)
    else:
        callback = RefitCallback(overrides=overrides)
        pl_module = SimpleNamespace(module=trainer.model)
        if kind == "nemo_resume":  # a restarted job: weights, step and refit state from the checkpoint
            load_checkpoint(trainer, callback, ckpt)
        callback.on_train_start(SimpleNamespace(global_step=trainer.steps_done), pl_module)
    for _ in range(steps):
        step = trainer.train_step()
        step = step if isinstance(step, int) else step.step
        if kind.startswith("bridge"):
            context.state.train_state.step = step
            callback.on_train_step_end(context)
        else:
            callback.on_train_batch_end(SimpleNamespace(global_step=step), pl_module, None, None, 0)
        state = callback.refit.hook.dense_state()
        if kind == "bridge_vpp":
            trainer.check_global_layers(state)
        if dist.get_rank() == 0:
            assert callback.refit.hook.last_stats.committed
            save_file(state, os.path.join(dense_dir, f"v{step}.safetensors"))
    if kind == "nemo_save":
        save_checkpoint(trainer, callback, ckpt)
    trainer.close()


if __name__ == "__main__":
    main()
