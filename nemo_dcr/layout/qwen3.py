"""Megatron-Core GPT with per-head q/k RMSNorm -> ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

Qwen3 is the Llama skeleton plus ``qk_layernorm``: Megatron's ``q_layernorm`` /
``k_layernorm`` weights (``[head_dim]``, replicated over TP) are HF's ``q_norm`` /
``k_norm``.  Qwen3-MoE replaces the dense MLP by a router and per-expert SwiGLU MLPs
(no shared expert).  Megatron checkpoints experts under one key per weight with two
prepended axes (global layer, global expert); the canonical names are the published
per-expert ones (``mlp.experts.{e}.gate_proj.weight``), whatever fused layout a runtime
converts them into at load.
"""
from __future__ import annotations

from nemo_dcr.layout.llama import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, POST_ATTENTION_NORM
from nemo_dcr.layout.mapping import LAYER, LAYER_EXPERT, Identity, RowHalves, Rule

_L = "model.layers.{layer}."
_E = _L + "mlp.experts.{expert}."

QK_NORM: tuple[Rule, ...] = (
    Rule("decoder.layers.self_attention.q_layernorm.weight", {"": _L + "self_attn.q_norm.weight"},
         Identity(), axes=LAYER),
    Rule("decoder.layers.self_attention.k_layernorm.weight", {"": _L + "self_attn.k_norm.weight"},
         Identity(), axes=LAYER),
)

MOE_MLP: tuple[Rule, ...] = (
    Rule("decoder.layers.mlp.router.weight", {"": _L + "mlp.gate.weight"}, Identity(), axes=LAYER),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
         {"gate": _E + "gate_proj.weight", "up": _E + "up_proj.weight"}, RowHalves(), axes=LAYER_EXPERT),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight",
         {"": _E + "down_proj.weight"}, Identity(), axes=LAYER_EXPERT),
)

QWEN3_RULES: tuple[Rule, ...] = EMBEDDING + ATTENTION + QK_NORM + POST_ATTENTION_NORM + DENSE_MLP + FINAL
QWEN3_MOE_RULES: tuple[Rule, ...] = EMBEDDING + ATTENTION + QK_NORM + POST_ATTENTION_NORM + MOE_MLP + FINAL

__all__ = ["MOE_MLP", "QK_NORM", "QWEN3_MOE_RULES", "QWEN3_RULES"]
