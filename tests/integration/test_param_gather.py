"""With megatron's distributed optimizer and ``overlap_param_gather=True``, the BF16 params
are NOT current on every rank right after ``optimizer.step()`` (that is the negative
control: the two data-parallel ranks differ there); the hook's forced gather makes them
current and identical before anything is diffed, and training continues normally."""
import json
import math
import os

from ._launch import torchrun

HERE = os.path.dirname(__file__)


def test_hook_forces_the_deferred_param_gather(tmp_path):
    out = tmp_path / "out.json"
    torchrun(os.path.join(HERE, "param_gather_worker.py"), 2, str(out), str(tmp_path / "store"))
    r = json.loads(out.read_text())
    assert r["deferred"] == 1  # from_model found the DDP wrapper with the deferred gather
    steps = r["steps"]
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps)
    assert not any(s["identical_before_sync"] for s in steps)  # stale halves right after step()
    assert all(s["identical_after_sync"] for s in steps)
    assert len({s["digest"] for s in steps}) == 3  # every step changed the weights
