"""``MegatronRefitHook.from_model`` fails closed: a model it cannot refit completely is
refused at construction with the parameter (or setting) named, and nothing is published.
The control case (the same builder, unchanged) is accepted, so the refusals are not vacuous."""
import json
import os

from ._launch import torchrun

HERE = os.path.dirname(__file__)


def test_unsupported_models_are_refused_at_construction(tmp_path):
    out = tmp_path / "out.json"
    torchrun(os.path.join(HERE, "hook_refusal_worker.py"), 2, str(out), str(tmp_path / "store"))
    r = json.loads(out.read_text())
    assert r["control"] == "accepted"
    assert "parameter decoder.layers.0.self_attention.linear_proj.bias" in r["linear_bias"], r["linear_bias"]
    assert "no rule in the llama layout table" in r["linear_bias"]
    assert "config.normalization='LayerNorm'" in r["layernorm"]
    assert "not a qwen3" in r["family_mismatch"]
    assert "decoder.final_layernorm.weight" in r["uncovered"] and "cover 0 of 64" in r["uncovered"]
    assert "decoder.final_layernorm.weight" in r["twice"] and "emitted twice" in r["twice"]
    # a refusal found on rank 1 only is raised on rank 0 too (no hang), naming the rank
    assert r["one_rank"].startswith("UnsupportedModelError: rank 1:") and "final_layernorm" in r["one_rank"]
    assert r["published"] == []  # nothing written to the store
