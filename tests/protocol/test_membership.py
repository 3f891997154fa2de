"""Elastic receiver membership (``refit.membership=elastic``): eviction of a receiver that
stops acknowledging, joining a running run with a signed join request, what a store writer
without the key cannot do to the member set, and recovery of the member set on resume.

Same harness as test_joint_commit.py: an in-process RefitSender over a plain tensor and
receivers (Receiver + Follower over a numpy stand-in runtime) on threads, through a real
directory store signed with a key.  End states are compared through integer views, each
with a perturbed negative control; every attack has a genuine control that is admitted.
"""
import dataclasses
import json
import time

import numpy as np
import pytest
import torch
from protocol_helpers import ArrayRuntime, Rx, _sender, _step, bits_of, key, root_of  # noqa: F401 - key: fixture

from nemo_dcr.errors import ValidationError
from nemo_dcr.sender import RefitSender
from nemo_dcr.protocol.commit import CommitCoordinator
from nemo_dcr.protocol.manifest import (
    Decision,
    doc_digest,
    JoinRequest,
    ManifestError,
    ack_key,
    decision_key,
    join_key,
    join_key_receiver,
)
from nemo_dcr.protocol.signing import Sealer, SignatureError, load_key


def _decision(store, v) -> Decision:
    return Decision.from_json(store.get(decision_key(v)))


def _assert_bit_exact(got: np.ndarray, want: np.ndarray, w0: np.ndarray) -> None:
    np.testing.assert_array_equal(got.view(np.int16), want.view(np.int16))
    bad = got.copy()
    bad[len(bad) // 2] ^= 1  # negative control: one flipped bit is seen
    assert not np.array_equal(bad.view(np.int16), want.view(np.int16))
    assert not np.array_equal(got.view(np.int16), w0.view(np.int16))  # the versions did change it


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _requested(rx: Rx, held: int):
    return lambda: any(e.get("event") == "join requested" and e.get("held") == held for e in rx.events)


@pytest.mark.parametrize("membership", ["elastic", "static"])
def test_a_dead_receiver_is_evicted_and_later_versions_commit_with_the_rest(tmp_path, key, membership):
    """r1 never acknowledges.  Elastic, with the default evict_after=3 and
    max_consecutive_failures=3: v1 and v2 abort (misses, two in a row), v3 evicts it and
    commits with r0, v4 commits with r0.  Static (the control): every version aborts."""
    rng = np.random.default_rng(10)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = bits_of(w)
    kw = {} if membership == "elastic" else {"max_consecutive_failures": 10}
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"), membership=membership,
                            ack_timeout_s=1.0, **kw)
    assert sender.cfg.evict_after == 3
    r0 = Rx("r0", store, key, sender.run_id, w.clone()).start(until=4)
    stats = []
    for v in (1, 2, 3, 4):
        _step(w, rng)
        stats.append(sender.refit(v))
    r0.join()
    decisions = [_decision(store, v) for v in (1, 2, 3, 4)]
    if membership == "static":
        assert [d.commit for d in decisions] == [False] * 4
        assert all("r1: no acknowledgement" in s.reason for s in stats)
        assert all(d.receivers == ("r0", "r1") and d.evicted == () for d in decisions)
        assert sender.baseline.version == 0
        _assert_bit_exact(r0.w, w0, bits_of(w))  # r0 rolled every version back: still at v0
        return
    assert [d.commit for d in decisions] == [False, False, True, True]
    assert all("r1: no acknowledgement" in s.reason for s in stats[:2])
    assert all(d.receivers == ("r0", "r1") and d.evicted == () for d in decisions[:2])
    assert decisions[2].receivers == ("r0",) and decisions[2].evicted == ("r1",)
    assert stats[2].evicted == ("r1",) and stats[2].members == ("r0",)
    assert decisions[3].receivers == ("r0",) and decisions[3].evicted == ()
    assert sender.baseline.version == 4
    _assert_bit_exact(r0.w, bits_of(w), w0)


def test_a_fresh_receiver_joins_and_its_ack_is_then_required(tmp_path, key):
    """r1 starts after v1, catches up, asks to join and is admitted at v2; the version it
    refuses (v3) aborts; v4 commits on both, bit-exact."""
    rng = np.random.default_rng(11)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic",
                            ack_timeout_s=10, max_consecutive_failures=10)
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=4)
    _step(w, rng)
    assert sender.refit(1).committed
    r1 = Rx("r1", store, key, sender.run_id, w0, refuse={3})  # apply calls: v1, v2, v3
    r1.follower.join = True
    r1.start(until=4)
    _wait(_requested(r1, 1), "r1's join request holding v1")
    _step(w, rng)
    s2 = sender.refit(2)
    assert s2.committed and s2.joined == ("r1",) and s2.members == ("r0", "r1")
    d2 = _decision(store, 2)
    assert d2.joined == ("r1",) and d2.receivers == ("r0", "r1")
    _step(w, rng)
    s3 = sender.refit(3)
    assert not s3.committed and "r1: refusing apply call 3" in s3.reason  # its ack now counts
    _step(w, rng)
    assert sender.refit(4).committed
    r0.join()
    r1.join()
    assert [e["version"] for e in r1.events if e.get("event") == "joined"] == [2]
    assert _decision(store, 4).receivers == ("r0", "r1")
    for r in (r0, r1):
        _assert_bit_exact(r.w, bits_of(w), bits_of(w0))


def test_a_non_member_answers_but_its_refusal_does_not_count(tmp_path, key):
    rng = np.random.default_rng(12)
    w = torch.randn(32, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic")
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=1)
    r9 = Rx("r9", store, key, sender.run_id, w0, refuse={1}).start(until=1)  # no --join: never a member
    _step(w, rng)
    s1 = sender.refit(1)
    r0.join()
    r9.join()
    assert s1.committed and s1.members == ("r0",)
    assert json.loads(store.get(ack_key("r9", 1)))["ok"] is False  # it refused; v1 committed anyway
    assert not store.exists(join_key("r9"))
    _assert_bit_exact(r0.w, bits_of(w), bits_of(w0))


def test_forged_oversized_and_nested_join_requests_are_ignored_and_logged_once(tmp_path, key, capsys):
    rng = np.random.default_rng(13)
    w = torch.randn(32, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic",
                            ack_timeout_s=1.0, max_consecutive_failures=20)
    sealer = Sealer(load_key(key))
    run_id = sender.run_id
    w0 = w.clone()
    r0 = Rx("r0", store, key, run_id, w0).start(until=4)
    root = root_of(store, key, run_id)

    def req(rid="r9", **kw):
        fields = dict(run_id=run_id, receiver=rid, held_version=0, held_digest=root)
        return JoinRequest(**{**fields, **kw})

    # v1 publishes with base 0 (held 0 is a known commit for every one of these)
    attacks = {
        "r1": req("r1").to_json(),  # unsigned
        "r2": req("r2").to_json(Sealer(bytes(32))),  # another key
        "r3": req("r3", run_id="f" * 32).to_json(sealer),  # another run
        "r4": b'{"format": "nemo-dcr-join", "pad": "' + b"x" * (70 << 10) + b'"}',  # over the 64 KiB cap
        "r5": b'{"a":' * 200 + b"1" + b"}" * 200,  # nested 200 deep
        "r6": req("r6", held_digest="sha256:" + "0" * 64).to_json(sealer),  # not a commit it knows
        "r7": req("r8").to_json(sealer),  # names another receiver than its key
        "r8": b"\xff\xfe not json",
    }
    for rid, data in attacks.items():
        store.put(join_key(rid), data)
    for v in (1, 2, 3):
        _step(w, rng)
        s = sender.refit(v)
        assert s.committed and s.joined == () and s.members == ("r0",), s
    err = capsys.readouterr().err
    for rid in attacks:  # each planted object logged once (by identity), never again
        assert err.count(f'"ignored": "{join_key(rid)}"') == 1, (rid, err)
    for why in ("bad signature", "unsigned", "over the limit of 65536", "nested more", "of run fff",
                "not a committed version", "names receiver", "not UTF-8"):
        assert why in err, (why, err)
    # control: a genuine request of this run, signed, holding the committed v3, is admitted
    d3 = store.get(decision_key(3))
    store.put(join_key("r9"), req("r9", held_version=3, held_digest=doc_digest(d3)).to_json(sealer))
    _step(w, rng)
    s4 = sender.refit(4)
    assert s4.joined == ("r9",) and not s4.committed and "r9: no acknowledgement" in s4.reason
    r0.join()
    _assert_bit_exact(r0.w, sender.baseline.bits("w"), bits_of(w0))  # at v3: v4 was rolled back


def test_a_replayed_join_request_does_not_readmit_an_evicted_receiver(tmp_path, key):
    """r1's genuine request admits it at v1; it never acks and is evicted at once
    (evict_after=1), v1 commits with r0.  The same request, still there or put again (a
    replay), is refused at v2 and v3; a new request holding v3 (the control) is admitted."""
    rng = np.random.default_rng(14)
    w = torch.randn(32, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic", evict_after=1,
                            ack_timeout_s=1.0, max_consecutive_failures=10)
    sealer = Sealer(load_key(key))
    run_id = sender.run_id
    w0 = w.clone()
    r0 = Rx("r0", store, key, run_id, w0).start(until=4)
    old = JoinRequest(run_id=run_id, receiver="r1", held_version=0,
                      held_digest=root_of(store, key, run_id)).to_json(sealer)
    store.put(join_key("r1"), old)
    _step(w, rng)
    s1 = sender.refit(1)
    d1 = _decision(store, 1)
    assert s1.committed and d1.joined == ("r1",) and d1.evicted == ("r1",) and d1.receivers == ("r0",)
    _step(w, rng)
    assert sender.refit(2).joined == ()  # the consumed request is still there
    store.delete(join_key("r1"))
    store.put(join_key("r1"), old)  # replayed: a new object, the same signed bytes
    _step(w, rng)
    s3 = sender.refit(3)
    assert s3.committed and s3.joined == ()
    fresh = JoinRequest(run_id=run_id, receiver="r1", held_version=3,
                        held_digest=doc_digest(store.get(decision_key(3)))).to_json(sealer)
    store.put(join_key("r1"), fresh)
    _step(w, rng)
    s4 = sender.refit(4)
    assert s4.joined == ("r1",) and s4.evicted == ("r1",) and s4.committed  # admitted, then evicted again
    r0.join()
    _assert_bit_exact(r0.w, bits_of(w), bits_of(w0))


def test_an_evicted_receiver_rejoins_by_itself(tmp_path, key):
    """r1 is down for v1 and v2 (evicted at v2), then restarts from version 0 with joining
    on: it catches up, sees itself evicted, asks again and is a member from v3."""
    rng = np.random.default_rng(15)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"), membership="elastic",
                            evict_after=2, ack_timeout_s=1.0, max_consecutive_failures=10)
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=4)
    for v in (1, 2):
        _step(w, rng)
        sender.refit(v)
    assert _decision(store, 2).evicted == ("r1",) and _decision(store, 2).commit
    r1 = Rx("r1", store, key, sender.run_id, w0)
    r1.follower.join = True
    r1.start(until=4)
    _wait(_requested(r1, 2), "r1's join request holding v2")
    assert any(e.get("event") == "evicted" and e["version"] == 2 for e in r1.events), r1.events
    for v in (3, 4):
        _step(w, rng)
        assert sender.refit(v).committed
    r0.join()
    r1.join()
    assert _decision(store, 3).joined == ("r1",) and _decision(store, 4).receivers == ("r0", "r1")
    for r in (r0, r1):
        _assert_bit_exact(r.w, bits_of(w), bits_of(w0))


@pytest.mark.parametrize("tamper", [False, True])
def test_a_resumed_trainer_recovers_the_member_set_from_the_signed_decision(tmp_path, key, tamper):
    """r1 is evicted at v1 (evict_after=1).  The trainer resumes from v1's checkpoint with
    the same settings (receivers r0, r1; now evict_after=3): its members are v1's decision's
    (r0 alone), so v2 commits though r1 is still down.  With the decision replaced by one
    of other bytes (tamper), the member set cannot be recovered: v2 aborts, nothing joins."""
    rng = np.random.default_rng(16)
    w = torch.randn(32, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"), membership="elastic",
                            evict_after=1, ack_timeout_s=1.0, max_consecutive_failures=10)
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=1)
    _step(w, rng)
    assert sender.refit(1).committed and _decision(store, 1).receivers == ("r0",)
    r0.join()
    checkpoint = sender.run_state()
    cfg = dataclasses.replace(sender.cfg, evict_after=3)
    again = RefitSender({"w": w.clone()}, sender.views, sender.projector, store, cfg)
    again.claim(resume=checkpoint)
    assert again.coordinator.receivers == ("r0", "r1")  # not known before the first version
    if tamper:
        sealer = Sealer(load_key(key))
        d = _decision(store, 1)
        store.put(decision_key(1), dataclasses.replace(d, receivers=("r0", "r1"), evicted=()).to_json(sealer))
    r0 = Rx("r0", store, key, sender.run_id, w0)  # restarted: catches up to v1, then answers v2
    if not tamper:
        r0.start(until=2)
    _step(again.params["w"], rng)
    s2 = again.refit(2)
    if tamper:
        assert not s2.committed and "member set cannot be recovered" in s2.reason
        assert _decision(store, 2).receivers == ()  # an abort naming no members: none are known
        return
    assert s2.committed and s2.members == ("r0",), s2.reason
    assert _decision(store, 2).receivers == ("r0",)
    r0.join()
    _assert_bit_exact(r0.w, bits_of(again.params["w"]), bits_of(w0))


def test_join_request_parsing_is_strict(key):
    sealer = Sealer(load_key(key))
    run_id = "a" * 32
    good = JoinRequest(run_id=run_id, receiver="r1", held_version=2, held_digest="sha256:" + "1" * 64)
    assert JoinRequest.from_json(good.to_json(sealer), sealer) == good
    doc = json.loads(good.to_json(sealer))
    doc["held_version"] = 3
    with pytest.raises(SignatureError):
        JoinRequest.from_json(json.dumps(doc).encode(), sealer)
    with pytest.raises(SignatureError):  # domain separation: a join request never opens as an ack
        sealer.open("ack", good.to_json(sealer), "x")
    for bad in ({"held_version": -1}, {"held_digest": "sha256:zz"}, {"receiver": "../x"}, {"run_id": "x"}):
        with pytest.raises(ManifestError):
            JoinRequest(**{**dataclasses.asdict(good), **bad})
    extra = {k: v for k, v in json.loads(good.to_json()).items() if k != "signature"}
    extra["more"] = 1
    with pytest.raises(ManifestError, match="unknown fields"):
        JoinRequest.from_json(Sealer(None).seal("join", extra), Sealer(None))
    assert join_key_receiver(join_key("r1")) == "r1"
    assert join_key_receiver("acks/r1/00000001.json") is None and join_key_receiver("acks/join.d/a.b.json") is None
    # an ack's key read back (nemo-dcr status lists acks/): only what ack_key writes
    from nemo_dcr.protocol.keys import ack_key_parts
    assert ack_key_parts(ack_key("r1", 7)) == ("r1", 7)
    for stray in (join_key("r1"), "acks/r1/7.json", "acks/r1/0000000x.json", "acks/../00000001.json",
                  "acks/r1/00000001.json.tmp", "v/00000001/ack.json"):
        assert ack_key_parts(stray) is None, stray
    # a decision with joined/evicted that disagree with receivers is refused
    with pytest.raises(ManifestError):
        Decision(run_id=run_id, version=2, base_version=1, commit=False, receivers=("r0",), evicted=("r0",))
    with pytest.raises(ManifestError):
        Decision(run_id=run_id, version=2, base_version=1, commit=False, receivers=("r0",), joined=("r2",))
    # decisions written before elastic membership (no joined/evicted) still open
    old = Sealer(None).seal("decision", {"run_id": run_id, "version": 2, "base_version": 1, "commit": False,
                                         "receivers": ["r0"], "reason": "x", "manifest_digest": ""})
    assert Decision.from_json(old).receivers == ("r0",)
    with pytest.raises(ValidationError):
        CommitCoordinator(None, sealer, run_id, ("r0",), ack_timeout_s=1, membership="dynamic")


def test_receive_cli_join_flag_makes_the_receiver_ask_to_join(tmp_path, key, monkeypatch):
    """``nemo-dcr receive --join`` end to end over the stand-in runtime (the session that
    ``build_receiver`` would load is replaced by one over an ArrayRuntime): r1 asks, is
    admitted at v2, and v2 commits only with its ack.  Control: without ``--join`` the same
    receiver writes no request and v2 commits with r0 alone."""
    import threading

    from nemo_dcr.receiver import bootstrap
    from nemo_dcr.receiver import cli as receive_cli

    rng = np.random.default_rng(17)
    w = torch.randn(32, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic", ack_timeout_s=10)
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=4)
    made = {}

    def fake_build(store_, sealer, cfg, **kw):
        made[cfg.receiver_id] = rx = Rx(cfg.receiver_id, store, key, sender.run_id, w0)
        return bootstrap.ReceiverSession(receiver=rx.rx, follower=rx.follower, runtime=rx.runtime,
                                         run_id=sender.run_id, init_dir="", committed=0)

    monkeypatch.setattr(bootstrap, "build_receiver", fake_build)
    monkeypatch.setattr(ArrayRuntime, "close", lambda self: None, raising=False)  # the session closes it
    _step(w, rng)
    assert sender.refit(1).committed
    codes = {}
    for rid, flags, until in (("r1", ["--join"], 4), ("r2", [], 4)):
        argv = ["--store", str(tmp_path / "store"), "--receiver-id", rid, "--model-id", "m", "--key-file", key,
                "--until-version", str(until), "--timeout-s", "20", "--poll-s", "0.01", *flags]
        t = threading.Thread(target=lambda a=argv, r=rid: codes.__setitem__(r, receive_cli.main(a)), daemon=True)
        t.start()
        codes[rid + "-thread"] = t
    _wait(lambda: "r1" in made and _requested(made["r1"], 1)(), "r1's join request")
    _step(w, rng)
    s2 = sender.refit(2)
    assert s2.committed and s2.joined == ("r1",) and s2.members == ("r0", "r1")
    # control: r2 (no --join) follows and acks, never asks, and never becomes a member
    for v in (3, 4):
        _step(w, rng)
        s = sender.refit(v)
        assert s.committed and s.members == ("r0", "r1"), s.reason
    for rid in ("r1", "r2"):
        codes[rid + "-thread"].join(timeout=30)
        assert codes[rid] == 0
        _assert_bit_exact(made[rid].w, bits_of(w), bits_of(w0))
    r0.join()
    assert [e["version"] for e in made["r1"].events if e.get("event") == "joined"] == [2]
    assert not store.exists(join_key("r2"))
    assert not any(e.get("event") == "join requested" for e in made["r2"].events)


def test_a_join_request_passes_through_a_relay(tmp_path, key):
    """A receiver behind a relay writes its request through it (the relay writes through only
    keys under ``acks/``; control: the same request under ``members/`` is refused there), and
    the trainer admits it at the next version."""
    from nemo_dcr.errors import DcrError
    from nemo_dcr.transport.relay import RelayThread
    from nemo_dcr.transport.relay_client import RelayStore
    from nemo_dcr.transport.store import StorePolicy

    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic", ack_timeout_s=0.5,
                            max_consecutive_failures=10)
    data = JoinRequest(run_id=sender.run_id, receiver="r1", held_version=0,
                       held_digest=root_of(store, key, sender.run_id)).to_json(Sealer(load_key(key)))
    with RelayThread(store) as relay:
        via = RelayStore(relay.uri, policy=StorePolicy(timeout_s=10, retries=0, backoff_s=0.05))
        with pytest.raises(DcrError):
            via.put("members/r1/JOIN.json", data)
        via.put(join_key("r1"), data)
    assert store.get(join_key("r1")) == data and not store.exists("members/r1/JOIN.json")
    _step(w, np.random.default_rng(18))
    s1 = sender.refit(1)  # r1 (and r0) do not run: admitted, and its missing ack aborts v1
    assert s1.joined == ("r1",) and s1.members == ("r0", "r1") and "r1: no acknowledgement" in s1.reason


def test_fewer_members_than_min_receivers_abort_until_one_joins(tmp_path, key):
    """min_receivers=2: r1 dies and is evicted at v1 (evict_after=1); r0 alone acks, yet v1
    and v2 abort (one member); once r2 joins (a genuine request holding v0), v3 commits."""
    rng = np.random.default_rng(19)
    w = torch.randn(32, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"), membership="elastic",
                            min_receivers=2, evict_after=1, ack_timeout_s=1.0, max_consecutive_failures=10)
    r0 = Rx("r0", store, key, sender.run_id, w0).start(until=3)
    for v in (1, 2):
        _step(w, rng)
        s = sender.refit(v)
        assert not s.committed and "fewer than min_receivers=2" in s.reason and s.members == ("r0",), s.reason
    assert _decision(store, 1).evicted == ("r1",) and _decision(store, 2).receivers == ("r0",)
    r2 = Rx("r2", store, key, sender.run_id, w0)
    r2.follower.join = True
    r2.start(until=3)
    _wait(_requested(r2, 0), "r2's join request holding v0")
    _step(w, rng)
    s3 = sender.refit(3)
    assert s3.committed and s3.joined == ("r2",) and s3.members == ("r0", "r2"), s3.reason
    r0.join()
    r2.join()
    for r in (r0, r2):
        _assert_bit_exact(r.w, bits_of(w), bits_of(w0))


@pytest.mark.parametrize("junk", [0, 1100])
def test_a_flood_of_join_keys_costs_one_bounded_listing(tmp_path, key, junk, monkeypatch):
    """A key-less writer plants ``junk`` keys under ``acks/join.d/`` that sort before a
    genuine request.  The trainer asks the store for at most ``JOIN_SCAN_KEYS`` keys per
    version (one bounded page, not the whole flood) and the version still commits; with the
    scan full of junk the genuine joiner waits (a delay, never a wrong admission).  Control
    (junk=0): the same request is admitted."""
    from nemo_dcr.protocol import commit as commit_mod

    rng = np.random.default_rng(12)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0",), membership="elastic",
                            ack_timeout_s=10, max_consecutive_failures=10)
    monkeypatch.setattr(commit_mod, "JOIN_SCAN_KEYS", 1000)
    for i in range(junk):
        store.put(f"acks/join.d/a{i:05d}.json", b"{")
    limits = []
    real_list = type(store).list

    def spy(self, prefix, *, limit=None):
        if prefix.startswith("acks/join.d"):
            limits.append(limit)
        return real_list(self, prefix, limit=limit)

    monkeypatch.setattr(type(store), "list", spy)
    r0 = Rx("r0", store, key, sender.run_id, w0.clone()).start(until=2)
    _step(w, rng)
    assert sender.refit(1).committed
    r1 = Rx("r1", store, key, sender.run_id, w0.clone())
    r1.follower.join = True
    r1.start(until=2)
    _wait(_requested(r1, 1), "r1's join request holding v1")
    _step(w, rng)
    s2 = sender.refit(2)
    r0.join()
    r1.join()
    assert s2.committed and limits and set(limits) == {1000}
    assert s2.joined == (() if junk else ("r1",))
