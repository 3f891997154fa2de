"""Canonical Hugging Face checkpoint of a Megatron Llama-style model (config + tensors).

Written once, as version 0, so the trainer and every receiver start from the same bits.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save as save_safetensors

from nemo_dcr.layout.mapping import ModelDims
from nemo_dcr.testbed.model import ModelConfig
from nemo_dcr.protocol.manifest import INIT_PREFIX
from nemo_dcr.transport.store import ObjectStore

CONFIG_KEY = f"{INIT_PREFIX}/config.json"
WEIGHTS_KEY = f"{INIT_PREFIX}/model.safetensors"


def model_dims(cfg: ModelConfig) -> ModelDims:
    return ModelDims(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        head_dim=cfg.head_dim, ffn_hidden_size=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size,
    )


def llama_config(cfg: ModelConfig) -> dict:
    """``config.json`` of the equivalent ``LlamaForCausalLM`` (transformers' own schema)."""
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    d = hf.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def write_checkpoint(store: ObjectStore, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> int:
    """Write ``init/config.json``, then ``init/model.safetensors`` (whose presence readers
    take as "version 0 is complete"); returns the weight bytes."""
    store.put(CONFIG_KEY, json.dumps(llama_config(cfg), indent=1, sort_keys=True).encode())
    blob = save_safetensors({k: v.contiguous() for k, v in sorted(state.items())})
    store.put(WEIGHTS_KEY, blob)
    return len(blob)


def download_checkpoint(store: ObjectStore, directory: str) -> str:
    """Copy ``init/`` into a local directory a runtime can ``from_pretrained``."""
    import os

    os.makedirs(directory, exist_ok=True)
    for key in (CONFIG_KEY, WEIGHTS_KEY):
        with open(os.path.join(directory, key.split("/")[-1]), "wb") as f:
            f.write(store.get(key))
    return directory
