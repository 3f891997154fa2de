"""The protocol in one process: a trainer-side RefitSender (no process group) and receivers
(Receiver + Follower) on threads, through a real directory store, signed with a key.

The receivers' runtime is a stand-in (canonical numpy arrays updated with the codec's
``apply_delta_``): these tests are about runs, signatures, acks, decisions, rollback and
catch-up, not placement -- the real runtimes are covered by tests/receiver and
tests/integration.  Every end state is checked with integer views against the trainer's
bits, and each attack has a control that succeeds.
"""
import json
import threading

import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.codec import read_chunk_index
from nemo_dcr.errors import ProtocolError
from nemo_dcr.sender import ReceiverRefused, RefitSender
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    HEAD_KEY,
    Ack,
    Committed,
    Decision,
    Head,
    Manifest,
    ack_key,
    decision_key,
    manifest_key,
)
from nemo_dcr.protocol.run import ForeignRunError
from nemo_dcr.protocol.signing import Sealer, SignatureError, load_key, new_key_file
from nemo_dcr.transport.store import LocalDirStore


def test_commit_then_refusal_then_retry_against_the_same_base(tmp_path, key):
    rng = np.random.default_rng(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512)
    r = Rx("r0", store, key, sender.run_id, w, refuse={2}).start(until=3)
    _step(w, rng)
    stats = sender.refit(1)
    assert stats.committed and stats.chunks > 1  # several chunks: streaming flushes
    m1 = Manifest.from_json(store.get(manifest_key(1)), Sealer(load_key(key)))
    infos = [i for c in m1.chunks for i in read_chunk_index(store.get(c.key)).records]
    assert infos and all(i.context for i in infos)  # coded against the committed base
    assert Committed.from_json(store.get(COMMITTED_KEY)).version == 1
    v1 = bits_of(w)
    _step(w, rng)
    stats = sender.refit(2)  # default policy: retry -> training goes on
    assert not stats.committed and "refusing apply call 2" in stats.reason
    assert sender.baseline.version == 1  # not advanced
    assert not Decision.from_json(store.get(decision_key(2))).commit
    _step(w, rng)
    stats = sender.refit(3)  # diffed against version 1, which the receiver still holds
    assert stats.base_version == 1 and stats.committed
    r.join()
    np.testing.assert_array_equal(r.w, bits_of(w))
    np.testing.assert_array_equal(sender.baseline.bits("w"), bits_of(w))
    assert not np.array_equal(v1, bits_of(w))  # control: the versions differ


def test_two_receivers_one_refuses_the_other_rolls_back_then_both_apply_next(tmp_path, key):
    """The livelock of the old protocol: r1 applied v2, r0 refused it.  Now v2 is aborted,
    r1 rolls it back in place (bit-exact at v1), and v3 (base v1) applies on both."""
    rng = np.random.default_rng(1)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"))
    r0 = Rx("r0", store, key, sender.run_id, w, refuse={2}).start(until=3)
    seen_v1 = {}
    r1 = Rx("r1", store, key, sender.run_id, w)
    r1.rx.on_applied = lambda v: seen_v1.setdefault(v, r1.w.copy())
    r1.start(until=3)
    _step(w, rng)
    assert sender.refit(1).committed
    v1 = bits_of(w)
    _step(w, rng)
    v2 = bits_of(w)
    assert not sender.refit(2).committed
    _step(w, rng)
    assert sender.refit(3).committed
    r0.join()
    r1.join()
    np.testing.assert_array_equal(seen_v1[2], v2)  # r1 did apply v2 tentatively ...
    rolled = [e for e in r1.events if e.get("version") == 2 and "rolled back" in e.get("event", "")]
    assert rolled, r1.events  # ... and rolled it back when v2 was aborted
    for r in (r0, r1):
        np.testing.assert_array_equal(r.w, bits_of(w))
    assert not np.array_equal(v1, v2)


def test_failure_mid_apply_is_repaired_from_the_journal(tmp_path, key):
    rng = np.random.default_rng(2)
    w = torch.randn(128, 64).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=256)
    r = Rx("r0", store, key, sender.run_id, w, fail_after={2: 3}).start(until=3)
    _step(w, rng)
    assert sender.refit(1).committed
    v1 = bits_of(w)
    _step(w, rng)
    stats = sender.refit(2)
    assert not stats.committed and "injected failure at record 3" in stats.reason
    _step(w, rng)
    assert sender.refit(3).committed
    r.join()
    event = next(e for e in r.events if e.get("version") == 2 and "ok" in e)
    assert "repaired from the journal" in event["error"]
    np.testing.assert_array_equal(r.w, bits_of(w))
    assert not np.array_equal(v1, bits_of(w))


def test_late_receiver_catches_up_through_committed_versions_only(tmp_path, key):
    rng = np.random.default_rng(3)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=5)
    early = Rx("r0", store, key, sender.run_id, w0, refuse={2}).start(until=3)
    for v in (1, 2, 3):
        _step(w, rng)
        sender.refit(v)
    assert [Decision.from_json(store.get(decision_key(v))).commit for v in (1, 2, 3)] == [True, False, True]
    early.join()
    # r0 restarts from scratch (version 0) while v4 is being published
    late = Rx("r0", store, key, sender.run_id, w0)
    applied = []
    late.rx.on_applied = applied.append
    _step(w, rng)
    late.start(until=4)
    assert sender.refit(4).committed
    late.join()
    assert applied == [1, 3, 4], late.events  # v2 was aborted: never replayed
    assert [e["versions"] for e in late.events if e.get("event") == "caught up"][0][0] == 1
    np.testing.assert_array_equal(late.w, bits_of(w))


@pytest.mark.parametrize("compose_after", [0, 100])
def test_catch_up_composed_equals_replayed(tmp_path, key, compose_after):
    """Five committed versions and an aborted one, then a receiver from version 0: with
    ``compose_after=0`` it writes the runtime once for all five (one composed delta), with
    100 it replays them one by one; both end bit-exact with the trainer."""
    rng = np.random.default_rng(7)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=5)
    early = Rx("r0", store, key, sender.run_id, w0, refuse={3}).start(until=6)
    for v in range(1, 7):
        _step(w, rng)
        sender.refit(v)
    early.join()
    assert [Decision.from_json(store.get(decision_key(v))).commit for v in range(1, 7)] == [True] * 2 + [False] + [True] * 3
    _step(w, rng)
    t = threading.Thread(target=lambda: sender.refit(7))
    t.start()
    while Head.from_json(store.get(HEAD_KEY)).version != 7:
        pass
    late = Rx("r0", store, key, sender.run_id, w0, compose_after=compose_after)
    applied = []
    late.rx.on_applied = applied.append
    late.start(until=7)
    t.join()
    late.join()
    caught = next(e for e in late.events if e.get("event") == "caught up")
    assert caught["versions"] == [1, 2, 4, 5, 6]  # v3 was aborted
    if compose_after == 0:
        assert caught["mode"] == "composed" and applied == [6, 7]  # one write for five versions
    else:
        assert caught["mode"] == "replayed" and applied == [1, 2, 4, 5, 6, 7]
    assert Decision.from_json(store.get(decision_key(7))).commit
    np.testing.assert_array_equal(late.w, bits_of(w))


def test_policy_fail_and_consecutive_failures(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    rng = np.random.default_rng(4)
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=0.2, max_consecutive_failures=2)
    _step(w, rng)
    s1 = sender.refit(1)  # nobody acknowledges
    assert not s1.committed and "r0: no acknowledgement" in s1.reason
    _step(w, rng)
    with pytest.raises(ReceiverRefused, match="2 in a row"):
        sender.refit(2)
    assert sender.baseline.version == 0 and not store.exists(COMMITTED_KEY)
    sender2, _ = _sender(tmp_path / "b", {"w": w}, key, ack_timeout_s=0.2, on_refusal="fail")
    _step(w, rng)
    with pytest.raises(ReceiverRefused, match="on_refusal=fail"):
        sender2.refit(1)


def test_forged_acks_are_ignored_and_reported_never_a_crash(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    rng = np.random.default_rng(5)
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=0.5, max_consecutive_failures=10)
    run_id = sender.run_id
    other = Sealer(bytes(32))  # someone with store access but another key
    ok = dict(receiver="r0", ok=True, held_version=1)
    forged = {
        1: (b"{not json", "not valid JSON"),
        2: (Ack(run_id=run_id, version=2, **ok).to_json(), "unsigned"),
        3: (Ack(run_id=run_id, version=3, **ok).to_json(other), "bad signature"),
        4: (Ack(run_id="f" * 32, version=4, **ok).to_json(Sealer(load_key(key))), "of run fff"),
        5: (Ack(run_id=run_id, version=4, **ok).to_json(Sealer(load_key(key))), "version 4"),  # replayed
    }
    for v, (data, why) in forged.items():
        store.put(ack_key("r0", v), data)
        _step(w, rng)
        stats = sender.refit(v)
        assert not stats.committed and "ack rejected" in stats.reason and why in stats.reason, stats.reason
    assert sender.baseline.version == 0
    # control: a genuine ack (right key, run, receiver, version and manifest) commits
    good = Rx("r0", store, key, run_id, torch.zeros_like(w))
    good.runtime.bits["canon.w"] = sender.baseline.bits("w").copy()
    good.follower.state.handled = good.follower.state.decided = 5
    good.start(until=6)
    _step(w, rng)
    assert sender.refit(6).committed
    good.join()
    np.testing.assert_array_equal(good.w, bits_of(w))


def test_receiver_ignores_forged_head_manifest_and_decision(tmp_path, key):
    """A store writer without the key plants a HEAD, a manifest and an abort decision:
    the receiver applies none of it, writes nothing, and then follows the real run."""
    w = torch.randn(32, 32).to(torch.bfloat16)
    rng = np.random.default_rng(6)
    sender, store = _sender(tmp_path, {"w": w}, key)
    run_id = sender.run_id
    other = Sealer(bytes(32))
    r = Rx("r0", store, key, run_id, w)
    before = r.w.copy()
    real = Manifest(run_id=run_id, model_id="m", version=5, base_version=0, base_digest=sender.committed_digest,
                    chunks=())
    store.put(manifest_key(5), real.to_json(other))
    store.put(HEAD_KEY, Head(run_id, 5, 0).to_json(other))
    for _ in range(5):
        assert not r.follower.step()
    assert not store.exists(ack_key("r0", 5))
    np.testing.assert_array_equal(r.w, before)
    assert any(e.get("ignored") == HEAD_KEY and "bad signature" in e["error"] for e in r.events)
    # control: the real run goes through, and a forged abort of a committed version is ignored
    r.start(until=1)
    _step(w, rng)
    assert sender.refit(1).committed
    r.join()
    np.testing.assert_array_equal(r.w, bits_of(w))


def test_a_second_run_on_the_same_prefix_is_refused(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    with pytest.raises(ProtocolError, match=f"belongs to run {sender.run_id}"):
        _sender(tmp_path, {"w": w}, key)
    # another key cannot even read the run record: refused, not adopted
    other = tmp_path / "other.key"
    new_key_file(str(other))
    with pytest.raises(ProtocolError, match="bad signature"):
        _sender(tmp_path, {"w": w}, str(other))
    # resuming the same run is allowed explicitly
    again = RefitSender({"w": w}, sender.views, sender.projector, store, sender.cfg)
    assert again.claim(resume=sender.run_state()) == sender.run_id
    # control: a fresh prefix starts a new run
    fresh, _ = _sender(tmp_path / "fresh", {"w": w}, key)
    assert fresh.run_id != sender.run_id


@pytest.mark.parametrize("left", ["v/00000001/MANIFEST.json", "acks/r0/00000001.json",
                                  "snapshots/v00000020/SNAPSHOT.json"])
def test_objects_without_a_run_record_are_refused(tmp_path, key, left):
    """What another run left (a version, an ack, a snapshot, which a new run's pruning would
    otherwise weigh against its own) makes a prefix without a run record unclaimable;
    control: the same prefix empty is claimed."""
    from nemo_dcr.protocol.run import claim_store

    store = LocalDirStore(str(tmp_path / "store"))
    store.put(left, b"{}")
    with pytest.raises(ForeignRunError, match="no run record"):
        claim_store(store, Sealer(None), "m")
    store.delete(left)
    assert claim_store(store, Sealer(None), "m").run_id


def test_receiver_refuses_a_manifest_of_another_run_before_downloading(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    sealer = Sealer(load_key(key))
    r = Rx("r0", store, key, sender.run_id, w)
    foreign = Manifest(run_id="0" * 32, model_id="m", version=1, base_version=0,
                       base_digest=sender.committed_digest, chunks=())
    store.put(manifest_key(1), foreign.to_json(sealer))
    store.put(HEAD_KEY, Head(sender.run_id, 1, 0).to_json(sealer))
    assert not r.follower.step()
    assert any("of run 000" in e.get("error", "") for e in r.events)
    assert not store.exists(ack_key("r0", 1))


def test_signature_covers_every_field(key):
    sealer = Sealer(load_key(key))
    a = Ack(run_id="a" * 32, receiver="r0", version=3, ok=False, held_version=2, error="x")
    data = a.to_json(sealer)
    assert Ack.from_json(data, sealer) == a
    doc = json.loads(data)
    doc["ok"] = True
    with pytest.raises(SignatureError, match="bad signature"):
        Ack.from_json(json.dumps(doc).encode(), sealer)
    # domain separation: a signed ack never opens as another kind of document
    with pytest.raises(SignatureError):
        sealer.open("manifest", data, "x")


def test_resumed_trainer_continues_from_the_committed_version_and_never_reuses_a_number(tmp_path, key):
    rng = np.random.default_rng(8)
    w = torch.randn(32, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=5)
    r = Rx("r0", store, key, sender.run_id, w0, refuse={2}).start(until=2)
    _step(w, rng)
    assert sender.refit(1).committed
    committed_bits = bits_of(w)
    _step(w, rng)
    assert not sender.refit(2).committed  # published, aborted
    r.join()
    # the trainer restarts from the checkpoint of the committed step (v1) and resumes the run
    w_resumed = torch.from_numpy(committed_bits.view(np.int16).copy()).view(torch.bfloat16).reshape(w.shape)
    checkpoint = sender.run_state()  # what the trainer's checkpoint carries
    assert (checkpoint.committed_version, checkpoint.published_version) == (1, 2)
    again = RefitSender({"w": w_resumed}, sender.views, sender.projector, store, sender.cfg)
    assert again.claim(resume=checkpoint) == sender.run_id
    assert again.baseline.version == 1 and again.committed_digest == checkpoint.committed_digest
    with pytest.raises(ProtocolError, match="never reused"):
        again.publish(2)  # v2 was published (and aborted) by the previous incarnation
    r2 = Rx("r0", store, key, sender.run_id, w0).start(until=3)
    _step(w_resumed, rng)
    assert again.refit(3).committed  # base v1; the restarted receiver catches up to v1 first
    r2.join()
    np.testing.assert_array_equal(r2.w, bits_of(w_resumed))
