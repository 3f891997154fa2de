"""What a Megatron-Core ``GPTModel`` is, read from the model itself.

``describe_gpt`` derives the architecture (``ModelDims``) from the model's
``TransformerConfig`` and module attributes -- layers, widths, heads, query groups, kv
channels, experts, top-k, q/k-norm, tied embeddings, RoPE base, padded vocabulary -- and
refuses, naming the setting, what no registered layout family can express as a Hugging
Face model with the same function (LayerNorm instead of RMSNorm, non-SwiGLU MLPs, MLA,
partial or scaled RoPE, sigmoid / grouped / biased routers, shared experts, dense layers
inside an MoE stack).  Parameters no family table maps (e.g. linear biases) are refused
per parameter by the hook (``MegatronRefitHook.from_model``).

One fact is not in the model: the tokenizer's vocabulary size.  Megatron pads the
embedding rows (to a multiple of ``make_vocab_size_divisible_by * TP``); the padded rows
are never produced by a tokenizer, and the canonical checkpoint drops them.  Callers pass
``vocab_size`` (the tokenizer's); without it the padded size is canonical (every row is
sent, and a receiver built from the export has the padded vocabulary).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_dcr.errors import ValidationError
from nemo_dcr.layout.families import UnsupportedModelError
from nemo_dcr.layout.mapping import ModelDims


def _chunks(model) -> list:
    """Model chunks a trainer holds: a list (virtual pipeline stages; NeMo's
    ``MegatronParallel`` is an ``nn.ModuleList`` of them) or one model."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def _wrapper_chain(model):
    """``model`` and every module under it along ``.module`` (Float16Module, megatron DDP /
    FSDP, NeMo's wrappers each expose the wrapped model there), outermost first."""
    inner = model
    for _ in range(8):
        yield inner
        inner = getattr(inner, "module", None)
        if inner is None:
            return


class ModelChunks(torch.nn.Module):
    """This rank's ``GPTModel`` chunks under virtual pipeline parallelism, seen as one model.

    Parameters are named ``chunks.<i>.<name>`` (chunk order = virtual stage order), and
    ``sharded_state_dict()`` is the union of the chunks' own.  Megatron numbers layers
    globally in each chunk's metadata (``TransformerLayer.layer_number`` includes the
    ``vp_stage`` offset, and that is the prepended layer axis of every ``decoder.layers.*``
    ShardedTensor), so the union is exactly this rank's part of the global checkpoint; the
    embedding lives in the first chunk of the first stage, the output layer in the last
    chunk of the last stage.  Architecture attributes (``config``, ``vocab_size``, RoPE
    settings, ...) are the first chunk's: every chunk is built from the same config."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        out = {}
        for i, chunk in enumerate(self.chunks):
            for key, value in chunk.sharded_state_dict(*args, **kwargs).items():
                out[f"chunks.{i}.{key}"] = value
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "chunks":
                raise
            return getattr(self._modules["chunks"][0], name)


def _gpt_of(chunk) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    for inner in _wrapper_chain(chunk):
        if isinstance(inner, GPTModel):
            return inner
    raise UnsupportedModelError(f"no megatron GPTModel inside {type(chunk).__name__}")


def unwrap_gpt(model) -> torch.nn.Module:
    """The megatron ``GPTModel`` inside the wrappers a trainer holds (``Float16Module``,
    megatron DDP / FSDP, NeMo's ``MegatronParallel`` modules: each exposes ``.module``).
    A list of model chunks (virtual pipeline stages) gives a :class:`ModelChunks` of their
    ``GPTModel``s (one chunk: that ``GPTModel``)."""
    chunks = _chunks(model)
    if not chunks:
        raise UnsupportedModelError("an empty list of model chunks")
    gpts = [_gpt_of(c) for c in chunks]
    if len(gpts) == 1:
        return gpts[0]
    stages = [getattr(g, "vp_stage", None) for g in gpts]
    if stages != list(range(len(gpts))):
        raise UnsupportedModelError(
            f"model chunks with vp_stage {stages}: expected one chunk per virtual pipeline stage, "
            f"in order 0..{len(gpts) - 1}")
    return ModelChunks(gpts)


def deferred_param_gathers(model) -> list:
    """The megatron DDP wrappers around ``model`` whose distributed optimizer defers the
    BF16 parameter all-gather into the next forward (``overlap_param_gather=True``): after
    ``optimizer.step()`` their parameters still hold the *previous* bits outside this
    rank's optimizer shard.  The hook forces that gather before reading the parameters
    (``start_param_sync(force_sync=True)``: synchronous, marks the buckets dispatched, so
    the next forward's pre-hooks do not gather again)."""
    found = []
    for chunk in _chunks(model):
        for inner in _wrapper_chain(chunk):
            ddp_config = getattr(inner, "ddp_config", None)
            # the class must define the method: NeMo copies the DDP's bound methods onto its
            # LightningModule, which would otherwise be counted (and gathered) again
            if (ddp_config is not None and hasattr(type(inner), "start_param_sync")
                    and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
                found.append(inner)
    return found


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise UnsupportedModelError(f"unsupported model: {what}")


def describe_gpt(gpt: torch.nn.Module, *, vocab_size: int | None = None) -> ModelDims:
    """``ModelDims`` of a ``GPTModel`` (this rank's part of it; every rank gives the same)."""
    cfg = gpt.config
    _refuse(cfg.normalization != "RMSNorm", f"config.normalization={cfg.normalization!r} (families use RMSNorm)")
    _refuse(not cfg.gated_linear_unit or cfg.activation_func is not F.silu,
            "the MLP is not SwiGLU (config.gated_linear_unit=True with activation_func=F.silu)")
    _refuse(cfg.multi_latent_attention, "config.multi_latent_attention (MLA)")
    _refuse(getattr(cfg, "qk_l2_norm", False), "config.qk_l2_norm")
    _refuse(getattr(cfg, "attention_output_gate", False), "config.attention_output_gate")
    _refuse(cfg.softmax_scale is not None, f"config.softmax_scale={cfg.softmax_scale}")
    _refuse(gpt.position_embedding_type != "rope", f"position_embedding_type={gpt.position_embedding_type!r}")
    _refuse(getattr(gpt, "rotary_percent", 1.0) != 1.0, f"rotary_percent={gpt.rotary_percent}")
    _refuse(bool(getattr(gpt, "rotary_scaling", False)), "rope_scaling=True")
    _refuse(getattr(cfg, "rotary_interleaved", False), "config.rotary_interleaved")
    experts = cfg.num_moe_experts or 0
    if experts:
        _refuse(cfg.moe_shared_expert_intermediate_size is not None,
                f"config.moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size} "
                "(shared experts)")
        freq = cfg.moe_layer_freq
        _refuse(not (freq == 1 or (isinstance(freq, list) and all(x == 1 for x in freq))),
                f"config.moe_layer_freq={freq} (dense layers inside an MoE stack)")
        _refuse(cfg.moe_router_score_function != "softmax" or cfg.moe_router_pre_softmax,
                f"router score function {cfg.moe_router_score_function!r} with pre_softmax="
                f"{cfg.moe_router_pre_softmax} (families route with softmax over the top-k logits)")
        _refuse(cfg.moe_router_topk_scaling_factor not in (None, 1.0),
                f"config.moe_router_topk_scaling_factor={cfg.moe_router_topk_scaling_factor}")
        _refuse(cfg.moe_router_num_groups is not None, "group-limited routing (config.moe_router_num_groups)")
        _refuse(cfg.moe_router_enable_expert_bias, "config.moe_router_enable_expert_bias")
    padded = int(gpt.vocab_size)
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValidationError(f"vocab_size={vocab_size} must be in [1, {padded}] (the model's padded vocabulary)")
    heads = cfg.num_attention_heads
    return ModelDims(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=cfg.num_query_groups or heads,
        head_dim=cfg.kv_channels or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=vocab_size,
        num_moe_experts=experts,
        moe_ffn_hidden_size=(cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) if experts else 0,
        moe_router_topk=cfg.moe_router_topk if experts else 0,
        qk_layernorm=bool(cfg.qk_layernorm),
        tied_embeddings=bool(gpt.share_embeddings_and_output_weights),
        norm_epsilon=float(cfg.layernorm_epsilon),
        rotary_base=float(gpt.rotary_base),
        max_position_embeddings=int(gpt.max_sequence_length),
    )


__all__ = ["ModelChunks", "deferred_param_gathers", "describe_gpt", "unwrap_gpt"]
