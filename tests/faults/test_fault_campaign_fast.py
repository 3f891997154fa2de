"""Fast subset of the fault campaign (``scripts/fault_campaign.py``): one trial of every
store fault class (the relay classes: ``test_relay_faults.py``) against the real pipeline (megatron-core trainer ranks under torchrun/gloo,
two receiver processes, a moto S3 server), each checked bit for bit against the trainer's
dense state.  The trainer kill comes last, so only one trainer is started."""
import json

import pytest
import torch
from nemo_dcr_testbed.campaign import checks, cli, kinds


def test_compare_state_negative_control():
    dense = {"w": torch.randn(4, 8).to(torch.bfloat16), "n": torch.ones(8, dtype=torch.bfloat16)}
    served = {k: v.clone() for k, v in dense.items()} | {"rotary.inv_freq": torch.ones(2)}
    assert checks.compare_state(served, dense) == []
    flipped = served["w"].clone()
    flipped.view(torch.int16).view(-1)[5] ^= 1  # one bit
    assert checks.compare_state(served | {"w": flipped}, dense) == ["w"]
    assert checks.compare_state({"w": served["w"]}, dense) == ["n"]  # missing tensor
    assert checks.compare_state(served | {"n": served["n"].float()}, dense) == ["n"]  # dtype


def test_plans_are_seeded():
    for cls in kinds.CLASSES:
        assert kinds.make_plan(3, 7, cls) == kinds.make_plan(3, 7, cls)
    assert [kinds.choose_class(1, t, "random", kinds.CLASSES) for t in range(50)] == \
        [kinds.choose_class(1, t, "random", kinds.CLASSES) for t in range(50)]


# explicit: the campaign is the test bed's package (nemo_dcr_testbed.campaign, outside tests/), whose
# calls tests/conftest.py's auto-marker does not follow; it starts torchrun trainers, receivers and a moto server
@pytest.mark.spawns
def test_fast_campaign(tmp_path):
    classes = [c for c in kinds.STORE_CLASSES if c != "trainer_kill"]  # relay classes: test_relay_faults.py
    # every class once, the one that ends the run last; "none" between faults gives recoveries
    order = [c for c in classes if c != "none"]
    schedule = [x for c in order for x in (c, "none")] + ["trainer_kill"]
    results, out = tmp_path / "r.jsonl", tmp_path / "s.json"
    # ack timeout 8 s, not the campaign's 3 s: on a loaded 2-core machine a receiver restarted
    # by the previous fault took over 3 s to ack, and the "none" trial after it aborted (a
    # timing margin of the test bed, not a fault: the campaign script's default stays 3 s)
    rc = cli.main(["--trials", str(len(schedule)), "--seed", "1", "--schedule", "list",
                   "--ack-timeout-s", "8",
                   "--classes", ",".join(schedule), "--results", str(results), "--out", str(out),
                   "--work", str(tmp_path / "work")])
    summary = json.loads(out.read_text())
    assert summary["trials"] == len(schedule)
    assert set(summary["by_class"]) == set(kinds.STORE_CLASSES)
    assert summary["classes"] == {c: {"trials": schedule.count(c), "silent_corruptions": 0}
                                  for c in kinds.STORE_CLASSES}
    assert summary["violations"] == [], summary["violations"]
    assert summary["silent_corruptions"] == 0 and summary["hangs"] == 0
    assert rc == 0
    by = summary["by_class"]
    assert by["none"]["aborted"] == 0
    for cls in ("apply_exception", "one_refuses", "chunk_tamper", "trainer_kill"):
        assert by[cls]["detected"] == by[cls]["trials"], cls
    assert (tmp_path / "s.png").exists()
    # resumable: a second call finds every trial recorded and starts nothing
    assert cli.main(["--trials", str(len(schedule)), "--seed", "1", "--schedule", "list",
                     "--ack-timeout-s", "8", "--classes", ",".join(schedule), "--results", str(results),
                     "--out", str(out),
                     "--work", str(tmp_path / "work2")]) == 0
    assert not (tmp_path / "work2").exists()
    assert len(results.read_text().splitlines()) == len(schedule)
