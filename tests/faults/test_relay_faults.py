"""Relay classes of the fault campaign (``scripts/fault_campaign.py --classes relay``):
the test-bed relay's byte flipper, the plans, and one relay epoch (the real trainer under
torchrun/gloo, the real relay server twice in a chain, two receivers reading through it,
moto S3 as the origin) with every relay class once, checked bit for bit."""
import json
import os

import pytest

from nemo_dcr_testbed.campaign import cli, kinds, report
from nemo_dcr_testbed.faults import Plans
from nemo_dcr_testbed.relay_faults import FlippingStore, flip, open_upstreams
from nemo_dcr.transport.failover import FailoverStore
from nemo_dcr.transport.store import HOP_POLICY, LocalDirStore, StorePolicy


def test_flip_one_bit():
    data = bytes(range(64))
    out = flip(data, 0.5, 3)
    diff = [i for i in range(64) if out[i] != data[i]]
    assert diff == [32] and out[32] ^ data[32] == 8
    assert flip(data, 1.0, 0)[-1] == data[-1] ^ 1  # the offset stays inside the object
    assert flip(b"", 0.5, 0) == b""


def test_flipping_store_acts_only_on_its_plan(tmp_path):
    origin = LocalDirStore(str(tmp_path / "store"))
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    keys = {"a": "v/00000003/chunks/r000-00000.dcr", "b": "v/00000003/chunks/r001-00000.dcr",
            "m": "v/00000003/MANIFEST.json", "old": "v/00000002/chunks/r000-00000.dcr", "head": "HEAD.json"}
    for k in keys.values():
        origin.put(k, bytes(range(200)))
    fault = {"kind": "relay_flip", "target": "rb", "mode": "every_chunk", "offset": 0.25, "bit": 7}
    (plan_dir / "v3.json").write_text(json.dumps({"trial": 0, "cls": "relay_flip", "faults": [fault]}))
    flipper = FlippingStore(origin, Plans(str(plan_dir), "rb"))
    bystander = FlippingStore(origin, Plans(str(plan_dir), "ra"))  # negative control: not the target
    good = bytes(range(200))
    assert flipper.get(keys["a"]) != good and flipper.get(keys["b"]) != good
    assert flipper.get_with_info(keys["a"])[0] == flip(good, 0.25, 7)
    for k in ("m", "old", "head"):  # documents, other versions: untouched
        assert flipper.get(keys[k]) == good
    assert all(bystander.get(k) == good for k in keys.values())
    assert flipper.flipped == 3 and bystander.flipped == 0
    # one_chunk: rank 0's first chunk only
    (plan_dir / "v4.json").write_text(json.dumps({"trial": 1, "cls": "relay_flip", "faults": [
        {**fault, "mode": "one_chunk"}]}))
    for k in ("v/00000004/chunks/r000-00000.dcr", "v/00000004/chunks/r001-00000.dcr"):
        origin.put(k, good)
    assert flipper.get("v/00000004/chunks/r000-00000.dcr") != good
    assert flipper.get("v/00000004/chunks/r001-00000.dcr") == good
    assert not hasattr(flipper, "get_verified")  # a verifying read would go around the flip


def test_open_upstreams_policies(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tight = open_upstreams(f"{a},{b}", hop_timeout_s=1.5, retry_after_s=2.0)
    assert isinstance(tight, FailoverStore) and tight.retry_after_s == 2.0
    assert (tight.stores[0].policy.timeout_s, tight.stores[0].policy.retries) == (1.5, 1)
    assert tight.stores[1].policy == StorePolicy()  # the origin keeps the default
    product = open_upstreams(f"{a},{b}", hop_timeout_s=None, retry_after_s=7.0)  # control: the product's shape
    assert product.stores[0].policy == HOP_POLICY and product.retry_after_s == 7.0
    assert isinstance(open_upstreams(a, hop_timeout_s=1.5, retry_after_s=2.0), LocalDirStore)


def test_relay_plans_and_class_groups():
    for t in range(40):
        for cls in kinds.RELAY_CLASSES:
            plan = kinds.make_plan(5, t, cls)
            assert plan == kinds.make_plan(5, t, cls)
            (f,) = plan["faults"]
            assert f["kind"] == cls and f["target"] in kinds.RELAYS
    assert set(kinds.CLASS_GROUPS["relay"]) == {"none", *kinds.RELAY_CLASSES}
    with pytest.raises(SystemExit):  # receiver store injectors are off in relay epochs
        cli.main(["--classes", "relay_kill,chunk_tamper", "--report-only", "--results", os.devnull])


# explicit: the campaign is the test bed's package (nemo_dcr_testbed.campaign, outside tests/), whose
# calls tests/conftest.py's auto-marker does not follow; it starts torchrun trainers, relays, receivers and
# a moto server
@pytest.mark.spawns
def test_relay_campaign(tmp_path):
    # the flip first (its relay has not been left for an earlier fault), a clean step last
    schedule = ["relay_flip", "relay_kill", "relay_stop", "relay_restart_empty", "none"]
    results, out = tmp_path / "r.jsonl", tmp_path / "s.json"
    rc = cli.main(["--trials", str(len(schedule)), "--seed", "2", "--schedule", "list", "--ack-timeout-s", "8",
                   "--classes", ",".join(schedule), "--results", str(results), "--out", str(out),
                   "--work", str(tmp_path / "work")])
    summary = json.loads(out.read_text())
    assert summary["violations"] == [], summary["violations"]
    assert summary["silent_corruptions"] == 0 and summary["hangs"] == 0 and rc == 0
    assert summary["relay_trials"] == 4 and summary["relay_silent_corruptions"] == 0
    assert summary["classes"] == {c: {"trials": 1, "silent_corruptions": 0}
                                  for c in (*kinds.RELAY_CLASSES, "none@relay")}
    by = summary["by_class"]
    for cls in kinds.RELAY_CLASSES:
        assert by[cls]["receiver_reloads"] == 0 and by[cls]["relay_crashes"] == 0, (cls, by[cls])
    # the flipped bytes reached a receiver, which left that relay for its next upstream
    assert by["relay_flip"]["flipped_chunks"] >= 1 and by["relay_flip"]["reparented"] == 1
    assert by["none@relay"]["committed"] == 1
    recs = [json.loads(x) for x in results.read_text().splitlines()]
    assert all(r["topology"] == "relay" for r in recs)


def _plan(plan_dir, v, fault, trial=0):
    (plan_dir / f"v{v}.json").write_text(json.dumps({"trial": trial, "cls": "x", "faults": [fault]}))


def test_lying_store_documents(tmp_path):
    """The liar's document lies act on the planned version and role only (controls: another
    role, another version, and the lie served once per plan, counted across restarts)."""
    from nemo_dcr_testbed.relay_faults import OVERSIZE_PAD, LyingStore

    origin = LocalDirStore(str(tmp_path / "store"))
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    for v in (1, 2, 3):
        origin.put(f"v/{v:08d}/DECISION.json", f"decision {v}".encode())
        origin.put(f"v/{v:08d}/MANIFEST.json", f"manifest {v}".encode())
    _plan(plan_dir, 3, {"kind": "doc_lie", "target": "ra", "doc": "decision", "mode": "older"})
    liar, honest = LyingStore(origin, Plans(str(plan_dir), "ra")), LyingStore(origin, Plans(str(plan_dir), "rb"))
    key = "v/00000003/DECISION.json"
    info = liar.stat(key)  # the relay stats before it fetches: the lie's own size and tag
    assert info.size == len(b"decision 2") and liar.get_with_info(key, max_bytes=info.size)[0] == b"decision 2"
    assert liar.get(key) == b"decision 3"  # once: the next fetch is honest
    assert LyingStore(origin, Plans(str(plan_dir), "ra")).get(key) == b"decision 3"  # a restarted liar too
    assert honest.get(key) == b"decision 3" and liar.get("v/00000002/DECISION.json") == b"decision 2"
    _plan(plan_dir, 2, {"kind": "doc_lie", "target": "ra", "doc": "decision", "mode": "oversize"}, trial=1)
    assert liar.stat("v/00000002/DECISION.json").size == OVERSIZE_PAD + len(b"decision 2")
    _plan(plan_dir, 1, {"kind": "hide", "target": "ra", "doc": "manifest", "mode": "not_found"}, trial=2)
    assert liar.stat("v/00000001/MANIFEST.json") is None and not liar.exists("v/00000001/MANIFEST.json")
    with pytest.raises(KeyError):
        liar.get("v/00000001/MANIFEST.json")
    assert honest.get("v/00000001/MANIFEST.json") == b"manifest 1" and liar.lies == 5  # 2 lies + 3 hidden reads


def test_lying_store_head_acks_bootstrap(tmp_path):
    from nemo_dcr_testbed.relay_faults import LyingStore

    origin = LocalDirStore(str(tmp_path / "store"))
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    liar = LyingStore(origin, Plans(str(plan_dir), "rb"))
    origin.put("HEAD.json", json.dumps({"version": 4}).encode())
    assert json.loads(liar.get("HEAD.json"))["version"] == 4  # honest: remembered
    _plan(plan_dir, 5, {"kind": "hide", "target": "rb", "doc": "head", "mode": "frozen"})
    origin.put("HEAD.json", json.dumps({"version": 5}).encode())
    assert json.loads(liar.get("HEAD.json"))["version"] == 4 and liar.stat("HEAD.json").tag.startswith("frozen")
    _plan(plan_dir, 5, {"kind": "hide", "target": "rb", "doc": "head", "mode": "not_found"}, trial=1)
    liar = LyingStore(origin, Plans(str(plan_dir), "rb"))
    assert liar.stat("HEAD.json") is None
    origin.put("HEAD.json", json.dumps({"version": 6}).encode())  # control: the next version is not hidden
    assert json.loads(liar.get("HEAD.json"))["version"] == 6
    _plan(plan_dir, 6, {"kind": "ack_drop", "target": "rb", "mode": "drop"})
    liar.put("acks/r0/00000006.json", b"ack")
    assert not origin.exists("acks/r0/00000006.json")
    liar.put("acks/r0/00000005.json", b"ack")  # control: another version's ack is forwarded
    assert origin.get("acks/r0/00000005.json") == b"ack"
    _plan(plan_dir, 7, {"kind": "ack_drop", "target": "rb", "mode": "flip"})
    liar.put("acks/r0/00000007.json", b"ack")
    assert origin.get("acks/r0/00000007.json") == flip(b"ack", 0.5, 0)
    origin.put("RUN.json", b"run record")
    _plan(plan_dir, 8, {"kind": "bootstrap_lie", "target": "rb", "obj": "run", "mode": "flip", "offset": 0.0, "bit": 0})
    assert liar.stat("RUN.json") is not None and liar.get("RUN.json") == flip(b"run record", 0.0, 0)
    assert liar.get("RUN.json") == b"run record"  # once per plan
    _plan(plan_dir, 9, {"kind": "none", "target": "x"})  # the newest plan has no lie: honest
    assert LyingStore(origin, Plans(str(plan_dir), "rb")).get("RUN.json") == b"run record"


def test_new_class_plans_and_groups():
    for t in range(40):
        for cls in kinds.LIAR_CLASSES:
            (f,) = kinds.make_plan(6, t, cls)["faults"]
            assert f["target"] in kinds.RELAYS
        for cls in kinds.DRIVER_CLASSES + kinds.EXIT_CLASSES:
            assert kinds.make_plan(6, t, cls)["faults"][0]["target"] == "driver"
    assert set(kinds.LIAR_BOUNDS) == {*kinds.LIAR_CLASSES, "planted_keys"}
    assert all(lies_on >= 1 and bound >= 0 for lies_on, bound in kinds.LIAR_BOUNDS.values())
    # a hidden HEAD is probed after HEAD_PROBE_S (10 s): the liar hides it past that, and the
    # version that must commit is the last it hides (control: a hidden manifest keeps (2, 1))
    assert kinds.liar_bound("relay_hides", {"doc": "head"}, 3.0) == (5, 4)
    assert kinds.liar_bound("relay_hides", {"doc": "head"}, 6.0) == (3, 2)
    assert kinds.liar_bound("relay_hides", {"doc": "manifest"}, 3.0) == kinds.LIAR_BOUNDS["relay_hides"] == (2, 1)
    with pytest.raises(SystemExit):  # a relay epoch and a pipelined one cannot be one epoch
        cli.main(["--classes", "relay_hides,exit_without_finish", "--report-only", "--results", os.devnull])
    assert report._row({"cls": "planted_keys", "topology": "relay"}) == "planted_keys"
    assert report._row({"cls": "none", "topology": "relay"}) == "none@relay"
