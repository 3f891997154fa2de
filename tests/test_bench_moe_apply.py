"""scripts/bench_moe_apply.py at a small size: the three ways of applying one MoE version
(nemo_dcr's in-place XOR into the fused expert parameters, the loader per layer, a
per-expert copy) all end bit-exact (integer views), and the check that guards the timed
runs reports a flipped bit (negative control)."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bma():
    spec = importlib.util.spec_from_file_location("bench_moe_apply", os.path.join(ROOT, "scripts", "bench_moe_apply.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_moe_apply"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_apply_path_is_bit_exact_and_a_flipped_bit_is_seen(bma, tmp_path):
    assert bma.main(["--experts", "8", "--layers", "2", "--repeats", "1", "--sizes", "64x32,64x16",
                     "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "moe_apply.json").read_text())
    assert [s["moe_intermediate"] for s in out["sizes"]] == [32, 16]
    for size in out["sizes"]:
        assert size["expert_tensors"] == 2 * 8 * 3
        assert size["expert_placements"] == {"TRACED": 48}  # in place, no loader call
        assert set(size["methods"]) == {"nemo_dcr", "loader per layer", "per-expert copy"}
        assert all(m["bit_exact"] for m in size["methods"].values())
        assert size["negative_control_detected"] is True
    assert (tmp_path / "moe_apply.png").stat().st_size > 0


def test_the_check_sees_a_wrong_apply(bma, tmp_path):
    """A version applied to the wrong expert (negative control for the comparison itself)."""
    from nemo_dcr.receiver.apply import DeltaApplier
    from nemo_dcr.runtimes.hf import HFTransformersAdapter

    bma.build(str(tmp_path), 4, 1)
    adapter = HFTransformersAdapter.from_pretrained(str(tmp_path))
    applier = DeltaApplier(adapter)
    applier.prewarm()
    records, new = bma.version(adapter, applier, 0.05, seed=2)
    swapped = dict(new)
    a, b = "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
    swapped[a], swapped[b] = new[b], new[a]
    applier.apply(records)
    assert bma.mismatches(applier, new) == []
    assert sorted(bma.mismatches(applier, swapped)) == sorted([a, b])
    assert np.array_equal(applier.canonical_bits(a).view(np.int16), bma._bits(new[a]))
