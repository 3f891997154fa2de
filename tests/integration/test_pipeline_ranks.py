"""The pipelined refit on two trainer ranks (real megatron-core model, TP=2, gloo): both
ranks settle the same decisions one call later, a rank whose upload fails aborts the version
everywhere (the next one is diffed against the committed base), and a failure of the
background work on one rank is raised by every rank at the next call, with one message.
See ``pipeline_worker.py``."""
import json
import os

import pytest

from ._launch import torchrun

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.spawns


def test_both_ranks_settle_the_same_decisions_and_fail_together(tmp_path):
    torchrun(os.path.join(HERE, "pipeline_worker.py"), 2, str(tmp_path), str(tmp_path / "store"))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # version v is settled at the call of v + 1; the stats' totals live on rank 0
    assert [s[:3] for s in r0["settled"]] == [[1, 0, True], [2, 1, True], [3, 2, True], [4, 3, False], [5, 3, True]]
    assert [s[:3] for s in r1["settled"]] == [s[:3] for s in r0["settled"]]  # same decisions on both ranks
    assert "rank 1: OSError: injected: rank 1 cannot upload" in r0["settled"][3][3]
    assert r0["in_flight"] == r1["in_flight"] == [1, 2, 3, 4, 5, 6]
    # version 6's background failed on rank 0: both ranks raise the same error at step 7
    assert r0["error"] == r1["error"] and "version 6: the background refit failed on rank 0" in r0["error"]
    assert "injected: rank 0's decision step broke" in r0["error"]
    assert r0["baseline"] == r1["baseline"] == 5
    assert all(p > 0 for p in r0["pause_s"] + r1["pause_s"])
