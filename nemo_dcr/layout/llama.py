"""Megatron-Core GPT (Llama-style) -> Hugging Face ``LlamaForCausalLM`` names and layouts.

Keys are Megatron's checkpoint keys (``ShardedTensor.key``), which are the same for the
local and the Transformer-Engine layer specs: e.g. the local spec's ``input_layernorm``
is checkpointed as ``linear_qkv.layer_norm_weight``.  Both spellings are listed so either
spec maps.
"""
from __future__ import annotations

from nemo_dcr.layout.mapping import GroupedQKV, Identity, ModelDims, RowHalves, Rule, VocabRows

_L = "model.layers.{layer}."

LLAMA_RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", {"": "model.embed_tokens.weight"}, VocabRows()),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
         {"": _L + "input_layernorm.weight"}, Identity(), layered=True),
    Rule("decoder.layers.input_layernorm.weight",
         {"": _L + "input_layernorm.weight"}, Identity(), layered=True),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         {"q": _L + "self_attn.q_proj.weight", "k": _L + "self_attn.k_proj.weight",
          "v": _L + "self_attn.v_proj.weight"}, GroupedQKV(), layered=True),
    Rule("decoder.layers.self_attention.linear_proj.weight",
         {"": _L + "self_attn.o_proj.weight"}, Identity(), layered=True),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight",
         {"": _L + "post_attention_layernorm.weight"}, Identity(), layered=True),
    Rule("decoder.layers.pre_mlp_layernorm.weight",
         {"": _L + "post_attention_layernorm.weight"}, Identity(), layered=True),
    Rule("decoder.layers.mlp.linear_fc1.weight",
         {"gate": _L + "mlp.gate_proj.weight", "up": _L + "mlp.up_proj.weight"}, RowHalves(), layered=True),
    Rule("decoder.layers.mlp.linear_fc2.weight",
         {"": _L + "mlp.down_proj.weight"}, Identity(), layered=True),
    Rule("decoder.final_layernorm.weight", {"": "model.norm.weight"}, Identity()),
    Rule("output_layer.weight", {"": "lm_head.weight"}, VocabRows()),
)

__all__ = ["LLAMA_RULES", "ModelDims"]
