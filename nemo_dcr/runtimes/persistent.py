"""Weights that outlive the receiver process: parameters bound to a shared file mapping.

A serving engine keeps its weights in memory a receiver agent does not own (GPU memory of
an engine process, say), so a receiver that dies mid-apply comes back to weights that are
partly written.  This module gives an in-process transformers model the same property:
every parameter's storage becomes a view of one ``MAP_SHARED`` file
(``torch.from_file(..., shared=True)``), so in-place writes land in the page cache and
survive ``SIGKILL`` of the process.  A restarted receiver maps the same file -- no
checkpoint is reloaded -- and repairs a half-applied version from its journal
(``receiver/journal.py``: overwrite with the old bits).

File layout: ``weights.bin`` (each parameter's bytes at a 64-byte aligned offset) and
``weights.json`` (name, offset, dtype, shape per parameter, and the run id they belong
to), written once when the file is created.  Buffers are not stored: they are derived
from the config (e.g. RoPE frequencies) and no delta changes them.
"""
from __future__ import annotations

import json
import os

import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.journal import write_durably, write_text

_ALIGN = 64


def _layout(model: torch.nn.Module) -> list[dict]:
    out, offset = [], 0
    for name, p in model.named_parameters():  # tied parameters appear once
        nbytes = p.numel() * p.element_size()
        out.append({"name": name, "offset": offset, "nbytes": nbytes, "dtype": str(p.dtype).removeprefix("torch."),
                    "shape": list(p.shape)})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return out


def _bind(model: torch.nn.Module, path: str, layout: list[dict], *, copy: bool) -> None:
    total = layout[-1]["offset"] + layout[-1]["nbytes"] if layout else 0
    raw = torch.from_file(path, shared=True, size=max(total, 1), dtype=torch.uint8)
    params = dict(model.named_parameters())
    for e in layout:
        p = params[e["name"]]
        view = raw[e["offset"]: e["offset"] + e["nbytes"]].view(p.dtype).view(p.shape)
        if copy:
            view.copy_(p.data)
        p.data = view


def bind_persistent(model: torch.nn.Module, directory: str, run_id: str) -> bool:
    """Bind ``model``'s parameters to ``directory/weights.bin``.  Creates the file from the
    model's current values (returns False), or, when a file of the same run and layout
    exists, maps it and the model takes the file's bits (returns True: restored without
    reading a checkpoint)."""
    os.makedirs(directory, exist_ok=True)
    path, meta_path = os.path.join(directory, "weights.bin"), os.path.join(directory, "weights.json")
    layout = _layout(model)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("run_id") != run_id:
            raise ValidationError(f"{meta_path}: weights of run {meta.get('run_id')}, this receiver follows "
                                  f"run {run_id}; use another --state-dir")
        if meta.get("layout") != layout:
            raise ValidationError(f"{meta_path}: parameter layout differs from this model's")
        _bind(model, path, layout, copy=False)
        return True
    total = layout[-1]["offset"] + layout[-1]["nbytes"] if layout else 0
    with open(path, "wb") as f:
        f.truncate(max(total, 1))
    _bind(model, path, layout, copy=True)
    write_durably(meta_path, lambda p: write_text(p, json.dumps({"run_id": run_id, "layout": layout})))
    return False


def model_skeleton(init_dir: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model class of ``init_dir/config.json`` with parameters allocated but not read
    from the checkpoint (``bind_persistent`` then maps the stored bits over them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(init_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
