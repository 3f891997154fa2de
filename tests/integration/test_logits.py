"""Each family's Megatron -> HF mapping, checked only through the models' outputs: the HF
model of the family (loaded by transformers' own ``from_pretrained``, with its checkpoint
conversions) built from the Megatron weights must give the Megatron model's logits (fp32).

Tolerance: 2e-4 absolute on logits of magnitude ~1 -- both models run in fp32 from the
same BF16 weights; the residual is reduction-order noise (measured ~1e-6).  A wrong QKV
or GLU layout changes logits at the 1e-2..1e0 scale, which the negative control shows.
"""
import json
import os

import pytest

from ._launch import torchrun

HERE = os.path.dirname(__file__)
TOL = 2e-4


@pytest.mark.parametrize("family,tp,ep,extra", [
    ("llama", 1, 1, ()), ("llama", 2, 1, ()), ("llama", 1, 1, ("tied",)),
    ("qwen3", 2, 1, ()),
    ("qwen3_moe", 1, 1, ()), ("qwen3_moe", 1, 2, ()),
])
def test_hf_logits_match_megatron(tmp_path, family, tp, ep, extra):
    out = tmp_path / "logits.json"
    torchrun(os.path.join(HERE, "logits_worker.py"), max(tp, ep), str(out), family, str(tp), "1", str(ep), *extra)
    r = json.loads(out.read_text())
    assert r["shape"] == [2, 16, 203]  # the unpadded vocabulary
    assert r["max_abs"] < TOL, r
    # negative control: gate/up swapped in one layer (expert) must fail the same check
    assert r["swapped_max_abs"] > 100 * TOL, r
    if family == "qwen3_moe":  # canonical names are the published per-expert ones
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in r["canonical"]
        assert "model.layers.0.mlp.gate.weight" in r["canonical"]
    if family.startswith("qwen3"):
        assert "model.layers.0.self_attn.q_norm.weight" in r["canonical"]
    assert ("lm_head.weight" in r["canonical"]) == ("tied" not in extra)
