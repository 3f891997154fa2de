"""Pipelined-refit and elastic-membership classes of the fault campaign
(``scripts/fault_campaign.py --classes pipeline``): the plans, the class checks, the driver's
kill of every trainer rank, and one pipelined epoch (the real trainer under torchrun/gloo
with ``refit.pipeline=true``, elastic membership and a checkpoint at every committed step,
receivers that die and join, moto S3) with every new class once, checked bit for bit."""
import json
import os
import subprocess
import sys
import time

import pytest
from nemo_dcr_testbed.campaign import cli, kinds, procs


def test_pipeline_plans_and_class_group():
    assert set(kinds.CLASS_GROUPS["pipeline"]) == {"none", *kinds.PIPELINE_CLASSES}
    seen_at = set()
    for t in range(60):
        for cls in kinds.PIPELINE_CLASSES:
            plan = kinds.make_plan(4, t, cls)
            assert plan == kinds.make_plan(4, t, cls)
            assert plan["faults"][0]["target"] == "driver"
        kill = kinds.make_plan(4, t, "trainer_kill_inflight")["faults"]
        seen_at.add(kill[0]["at"])
        # the decision is held (the version stays in flight) unless the kill waits for the decision
        assert any(f["kind"] == "hold" and f["target"] == "rank0" for f in kill) == (kill[0]["at"] != "decision")
    assert seen_at == set(kinds.KILL_MOMENTS)
    stalls = [kinds.make_plan(4, t, "store_stall_inflight")["faults"][0] for t in range(60)]
    assert {s["at"] for s in stalls} == set(kinds.STALL_MOMENTS) and {s["length"] for s in stalls} == {"short", "long"}
    # a short stall has its length, a long one its excess over the ack timeout (known to the epoch)
    assert all((s["stall_s"] is None) == (s["length"] == "long") != (s["over_ack_timeout_s"] is None) for s in stalls)
    assert all(f[1]["kind"] == "hold" and f[1]["target"] == "rank0"
               for f in (kinds.make_plan(4, t, "store_stall_inflight")["faults"] for t in range(60)))
    with pytest.raises(SystemExit):  # pipelined epochs take no store or relay class but the control
        cli.main(["--classes", "trainer_kill_inflight,chunk_tamper", "--report-only", "--results", os.devnull])


def test_descendants_finds_a_detached_grandchild():
    """The trainer ranks run in sessions of their own, out of torchrun's process group: the
    driver finds them through /proc (control: a process outside the tree is not listed)."""
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while len(procs._descendants(parent.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = procs._descendants(parent.pid)
        assert len(below) == 1 and outsider.pid not in below
        grandchild = below[0]
        # (caught between fork and setsid it is still in the parent's group: wait for the setsid)
        while os.getpgid(grandchild) == os.getpgid(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpgid(grandchild) != os.getpgid(parent.pid)  # killpg of the parent would miss it
        os.kill(grandchild, 9)
        deadline = time.monotonic() + 10
        while procs._pid_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not procs._pid_alive(grandchild) and procs._pid_alive(outsider.pid)
    finally:
        for p in (parent, outsider):
            p.kill()
            p.wait()


# explicit: the campaign is the test bed's package (nemo_dcr_testbed.campaign, outside tests/), whose
# calls tests/conftest.py's auto-marker does not follow; it starts torchrun trainers, receivers and a moto server
@pytest.mark.spawns
def test_pipeline_campaign(tmp_path):
    schedule = ["trainer_kill_inflight", "receiver_dies", "receiver_joins_midversion", "join_forged",
                "store_stall_inflight"]
    results, out = tmp_path / "r.jsonl", tmp_path / "s.json"
    rc = cli.main(["--trials", str(len(schedule)), "--seed", "3", "--schedule", "list", "--ack-timeout-s", "8",
                   "--classes", ",".join(schedule), "--results", str(results), "--out", str(out),
                   "--work", str(tmp_path / "work")])
    summary = json.loads(out.read_text())
    assert summary["violations"] == [], summary["violations"]
    assert summary["failures"] == [], summary["failures"]
    assert summary["silent_corruptions"] == 0 and summary["hangs"] == 0 and rc == 0
    assert summary["pipeline_trials"] == len(schedule)
    assert summary["classes"] == {c: {"trials": 1, "silent_corruptions": 0} for c in schedule}
    recs = {r["cls"]: r for r in map(json.loads, results.read_text().splitlines())}
    kill = recs["trainer_kill_inflight"]
    # seed 3, trial 0: killed once every receiver's ack of v is out, its decision held: v was in flight
    assert kill["fate"]["at"] == "acks" and kill["fate"]["decision"] is None and kill["fate"]["manifest"]
    assert kill["fate"]["resume"] == "ok" and kill["fate"]["next_version"] > kill["fate"]["in_use"] >= kill["version"]
    assert kill["committed"] and kill["versions"][-1]["version"] >= kill["fate"]["next_version"]
    dies = recs["receiver_dies"]
    assert dies["evicted_at"] is not None
    evicting = next(e for e in dies["versions"] if e["version"] == dies["evicted_at"])
    assert evicting["evicted"] == [dies["target"]] and dies["target"] not in evicting["members"]
    assert dies["versions"][-1]["committed"]
    join = recs["receiver_joins_midversion"]
    assert join["started_in_flight"] and join["admitted_at"] > join["version"]
    assert join["target"] in join["versions"][-1]["members"] and join["versions"][-1]["committed"]
    forged = recs["join_forged"]
    assert not any(e["joined"] for e in forged["versions"]) and all(e["committed"] for e in forged["versions"])
    stall = recs["store_stall_inflight"]
    # the store stopped while v was in flight: v decided one way, then a version commits, members unchanged
    assert stall["stall"]["moment_seen"] and stall["stall"]["outcome"] in ("commit", "abort")
    assert stall["versions"][-1]["committed"] and not any(e.get("evicted") for e in stall["versions"])


def test_busy_watch_logs_a_settle_waiting_on_progress_once():
    """The receiver's settle starts at the first idle follower step; a request that waits
    longer than BUSY_LOG_S on steps that keep progressing is logged once (the old record's
    hang, 'j2: no settled state within 120s', had nothing to show why).  Controls: an idle
    step resets the wait; a wait under the bound logs nothing."""
    from nemo_dcr_testbed.faults import BusyWatch

    w = BusyWatch(after_s=30.0)
    assert w.note(True, 0.0, 0.5) is None and w.note(True, 10.0, 29.0) is None  # under the bound
    late = w.note(True, 30.0, 31.5)
    assert late == {"busy_s": 31.5, "steps": 3, "last_step_s": 1.5}
    assert w.note(True, 40.0, 41.0) is None  # once per wait
    assert w.note(False, 50.0, 50.1) is None  # an idle step: the settle runs, the wait ends
    assert w.note(True, 60.0, 61.0) is None and w.note(True, 62.0, 92.0)["steps"] == 2
