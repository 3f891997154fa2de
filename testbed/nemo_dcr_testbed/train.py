"""One optimizer step of megatron-core training, on CPU, with a hook after the BF16 write.

The step is megatron's own machinery end to end:

* forward/backward through ``get_forward_backward_func()`` (the no-pipelining schedule for
  PP=1, the 1F1B schedule with p2p send/recv for PP>1), next-token cross-entropy computed by
  ``GPTModel`` itself (vocab-parallel cross-entropy over the padded vocabulary);
* megatron ``DistributedDataParallel`` with FP32 gradient buffers (``main_grad``), and
  ``finalize_model_grads`` (data-parallel all-reduce -- a reduce-scatter with the distributed
  optimizer; expert params over the expert-data-parallel group; with tied embeddings and PP > 1
  the all-reduce of the embedding and output-layer grads over the embedding group; the
  layer-norm all-reduce is a no-op: no sequence parallelism);
* megatron's ``Float16OptimizerWithFloat16Params`` from ``get_megatron_optimizer(bf16=True)``:
  FP32 master copies of the BF16 params, ``torch.optim.AdamW`` on the masters, global-norm
  gradient clipping, then the masters are rounded into the BF16 params.  With ``TrainConfig.use_distributed_optimizer`` megatron's ``DistributedOptimizer`` instead
  keeps masters of this DP rank's slice only and all-gathers the BF16 params inside
  ``step()`` (``overlap_param_gather=False``).

Why TP-replicated params stay identical across TP ranks: the RMSNorm weights (and nothing else
here) are replicated over the TP group.  Their gradients are computed from activations and
upstream gradients that are already identical on every TP rank (the input to a column-parallel
linear is all-reduced in backward), the gradient norm used for clipping is all-reduced over the
model-parallel group, and AdamW is elementwise; so every TP rank computes the same bits.  With
sequence parallelism this would need ``finalize_model_grads``' layer-norm all-reduce, which the
DDP path already calls.  ``tests/megatron`` checks the bit-identity.

After ``optimizer.step()`` the BF16 params hold the new bits; then every hook registered with
:meth:`Trainer.add_post_step_hook` runs on every rank, in registration order.  That is the seam
the refit path plugs into.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from nemo_dcr_testbed.model import ModelConfig, build_gpt, init_parallel, unwrap_gpt

__all__ = ["MasterShard", "PostStepHook", "StepResult", "TrainConfig", "Trainer", "token_batch"]


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Optimizer and data settings of :class:`Trainer`."""

    lr: float = 1e-5
    """AdamW learning rate (constant; RL refits typically use 1e-6..1e-5)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) applied to matrices; megatron exempts norms."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    num_microbatches: int = 1
    """Micro-batches per step (gradient accumulation; with PP, the pipeline's depth of work)."""
    data_seed: int = 0
    """Seed of the token stream; batch ``(step, microbatch)`` is the same on every TP/PP rank of
    a model replica (data-parallel replicas draw different batches)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): each data-parallel rank keeps the FP32 masters
    and Adam state of a 1/DP slice of the gradient buffer, and the updated BF16 params are
    all-gathered at the end of ``optimizer.step()`` (``overlap_param_gather=False``), so every
    rank holds the new bits before the post-step hooks run."""
    overlap_param_gather: bool = False
    """Distributed optimizer only: defer that all-gather into the next forward's pre-hooks
    (megatron's overlap).  Right after ``step()`` a rank's params outside its own optimizer
    shard then still hold the previous step's bits; the refit hook forces the gather
    (``MegatronRefitHook`` / ``deferred_param_gathers``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"TrainConfig.{f.name} must be an int, got {v!r}")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise TypeError(f"TrainConfig.{f.name} must be a bool, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be finite and > 0, got {self.lr}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.adam_eps <= 0:
            raise ValueError("TrainConfig: weight_decay, clip_grad must be >= 0, adam_eps > 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("TrainConfig: Adam betas must lie in [0, 1)")
        if self.micro_batch_size < 1 or self.num_microbatches < 1 or self.data_seed < 0:
            raise ValueError("TrainConfig: micro_batch_size, num_microbatches >= 1, data_seed >= 0")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("TrainConfig.overlap_param_gather needs use_distributed_optimizer=true")


@dataclass(frozen=True)
class StepResult:
    """What one step did, as seen identically by every rank."""

    step: int
    """1-based index of the optimizer step just taken (= number of steps taken so far)."""
    loss: float
    """Mean next-token cross-entropy over the step's micro-batches (computed on the last PP
    stage, averaged over data-parallel replicas)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    update_successful: bool
    """False if megatron skipped the update (non-finite gradients)."""


@dataclass(frozen=True)
class MasterShard:
    """The FP32 master copy this rank's optimizer holds for (a flat slice of) one BF16 param."""

    start: int
    """First element, in the param's flattened (row-major) order, that the master covers."""
    stop: int
    """One past the last element covered (``stop - start == master.numel()``)."""
    master: torch.Tensor
    """FP32 values (live optimizer state, not a copy), flat ``[stop - start]``.  After a step,
    ``param.view(-1)[start:stop]`` equals ``master.to(bfloat16)`` bit for bit."""

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop or self.master.numel() != self.stop - self.start:
            raise ValueError(
                f"MasterShard [{self.start}, {self.stop}) does not match {self.master.numel()} elements"
            )


PostStepHook = Callable[["Trainer", int], None]
"""``fn(trainer, step)``: called on every rank after the BF16 params of ``step`` are written."""


def token_batch(
    *, data_seed: int, step: int, microbatch: int, micro_batch_size: int, seq_length: int,
    vocab_size: int, dp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random ``(tokens, labels)`` int64 ``[micro_batch_size, seq_length]``; labels are
    the tokens shifted by one.  A pure function of its arguments (own generator)."""
    seed = data_seed
    for part in (step, microbatch, dp_rank):
        seed = (seed * 1_000_003 + part) % (1 << 63)
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class Trainer:
    """Megatron-core GPT + DDP + mixed-precision AdamW on this rank (see module docstring).

    Construct it on every rank of a torchrun launch; ``tp * pp`` must divide the world size
    (the rest is data parallelism) and ``ep`` (expert parallelism, MoE models) must divide the
    data-parallel size.  ``first_stage_layers`` / ``last_stage_layers`` (0 = even split) give
    uneven pipeline stages (see :func:`~nemo_dcr_testbed.model.stage_layer_counts`).
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, *, tp: int, pp: int = 1,
                 ep: int = 1, first_stage_layers: int = 0, last_stage_layers: int = 0):
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.tp = tp
        self.pp = pp
        self.ep = ep
        self.first_stage_layers = first_stage_layers
        self.last_stage_layers = last_stage_layers
        model_cfg.check_parallel(tp=tp, pp=pp, ep=ep, first_stage_layers=first_stage_layers,
                                 last_stage_layers=last_stage_layers)
        init_parallel(tp, pp, ep=ep)

        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        fp16_model = build_gpt(model_cfg, tp=tp, pp=pp, ep=ep, first_stage_layers=first_stage_layers,
                               last_stage_layers=last_stage_layers)
        self.config = fp16_model.config
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=train_cfg.use_distributed_optimizer,
                # False: the distributed optimizer all-gathers the new BF16 params inside
                # step(), before the post-step hooks.  True: in the next forward's pre-hooks
                # (the refit hook then forces the gather itself).
                overlap_param_gather=train_cfg.overlap_param_gather,
            ),
            module=fp16_model,
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train_cfg.lr,
                min_lr=train_cfg.lr,
                weight_decay=train_cfg.weight_decay,
                decoupled_weight_decay=True,  # AdamW (torch.optim.AdamW without Apex/TE)
                adam_beta1=train_cfg.adam_beta1,
                adam_beta2=train_cfg.adam_beta2,
                adam_eps=train_cfg.adam_eps,
                clip_grad=train_cfg.clip_grad,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=train_cfg.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.steps_done = 0
        self._hooks: list[PostStepHook] = []

    @property
    def gpt(self):
        """The inner megatron ``GPTModel`` (BF16 params; ``sharded_state_dict()`` lives here)."""
        return unwrap_gpt(self.model)

    def add_post_step_hook(self, fn: PostStepHook) -> None:
        """Run ``fn(trainer, step)`` on this rank after every future step's BF16 write.

        Register the same hooks on every rank: a hook may use collectives.  An exception from a
        hook propagates out of :meth:`train_step`; the step's update is already applied and
        counted in ``steps_done``."""
        if not callable(fn):
            raise TypeError(f"post-step hook must be callable, got {fn!r}")
        self._hooks.append(fn)

    def _batches(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        from megatron.core import parallel_state

        cfg, tc = self.model_cfg, self.train_cfg
        dp_rank = parallel_state.get_data_parallel_rank()
        position_ids = torch.arange(cfg.seq_length).unsqueeze(0).expand(tc.micro_batch_size, -1)
        for mb in range(tc.num_microbatches):
            tokens, labels = token_batch(
                data_seed=tc.data_seed, step=step, microbatch=mb,
                micro_batch_size=tc.micro_batch_size, seq_length=cfg.seq_length,
                vocab_size=cfg.vocab_size, dp_rank=dp_rank,
            )
            yield {"tokens": tokens, "labels": labels, "position_ids": position_ids}

    @staticmethod
    def _forward_step(data_iterator, model):
        batch = next(data_iterator)
        per_token = model(
            batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
        )

        def loss_func(output: torch.Tensor):
            loss = output.float().mean()
            # The schedule divides the returned loss by num_microbatches in place; report a copy.
            return loss, {"lm loss": loss.detach().clone()}

        return per_token, loss_func

    def train_step(self) -> StepResult:
        """Forward/backward over ``num_microbatches`` micro-batches, AdamW step, hooks."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        step = self.steps_done + 1
        tc = self.train_cfg
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=self._batches(step),
            model=[self.model],
            num_microbatches=tc.num_microbatches,
            seq_length=self.model_cfg.seq_length,
            micro_batch_size=tc.micro_batch_size,
            forward_only=False,
        )
        update_successful, grad_norm, _ = self.optimizer.step()
        self.steps_done = step

        # The loss lives on the last pipeline stage; share it with the other stages.
        loss = torch.zeros(1, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            loss[0] = sum(float(d["lm loss"]) for d in losses) / len(losses)
        if self.pp > 1:
            torch.distributed.broadcast(
                loss,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:  # mean over the data-parallel replicas' batches
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= dp
        result = StepResult(
            step=step,
            loss=float(loss[0]),
            grad_norm=float("nan") if grad_norm is None else float(grad_norm),
            update_successful=bool(update_successful),
        )
        for hook in self._hooks:
            hook(self, step)
        return result

    def bf16_params(self) -> dict[str, torch.Tensor]:
        """This rank's BF16 parameters by ``GPTModel`` parameter name (live tensors, not copies)."""
        return {n: p for n, p in self.gpt.named_parameters()}

    def master_params(self) -> dict[str, torch.Tensor]:
        """The optimizer's FP32 master copy of each BF16 parameter, by the same names as
        :meth:`bf16_params` (after a step, each BF16 param is its master rounded to BF16).

        Only for the non-distributed optimizer; with ``use_distributed_optimizer`` a rank holds
        masters of slices only: use :meth:`master_shards`."""
        if self.train_cfg.use_distributed_optimizer:
            raise RuntimeError(
                "the distributed optimizer holds FP32 masters of param slices only: use master_shards()"
            )
        masters = {}
        for name, p in self.gpt.named_parameters():
            main = getattr(p, "main_param", None)
            if main is None:
                raise RuntimeError(f"{name}: the optimizer holds no FP32 master copy")
            masters[name] = main
        return masters

    def master_shards(self) -> dict[str, MasterShard]:
        """The FP32 masters this rank's optimizer holds, by :meth:`bf16_params` name.

        Non-distributed optimizer: every param, whole (``start=0, stop=numel``).  Distributed
        optimizer: only the params whose elements fall in this data-parallel rank's slice of
        the gradient buffer, each with the flat range it covers (megatron's
        ``_get_model_param_range_map(param)["param"]``); other ranks hold the rest."""
        if not self.train_cfg.use_distributed_optimizer:
            return {
                n: MasterShard(start=0, stop=m.numel(), master=m.view(-1))
                for n, m in self.master_params().items()
            }
        names = {p: n for n, p in self.gpt.named_parameters()}
        out: dict[str, MasterShard] = {}
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for model_group, shard_group in zip(
                opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True
            ):
                for param, shard in zip(model_group, shard_group, strict=True):
                    rng = opt._get_model_param_range_map(param)["param"]
                    out[names[param]] = MasterShard(start=rng.start, stop=rng.end, master=shard.view(-1))
        return out

    def save_weights(self, directory: str) -> None:
        """What a training checkpoint needs for the refit to go on bit-exactly: this rank's
        BF16 params, FP32 masters and step count, as ``directory/rank<r>.pt`` (not the Adam
        moments: a restarted job's next steps differ from an uninterrupted one's, which the
        refit does not care about).  Non-distributed optimizer only."""
        import os

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save({"bf16": {n: p.detach().clone() for n, p in self.bf16_params().items()},
                    "master": {n: m.detach().clone() for n, m in self.master_params().items()},
                    "steps_done": self.steps_done}, os.path.join(directory, f"rank{rank}.pt"))

    def load_weights(self, directory: str) -> None:
        """Restore what :meth:`save_weights` wrote (same parallel layout)."""
        import os

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        saved = torch.load(os.path.join(directory, f"rank{rank}.pt"))
        with torch.no_grad():
            for n, p in self.bf16_params().items():
                assert p.dtype == saved["bf16"][n].dtype
                p.copy_(saved["bf16"][n])
            for n, m in self.master_params().items():
                assert m.dtype == saved["master"][n].dtype
                m.copy_(saved["master"][n])
        self.steps_done = saved["steps_done"]

    def close(self) -> None:
        """Tear down megatron's model-parallel state and the process group."""
        from nemo_dcr_testbed.model import destroy_parallel

        destroy_parallel()


