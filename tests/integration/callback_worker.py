"""torchrun worker (2 ranks) for test_callbacks.py and test_bridge_callback.py: the test bed's
megatron-core training loop calls a framework callback the way the framework does, and the
refit follows.

Usage: torchrun --nproc-per-node 2 callback_worker.py KIND --store S --dense D --iters N [options]

KIND ``nemo``: ``RefitCallback`` (Lightning's ``on_train_start(trainer, pl_module)``,
``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)`` and, after the loop,
``on_train_end(trainer, pl_module)``; ``pl_module`` holding the model under ``.module`` as
NeMo's does), TP=2; ``nemo_save`` / ``nemo_resume``: the same, saving a checkpoint (params,
FP32 masters, step, the callback's ``state_dict``) to ``--ckpt`` after the steps, before
``on_train_end`` as Lightning's checkpoint callback does / restarting from it.  The stand-in
trainer has ``is_global_zero`` and ``loggers``: every rank has a recording logger with
Lightning's ``log_metrics(metrics, step)`` / ``save()`` that appends to ``D/metrics.jsonl``
(sink ``lightning``, with the rank), so a rank other than 0 logging would show.

KIND ``bridge`` (TP=2) and ``bridge_vpp`` (``context.model`` = the two model chunks of an
interleaved pipeline, PP=2 x virtual PP=2, 4 layers, one per chunk, trained by megatron's
interleaved 1F1B schedule): ``RefitBridgeCallback`` registered through Megatron-Bridge
0.6.2's own ``callbacks.py`` and fired in its ``train.py`` order
(``testbed/nemo_dcr_testbed/bridge_loop.py``): ``train_state.step`` is incremented AFTER
``on_train_step_end``.  ``--skip I``: iteration I is skipped (``skipped_iter=True``; the
optimizer makes no update, so the params are left as they are).  ``--ckpt DIR
--save-interval N``: a checkpoint every N iterations in Bridge's layout
(``DIR/iter_<step:07d>/``: each rank's BF16 params, FP32 masters and optimizer step count;
the tracker; ``on_checkpoint_save`` after it); a job finding a checkpoint in DIR restarts
from it, as Bridge does with ``checkpoint.load = checkpoint.save``.  ``--kill-after-save S``:
every rank SIGKILLs itself right after the checkpoint of iteration S.  The last rank has
recording TensorBoard and W&B loggers (where Bridge puts them) that append what they get to
``D/metrics.jsonl``.

The callback is configured the way a user would: Hydra overrides of nemo_dcr/configs/refit.yaml.
After every iteration that should publish a version (Bridge kinds: not skipped, a multiple
of ``--every-n``; NeMo kinds: every step) the worker checks the version number and the commit,
and writes the dense reference (full Megatron tensors gathered and converted by the dense
transforms) to D/v<version>.safetensors for the test's oracle.
"""
import argparse
import dataclasses
import json
import os
import signal
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

        from nemo_dcr_testbed import cpu_shim
        from nemo_dcr_testbed.model import init_parallel, padded_vocab_size, transformer_config

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
        from nemo_dcr_testbed import token_batch

        pos = torch.arange(self.cfg.seq_length).unsqueeze(0)
        for mb in range(2):
            tokens, labels = token_batch(data_seed=1, step=step, microbatch=mb, micro_batch_size=1,
                                         seq_length=self.cfg.seq_length, vocab_size=self.cfg.vocab_size)
            yield {"tokens": tokens, "labels": labels, "position_ids": pos}

    def train_step(self) -> int:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_dcr_testbed import Trainer

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
        from nemo_dcr_testbed.model import destroy_parallel

        destroy_parallel()


def save_checkpoint(trainer, callback, directory: str) -> None:
    """What a framework checkpoint holds for this test: each rank's BF16 params and FP32
    masters, the step, and the callback's state (Lightning saves ``state_dict()`` with it)."""
    trainer.save_weights(directory)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "callbacks.json"), "w") as f:
            json.dump({"RefitCallback": callback.state_dict()}, f)
    dist.barrier()


def load_checkpoint(trainer, callback, directory: str) -> None:
    trainer.load_weights(directory)
    with open(os.path.join(directory, "callbacks.json")) as f:
        callback.load_state_dict(json.load(f)["RefitCallback"])


class RecordingLogger:
    """Stands in for Bridge's TensorBoard ``SummaryWriter`` and W&B run: appends each call to
    a JSONL file."""

    def __init__(self, path: str, sink: str):
        self.path, self.sink = path, sink

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"sink": self.sink, **row}) + "\n")

    def add_scalar(self, tag, value, step):  # SummaryWriter
        self._write({"tag": tag, "value": value, "step": step})

    def log(self, data, step=None):  # wandb.Run
        self._write({"data": data, "step": step})


class LightningRecordingLogger(RecordingLogger):
    """Stands in for a Lightning logger (``Logger.log_metrics`` / ``save``) on one rank."""

    def __init__(self, path: str):
        super().__init__(path, "lightning")
        self.saves = 0

    def log_metrics(self, metrics, step=None):
        self._write({"rank": dist.get_rank(), "data": metrics, "step": step})

    def save(self):
        self.saves += 1


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["nemo", "nemo_save", "nemo_resume", "bridge", "bridge_vpp"])
    p.add_argument("--store", required=True)
    p.add_argument("--dense", required=True)
    p.add_argument("--iters", type=int, required=True, help="steps to train (Bridge: train_iters)")
    p.add_argument("--ckpt")
    p.add_argument("--skip", type=int, action="append", default=[])
    p.add_argument("--every-n", type=int, default=1)
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--kill-after-save", type=int, default=0)
    return p.parse_args()


def build(kind: str):
    from nemo_dcr_testbed import ModelConfig, TrainConfig, Trainer

    if kind == "bridge_vpp":
        cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, vocab_size=1003, seq_length=16)
        trainer = InterleavedTrainer(cfg, lr=3e-6)
        return cfg, trainer, trainer.chunks  # Megatron-Bridge hands callbacks the list of model chunks
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=256, vocab_size=1003, seq_length=32)
    trainer = Trainer(cfg, TrainConfig(lr=3e-6), tp=2)
    return cfg, trainer, [trainer.model]


def write_reference(callback, trainer, version: int, dense_dir: str, check_layers: bool) -> None:
    """Collective: the dense reference of ``version`` (rank 0 writes it)."""
    from safetensors.torch import save_file

    state = callback.refit.hook.dense_state()
    if check_layers:
        trainer.check_global_layers(state)
    if dist.get_rank() == 0:
        save_file(state, os.path.join(dense_dir, f"v{version}.safetensors"))


def run_nemo(args, cfg, trainer, overrides) -> None:
    from nemo_dcr.integrations.nemo import RefitCallback

    callback = RefitCallback(overrides=overrides)
    pl_module = SimpleNamespace(module=trainer.model)
    logger = LightningRecordingLogger(os.path.join(args.dense, "metrics.jsonl"))

    def lightning(step: int) -> SimpleNamespace:  # what the callback reads of Lightning's Trainer
        return SimpleNamespace(global_step=step, is_global_zero=dist.get_rank() == 0, loggers=[logger])

    if args.kind == "nemo_resume":  # a restarted job: weights, step and refit state from the checkpoint
        load_checkpoint(trainer, callback, args.ckpt)
    callback.on_train_start(lightning(trainer.steps_done), pl_module)
    first, decided = trainer.steps_done + 1, []
    for _ in range(args.iters):
        step = trainer.train_step().step
        callback.on_train_batch_end(lightning(step), pl_module, None, None, 0)
        # pipelined (the default): version step - 1 is decided in this call, step is in flight
        m = callback.last_metrics
        assert (m is None) if step == first else (m.version == step - 1), (step, m)
        if m is not None and m not in decided:
            decided.append(m)
        write_reference(callback, trainer, step, args.dense, check_layers=False)
    if args.kind == "nemo_save":
        save_checkpoint(trainer, callback, args.ckpt)
    callback.on_train_end(lightning(trainer.steps_done), pl_module)  # drains the last version
    decided.append(callback.last_metrics)
    assert [m.version for m in decided] == list(range(first, trainer.steps_done + 1)), decided
    assert all(m.committed for m in decided), decided
    assert logger.saves == (len(decided) if dist.get_rank() == 0 else 0), logger.saves


def run_bridge(args, cfg, trainer, model, overrides) -> None:
    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr_testbed import bridge_loop, bridge_release

    bridge = bridge_release.load()
    callback = RefitBridgeCallback(overrides=[*overrides, f"refit.every_n_steps={args.every_n}"])
    state = bridge_loop.GlobalState()
    state.cfg.checkpoint = bridge_loop.CheckpointConfig(save=args.ckpt, load=args.ckpt,
                                                        save_interval=args.save_interval)
    if dist.get_rank() == dist.get_world_size() - 1:
        metrics = os.path.join(args.dense, "metrics.jsonl")
        state.tensorboard_logger = RecordingLogger(metrics, "tensorboard")
        state.wandb_logger = RecordingLogger(metrics, "wandb")
    latest = bridge_loop.latest_checkpoint(args.ckpt) if args.ckpt else None
    if latest is not None:  # Bridge's load: weights and optimizer, then train_state.step
        trainer.load_weights(bridge_loop.checkpoint_name(args.ckpt, latest))
        state.train_state.step = latest
        print(f"worker: restarted from iteration {latest}", flush=True)

    def step_fn(iteration: int) -> bridge_loop.Iteration:
        if iteration in args.skip:
            # Bridge ran forward/backward and optimizer.step() refused the update
            # (update_successful=False): the params keep their bits
            return bridge_loop.Iteration(loss_dict={}, grad_norm=None, skipped=True)
        r = trainer.train_step()
        if isinstance(r, int):  # InterleavedTrainer
            return bridge_loop.Iteration(loss_dict={}, grad_norm=None, skipped=False)
        return bridge_loop.Iteration(loss_dict={"lm loss": torch.tensor(r.loss)}, grad_norm=r.grad_norm,
                                     skipped=not r.update_successful)

    published, decided = [], []

    def note_decided() -> None:
        m = callback.last_metrics
        if m is not None and (not decided or decided[-1].version != m.version):
            assert m.committed, m
            decided.append(m)

    def after_step_end(iteration: int, result: bridge_loop.Iteration) -> None:
        note_decided()  # pipelined (the default): an earlier version, decided in this event
        assert not decided or decided[-1].version < iteration, (iteration, decided[-1])
        if result.skipped or iteration % args.every_n:
            return
        published.append(iteration)
        write_reference(callback, trainer, iteration, args.dense, check_layers=args.kind == "bridge_vpp")

    def after_checkpoint(step: int) -> None:
        if step == args.kill_after_save:
            dist.barrier()
            print(f"worker: killed after the checkpoint of iteration {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    bridge_loop.train(bridge=bridge, callbacks=[callback], state=state, model=model, optimizer=trainer.optimizer,
                      train_iters=args.iters, step_fn=step_fn,
                      save_fn=(lambda directory, step: trainer.save_weights(directory)) if args.ckpt else None,
                      after_step_end=after_step_end, after_checkpoint=after_checkpoint)
    note_decided()  # the last version, drained by on_train_end
    assert [m.version for m in decided] == published, (decided, published)


def main() -> None:
    args = parse_args()
    cfg, trainer, model = build(args.kind)
    overrides = [f"refit.store_uri={args.store}", "refit.model_id=cb", "refit.receivers=[r0]",
                 f"refit.vocab_size={cfg.vocab_size}", "refit.ack_timeout_s=300"]
    if args.kind.startswith("bridge"):
        run_bridge(args, cfg, trainer, model, overrides)
    else:
        run_nemo(args, cfg, trainer, overrides)
    trainer.close()


if __name__ == "__main__":
    main()
