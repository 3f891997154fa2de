"""Canonical Hugging Face checkpoint of a Megatron model (config + tensors), version 0.

Written once, so the trainer and every receiver start from the same bits.  The
``config.json`` comes from the model's family and dimensions (``layout/families.py``),
validated and completed by transformers' own config class for that ``model_type``.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save as save_safetensors

from nemo_dcr.layout.families import ModelFamily, hf_config_fields
from nemo_dcr.layout.mapping import ModelDims
from nemo_dcr.protocol.manifest import INIT_PREFIX, InitRecord
from nemo_dcr.protocol.version0 import MAX_INIT_BYTES, fetch_init_file, write_init_record
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectStore

CONFIG_KEY = f"{INIT_PREFIX}/config.json"
WEIGHTS_KEY = f"{INIT_PREFIX}/model.safetensors"


def hf_config(family: ModelFamily, dims: ModelDims) -> dict:
    """``config.json`` of the equivalent transformers model (transformers' own schema)."""
    from transformers import AutoConfig

    fields = hf_config_fields(family, dims)
    model_type = fields.pop("model_type")
    architectures = fields.pop("architectures")
    cfg = AutoConfig.for_model(model_type, **fields)
    d = cfg.to_dict()
    d["architectures"] = architectures
    d["dtype"] = "bfloat16"
    # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta (and its
    # config class fills a default 10000 there when built from rope_parameters): write both
    d["rope_theta"] = float(dims.rotary_base)
    return d


def write_checkpoint(store: ObjectStore, config: dict, state: dict[str, torch.Tensor], *, sealer: Sealer,
                     run_id: str) -> str:
    """Write ``init/config.json``, ``init/model.safetensors``, then ``init/INIT.json`` with
    their digests (whose presence readers take as "version 0 is complete"); returns the
    digest of ``INIT.json``, the root of the run's chain of versions."""
    cfg = json.dumps(config, indent=1, sort_keys=True).encode()
    blob = save_safetensors({k: v.contiguous() for k, v in sorted(state.items())})
    store.put(CONFIG_KEY, cfg)
    store.put(WEIGHTS_KEY, blob)
    return write_init_record(store, sealer, run_id, {"config.json": cfg, "model.safetensors": blob})


def download_checkpoint(store: ObjectStore, directory: str, record: InitRecord | None = None) -> str:
    """Copy ``init/`` into a local directory a runtime can ``from_pretrained``.  With the
    run's signed ``record`` (a receiver), each file it lists is fetched bounded by its size
    and checked against its digest, from the next upstream when one serves other bytes
    (``protocol/version0.fetch_init_file``); without, the two files as the store has them."""
    os.makedirs(directory, exist_ok=True)
    if record is not None:
        for name in sorted(record.files):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(fetch_init_file(store, record, name))
        return directory
    for key in (CONFIG_KEY, WEIGHTS_KEY):
        with open(os.path.join(directory, key.split("/")[-1]), "wb") as f:
            f.write(store.get(key, max_bytes=MAX_INIT_BYTES))
    return directory
