"""The Megatron -> HF mapping, checked against itself only through the models' outputs:
the HF Llama built from the Megatron weights must give the Megatron model's logits (fp32).

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


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_logits_match_megatron(tmp_path, tp):
    out = tmp_path / "logits.json"
    torchrun(os.path.join(HERE, "logits_worker.py"), tp, str(out), str(tp), "1")
    r = json.loads(out.read_text())
    assert r["shape"] == [2, 16, 203]  # the unpadded vocabulary
    assert r["max_abs"] < TOL, r
    # negative control: gate/up swapped in one layer must fail the same check
    assert r["swapped_max_abs"] > 100 * TOL, r
