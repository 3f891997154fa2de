"""A small Llama-style megatron-core GPT, built the way Megatron builds one, for CPU training.

Architecture: RMSNorm, SwiGLU MLP (``gated_linear_unit=True``, SiLU), rotary position
embeddings, grouped-query attention, no biases, untied input embedding and output layer.
Layers come from megatron-core's local (non-Transformer-Engine) spec,
``get_gpt_layer_local_spec(normalization="RMSNorm")``; parameters are BF16 inside megatron's
``Float16Module``.

Call order on every rank::

    cpu_shim.apply()
    init_parallel(tp=2, pp=1)
    model = build_gpt(cfg, tp=2, pp=1)        # Float16Module(GPTModel)
    gpt = unwrap_gpt(model)                   # what sharded_state_dict() is read from
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from nemo_dcr.testbed import cpu_shim

__all__ = [
    "ModelConfig",
    "ParallelError",
    "build_gpt",
    "destroy_parallel",
    "init_parallel",
    "padded_vocab_size",
    "transformer_config",
    "unwrap_gpt",
]


class ParallelError(RuntimeError):
    """The process group / model-parallel layout does not fit the request."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Shape and initialisation of the model; independent of how it is parallelised."""

    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 128
    """Residual stream width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention); equal to num_attention_heads for MHA."""
    ffn_hidden_size: int = 256
    """Width of each SwiGLU branch (gate and up each have this many rows)."""
    vocab_size: int = 1000
    """True vocabulary size. Megatron pads its embedding/output rows to a multiple of
    ``make_vocab_size_divisible_by * tp``; the padded rows are not part of the canonical model."""
    seq_length: int = 64
    """Training sequence length (also the RoPE table length)."""
    rotary_base: int = 10000
    """RoPE theta."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Std of the normal init of all weight matrices (output projections are scaled by
    ``1/sqrt(2*num_layers)`` as in Megatron)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's vocabulary padding unit (multiplied by the TP size)."""
    seed: int = 1234
    """Seed of the CPU generator the weights are drawn from (same on every rank)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"ModelConfig.{f.name} must be an int, got {v!r}")
        positive = (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "vocab_size", "seq_length", "rotary_base",
            "make_vocab_size_divisible_by",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if not (self.norm_epsilon > 0 and self.init_method_std > 0):
            raise ValueError("ModelConfig.norm_epsilon and init_method_std must be > 0")
        if self.seed < 0:
            raise ValueError(f"ModelConfig.seed must be >= 0, got {self.seed}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_parallel(self, *, tp: int, pp: int) -> None:
        """Raise ``ValueError`` unless the model can be split ``tp`` ways and into ``pp`` stages."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide {name}={getattr(self, name)}")
        if self.num_layers % pp:
            raise ValueError(f"pipeline parallel size {pp} does not divide num_layers={self.num_layers}")


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Rows of Megatron's embedding / output layer (same rule as Megatron-LM's tokenizer setup)."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def init_parallel(tp: int, pp: int, *, timeout_s: float = 300.0) -> None:
    """Create the gloo default group (from torchrun's env) and megatron's model-parallel groups.

    The world is ``tp * pp * dp``; any remaining factor becomes data parallelism.
    """
    cpu_shim.apply()
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            raise ParallelError("init_parallel expects torchrun's environment (RANK, WORLD_SIZE, ...)")
        torch.distributed.init_process_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ParallelError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}")
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp
        ):
            raise ParallelError("model parallelism is already initialised with another layout")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int):
    """megatron-core ``TransformerConfig`` for ``cfg``: BF16, no fusions, no dropout, CPU init."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg.check_parallel(tp=tp, pp=pp)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Draw every full master weight on the CPU from the default generator, then keep
        # this rank's slice: TP ranks agree and no CUDA RNG state is needed.
        use_cpu_initialization=True,
        perform_initialization=True,
        # Fused CUDA/Apex kernels are not available on CPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt(cfg: ModelConfig, *, tp: int, pp: int) -> torch.nn.Module:
    """Build this rank's part of the model, wrapped in ``Float16Module`` (BF16 params).

    Requires :func:`init_parallel` with the same ``tp``/``pp``.  Seeds the CPU generator with
    ``cfg.seed`` first, so the same config gives the same bits on every run.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    if not cpu_shim.is_applied():
        raise ParallelError("call init_parallel() (which applies the CPU shim) before build_gpt()")
    if (
        parallel_state.get_tensor_model_parallel_world_size() != tp
        or parallel_state.get_pipeline_model_parallel_world_size() != pp
    ):
        raise ParallelError(f"build_gpt(tp={tp}, pp={pp}) does not match init_parallel()")
    config = transformer_config(cfg, tp=tp, pp=pp)
    cpu_shim.seed_model_parallel_rng(cfg.seed)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(cfg, tp),
        max_sequence_length=cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )
    return Float16Module(config, gpt)


def unwrap_gpt(model: torch.nn.Module):
    """The ``GPTModel`` inside the wrappers (``Float16Module``, DDP); its
    ``sharded_state_dict()`` is what the delta path reads."""
    from megatron.core.models.gpt import GPTModel

    inner = model
    for _ in range(4):
        if isinstance(inner, GPTModel):
            return inner
        inner = getattr(inner, "module", None)
        if inner is None:
            break
    raise TypeError(f"no GPTModel inside {type(model).__name__}")
