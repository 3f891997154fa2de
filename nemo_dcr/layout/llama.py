"""Megatron-Core GPT (Llama-style) -> Hugging Face ``LlamaForCausalLM`` names and layouts.

Keys are Megatron's checkpoint keys (``ShardedTensor.key``), which are the same for the
local and the Transformer-Engine layer specs: e.g. the local spec's ``input_layernorm``
is checkpointed as ``linear_qkv.layer_norm_weight``.  Both spellings are listed so either
spec maps.  The groups below are reused by the Qwen3 tables (same decoder skeleton).
"""
from __future__ import annotations

from nemo_dcr.layout.mapping import LAYER, GroupedQKV, Identity, RowHalves, Rule, VocabRows

_L = "model.layers.{layer}."

EMBEDDING: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", {"": "model.embed_tokens.weight"}, VocabRows()),
)

ATTENTION: tuple[Rule, ...] = (
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
         {"": _L + "input_layernorm.weight"}, Identity(), axes=LAYER),
    Rule("decoder.layers.input_layernorm.weight",
         {"": _L + "input_layernorm.weight"}, Identity(), axes=LAYER),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         {"q": _L + "self_attn.q_proj.weight", "k": _L + "self_attn.k_proj.weight",
          "v": _L + "self_attn.v_proj.weight"}, GroupedQKV(), axes=LAYER),
    Rule("decoder.layers.self_attention.linear_proj.weight",
         {"": _L + "self_attn.o_proj.weight"}, Identity(), axes=LAYER),
)

POST_ATTENTION_NORM: tuple[Rule, ...] = (
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight",
         {"": _L + "post_attention_layernorm.weight"}, Identity(), axes=LAYER),
    Rule("decoder.layers.pre_mlp_layernorm.weight",
         {"": _L + "post_attention_layernorm.weight"}, Identity(), axes=LAYER),
)

DENSE_MLP: tuple[Rule, ...] = (
    Rule("decoder.layers.mlp.linear_fc1.weight",
         {"gate": _L + "mlp.gate_proj.weight", "up": _L + "mlp.up_proj.weight"}, RowHalves(), axes=LAYER),
    Rule("decoder.layers.mlp.linear_fc2.weight",
         {"": _L + "mlp.down_proj.weight"}, Identity(), axes=LAYER),
)

FINAL: tuple[Rule, ...] = (
    Rule("decoder.final_layernorm.weight", {"": "model.norm.weight"}, Identity()),
    # absent when the output layer is tied to the embedding (one canonical tensor then)
    Rule("output_layer.weight", {"": "lm_head.weight"}, VocabRows()),
)

LLAMA_RULES: tuple[Rule, ...] = EMBEDDING + ATTENTION + POST_ATTENTION_NORM + DENSE_MLP + FINAL

__all__ = ["ATTENTION", "DENSE_MLP", "EMBEDDING", "FINAL", "LLAMA_RULES", "POST_ATTENTION_NORM"]
