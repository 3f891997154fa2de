"""Model families: which layout table maps a Megatron GPT to which Hugging Face class.

A family is chosen from what the model *is* (``ModelDims``, derived from its
``TransformerConfig`` and module tree): MoE or dense, q/k-norm or not.  Each family is
one declarative rule table plus the Hugging Face ``config.json`` fields that describe it
(no transformers import here: the trainer-side export validates the dict with
transformers' own config class).

Adding a family = one rule table (``layout/<family>.py``) + one ``ModelFamily`` entry.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nemo_dcr.layout.llama import LLAMA_RULES
from nemo_dcr.layout.mapping import ModelDims, Rule
from nemo_dcr.layout.qwen3 import QWEN3_MOE_RULES, QWEN3_RULES
from nemo_dcr.errors import PlacementError


class UnsupportedModelError(PlacementError, ValueError):
    """The model uses a layout or a layer kind no registered family maps."""


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    name: str
    rules: tuple[Rule, ...]
    hf_model_type: str
    """transformers' ``model_type`` (``AutoConfig.for_model`` key)."""
    hf_architecture: str
    """The ``*ForCausalLM`` class receivers load."""
    moe: bool
    qk_layernorm: bool
    hf_extra: Callable[[ModelDims], dict]
    """Family-specific ``config.json`` fields on top of :func:`hf_config_fields`' common ones."""

    def matches(self, dims: ModelDims) -> bool:
        return bool(dims.num_moe_experts) == self.moe and dims.qk_layernorm == self.qk_layernorm


def _no_extra(dims: ModelDims) -> dict:
    return {}


def _qwen3_extra(dims: ModelDims) -> dict:
    return {"use_sliding_window": False}


def _qwen3_moe_extra(dims: ModelDims) -> dict:
    return {
        "use_sliding_window": False,
        "num_experts": dims.num_moe_experts,
        "num_experts_per_tok": dims.moe_router_topk,
        "moe_intermediate_size": dims.moe_ffn_hidden_size,
        # Megatron's router: softmax over the top-k logits == softmax over all experts,
        # top-k, renormalised (HF's norm_topk_prob=True)
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
    }


FAMILIES: Mapping[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(name="llama", rules=LLAMA_RULES, hf_model_type="llama", hf_architecture="LlamaForCausalLM",
                    moe=False, qk_layernorm=False, hf_extra=_no_extra),
        ModelFamily(name="qwen3", rules=QWEN3_RULES, hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM",
                    moe=False, qk_layernorm=True, hf_extra=_qwen3_extra),
        ModelFamily(name="qwen3_moe", rules=QWEN3_MOE_RULES, hf_model_type="qwen3_moe",
                    hf_architecture="Qwen3MoeForCausalLM", moe=True, qk_layernorm=True, hf_extra=_qwen3_moe_extra),
    )
}


def select_family(dims: ModelDims, name: str | None = None) -> ModelFamily:
    """The family of a model: ``name`` if given (checked against the model), else the one
    registered family whose features match."""
    if name is not None:
        try:
            family = FAMILIES[name]
        except KeyError:
            raise UnsupportedModelError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None
        if not family.matches(dims):
            raise UnsupportedModelError(
                f"the model is not a {name}: it has moe={bool(dims.num_moe_experts)}, "
                f"qk_layernorm={dims.qk_layernorm}; {name} has moe={family.moe}, qk_layernorm={family.qk_layernorm}")
        return family
    found = [f for f in FAMILIES.values() if f.matches(dims)]
    if not found:
        raise UnsupportedModelError(
            f"no registered family has moe={bool(dims.num_moe_experts)} and qk_layernorm={dims.qk_layernorm}; "
            f"known: {sorted(FAMILIES)}")
    return found[0]


def hf_config_fields(family: ModelFamily, dims: ModelDims) -> dict:
    """``config.json`` fields of the Hugging Face model equivalent to ``dims``."""
    return {
        "model_type": family.hf_model_type,
        "architectures": [family.hf_architecture],
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.ffn_hidden_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_query_groups,
        "head_dim": dims.head_dim,
        "max_position_embeddings": dims.max_position_embeddings,
        "rms_norm_eps": dims.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(dims.rotary_base)},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": dims.tied_embeddings,
        **family.hf_extra(dims),
    }


__all__ = ["FAMILIES", "ModelFamily", "UnsupportedModelError", "hf_config_fields", "select_family"]
