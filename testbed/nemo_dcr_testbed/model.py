"""A small megatron-core GPT (Llama / Qwen3 / Qwen3-MoE family), built the way Megatron
builds one, for CPU training.

Architecture (every family): RMSNorm, SwiGLU MLP (``gated_linear_unit=True``, SiLU), rotary
position embeddings, grouped-query attention, no biases; input embedding and output layer
untied unless ``share_embeddings_and_output_weights``.  Per family (``ModelConfig.family``):

* ``llama``: the above.
* ``qwen3``: llama + per-head RMSNorm of queries and keys before RoPE (``qk_layernorm=True``;
  megatron's ``q_layernorm`` / ``k_layernorm``, weight of size ``head_dim``).
* ``qwen3_moe``: qwen3 with a mixture-of-experts MLP in every layer, no shared expert, the
  routing of HF ``Qwen3MoeForCausalLM`` with ``norm_topk_prob=True`` (as the released
  checkpoints set it): softmax over all experts, top-k, top-k weights renormalised to sum 1.  Megatron computes it as top-k of the logits then a softmax over
  those k (``moe_router_score_function="softmax"``, ``moe_router_pre_softmax=False``), which is
  the same function.  Experts are SwiGLU MLPs in megatron's ``SequentialMLP``
  (``moe_grouped_gemm=False``); tokens move with the ``allgather`` dispatcher (see
  docs/megatron-on-cpu.md); no load-balancing loss (``moe_router_load_balancing_type="none"``).

Layers come from megatron-core's local (non-Transformer-Engine) spec,
``get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=..., num_experts=...)``;
parameters are BF16 inside megatron's ``Float16Module``.

Call order on every rank::

    cpu_shim.apply()
    init_parallel(tp=2, pp=1, ep=1)
    model = build_gpt(cfg, tp=2, pp=1, ep=1)  # Float16Module(GPTModel)
    gpt = unwrap_gpt(model)                   # what sharded_state_dict() is read from
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from nemo_dcr.integrations.megatron_model import unwrap_gpt  # the product's: one definition
from nemo_dcr_testbed import cpu_shim

__all__ = [
    "FAMILIES",
    "ModelConfig",
    "ParallelError",
    "build_gpt",
    "destroy_parallel",
    "init_parallel",
    "padded_vocab_size",
    "stage_layer_counts",
    "transformer_config",
    "unwrap_gpt",
]


FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")
"""Model families :func:`build_gpt` can build (see the module docstring)."""


class ParallelError(RuntimeError):
    """The process group / model-parallel layout does not fit the request."""


def stage_layer_counts(num_layers: int, pp: int, *, first_stage_layers: int = 0,
                       last_stage_layers: int = 0) -> tuple[int, ...]:
    """Transformer layers held by each of the ``pp`` pipeline stages (megatron's rule).

    ``first_stage_layers`` / ``last_stage_layers``: 0 = not set (even split); set, they fix the
    first / last stage's count (megatron's ``num_layers_in_first_pipeline_stage`` /
    ``..._last_...``) and the remaining layers split evenly over the other stages, of which
    there must be at least one exactly when layers remain.  Raises ``ValueError``.
    """
    if num_layers < 1 or pp < 1 or first_stage_layers < 0 or last_stage_layers < 0:
        raise ValueError(
            f"need num_layers, pp >= 1 and stage layer counts >= 0, got num_layers={num_layers} "
            f"pp={pp} first_stage_layers={first_stage_layers} last_stage_layers={last_stage_layers}"
        )
    if not (first_stage_layers or last_stage_layers):
        if num_layers % pp:
            raise ValueError(f"pipeline parallel size {pp} does not divide num_layers={num_layers}")
        return (num_layers // pp,) * pp
    if pp < 2:
        raise ValueError("first_stage_layers / last_stage_layers need pipeline parallelism (pp >= 2)")
    rest_layers = num_layers - first_stage_layers - last_stage_layers
    rest_stages = pp - bool(first_stage_layers) - bool(last_stage_layers)
    if rest_layers < 0 or bool(rest_layers) != bool(rest_stages) or (
        rest_stages and rest_layers % rest_stages
    ):
        raise ValueError(
            f"first_stage_layers={first_stage_layers}, last_stage_layers={last_stage_layers} leave "
            f"{rest_layers} of num_layers={num_layers} layers for {rest_stages} other stage(s) of "
            f"pp={pp}: they must split evenly, at least one layer per stage"
        )
    middle = rest_layers // rest_stages if rest_stages else 0
    counts = [middle] * pp
    if first_stage_layers:
        counts[0] = first_stage_layers
    if last_stage_layers:
        counts[-1] = last_stage_layers
    return tuple(counts)


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
    family: str = "llama"
    """``"llama"``, ``"qwen3"`` (llama + per-head q/k RMSNorm) or ``"qwen3_moe"`` (qwen3 with
    an MoE MLP in every layer); see the module docstring."""
    num_moe_experts: int = 0
    """Routed experts per layer; > 0 exactly when ``family == "qwen3_moe"``."""
    moe_router_topk: int = 2
    """Experts each token is routed to (qwen3_moe; 1 <= topk <= num_moe_experts)."""
    moe_ffn_hidden_size: int = 0
    """Width of each expert's SwiGLU branches (qwen3_moe); 0 = ``ffn_hidden_size``."""
    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the input embedding.  With PP > 1 the last stage holds a copy
    of the embedding as ``output_layer.weight``; megatron zeroes it and all-reduces it with the
    first stage's at build, and all-reduces the two gradients every step (embedding group)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"ModelConfig.{f.name} must be an int, got {v!r}")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise TypeError(f"ModelConfig.{f.name} must be a bool, got {v!r}")
            if f.type in ("str", str) and not isinstance(v, str):
                raise TypeError(f"ModelConfig.{f.name} must be a str, got {v!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if self.num_moe_experts < 0 or self.moe_ffn_hidden_size < 0:
            raise ValueError("ModelConfig.num_moe_experts and moe_ffn_hidden_size must be >= 0")
        if (self.family == "qwen3_moe") != (self.num_moe_experts > 0):
            raise ValueError(
                f"ModelConfig.num_moe_experts must be > 0 exactly when family == 'qwen3_moe' "
                f"(family={self.family!r}, num_moe_experts={self.num_moe_experts})"
            )
        if self.is_moe and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"ModelConfig.moe_router_topk={self.moe_router_topk} must lie in "
                f"[1, num_moe_experts={self.num_moe_experts}]"
            )
        if not self.is_moe and self.moe_ffn_hidden_size:
            raise ValueError("ModelConfig.moe_ffn_hidden_size is only meaningful for family 'qwen3_moe'")
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

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts > 0

    @property
    def qk_layernorm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Width of each expert's SwiGLU branches (MoE only)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def check_parallel(self, *, tp: int, pp: int, ep: int = 1, first_stage_layers: int = 0,
                       last_stage_layers: int = 0) -> None:
        """Raise ``ValueError`` unless the model can be split ``tp`` ways, into ``pp`` stages
        (optionally uneven, see :func:`stage_layer_counts`) and its experts over ``ep`` ranks.

        Expert tensor parallelism is megatron's default (= ``tp``): each expert's SwiGLU
        branches are split ``tp`` ways too.  Whether the world size fits (EP must divide the
        data-parallel size) is checked by :func:`init_parallel` / ``DemoConfig``."""
        if tp < 1 or pp < 1 or ep < 1:
            raise ValueError(f"tp, pp and ep must be >= 1, got tp={tp} pp={pp} ep={ep}")
        names = ["num_attention_heads", "num_query_groups"]
        names.append("expert_ffn_hidden_size" if self.is_moe else "ffn_hidden_size")
        for name in names:
            if getattr(self, name) % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide {name}={getattr(self, name)}")
        if self.is_moe and tp > 1:
            raise ValueError(
                f"qwen3_moe with tensor parallelism (tp={tp}) does not train in this testbed: "
                "megatron's MoELayer refuses TP > 1 without sequence parallelism during training "
                "(moe_layer.py), and the only RMSNorm without Transformer Engine / Apex "
                "(WrappedTorchNorm) refuses sequence parallelism (torch_norm.py); use tp=1"
            )
        if ep > 1 and not self.is_moe:
            raise ValueError(f"expert parallelism (ep={ep}) needs an MoE model (family 'qwen3_moe')")
        if self.is_moe and self.num_moe_experts % ep:
            raise ValueError(
                f"expert parallel size {ep} does not divide num_moe_experts={self.num_moe_experts}"
            )
        stage_layer_counts(self.num_layers, pp, first_stage_layers=first_stage_layers,
                           last_stage_layers=last_stage_layers)


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Rows of Megatron's embedding / output layer (same rule as Megatron-LM's tokenizer setup)."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def init_parallel(tp: int, pp: int, *, ep: int = 1, timeout_s: float = 300.0) -> None:
    """Create the gloo default group (from torchrun's env) and megatron's model-parallel groups.

    The world is ``tp * pp * dp``; any remaining factor becomes data parallelism.  Expert
    parallelism ``ep`` regroups ranks for the MoE layers only (megatron's expert rank generator,
    expert TP = ``tp``): megatron needs ``tp * ep * pp`` to divide the world, i.e. ``ep`` must
    divide the data-parallel size.
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
    if min(tp, pp, ep) < 1:
        raise ParallelError(f"tp, pp, ep must be >= 1, got tp={tp} pp={pp} ep={ep}")
    if world % (tp * pp):
        raise ParallelError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}")
    if (world // (tp * pp)) % ep:
        raise ParallelError(
            f"expert parallel size {ep} does not divide the data-parallel size "
            f"{world // (tp * pp)} (world {world} / (tp*pp = {tp}*{pp}))"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp
            or parallel_state.get_expert_model_parallel_world_size() != ep
        ):
            raise ParallelError("model parallelism is already initialised with another layout")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, ep: int = 1,
                       first_stage_layers: int = 0, last_stage_layers: int = 0):
    """megatron-core ``TransformerConfig`` for ``cfg``: BF16, no fusions, no dropout, CPU init."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg.check_parallel(tp=tp, pp=pp, ep=ep, first_stage_layers=first_stage_layers,
                       last_stage_layers=last_stage_layers)
    moe: dict = {}
    if cfg.is_moe:
        moe = dict(
            num_moe_experts=cfg.num_moe_experts,
            moe_ffn_hidden_size=cfg.expert_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            # HF Qwen3-MoE: softmax over all experts, top-k, renormalise the k weights.
            # Megatron: top-k of the logits, softmax over those k -- the same function.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,
            moe_router_topk_scaling_factor=None,
            # No load-balancing loss: the training loss is the LM loss alone (docs).
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_shared_expert_intermediate_size=None,
            moe_grouped_gemm=False,  # SequentialMLP: one megatron MLP per local expert
            moe_token_dispatcher_type="allgather",  # plain all-gather / reduce-scatter (gloo)
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_model_parallel_size=ep,
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        qk_layernorm=cfg.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first_stage_layers or None,
        num_layers_in_last_pipeline_stage=last_stage_layers or None,
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
        **moe,
    )


def build_gpt(cfg: ModelConfig, *, tp: int, pp: int, ep: int = 1, first_stage_layers: int = 0,
              last_stage_layers: int = 0) -> torch.nn.Module:
    """Build this rank's part of the model, wrapped in ``Float16Module`` (BF16 params).

    Requires :func:`init_parallel` with the same ``tp``/``pp``/``ep``.  ``first_stage_layers`` /
    ``last_stage_layers`` (0 = even split) make the pipeline stages uneven, see
    :func:`stage_layer_counts`.  Seeds the CPU generator with ``cfg.seed`` first, so the same
    config gives the same bits on every run.
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
        or parallel_state.get_expert_model_parallel_world_size() != ep
    ):
        raise ParallelError(f"build_gpt(tp={tp}, pp={pp}, ep={ep}) does not match init_parallel()")
    config = transformer_config(cfg, tp=tp, pp=pp, ep=ep, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers)
    cpu_shim.seed_model_parallel_rng(cfg.seed)
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts if cfg.is_moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(cfg, tp),
        max_sequence_length=cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )
    return Float16Module(config, gpt)

