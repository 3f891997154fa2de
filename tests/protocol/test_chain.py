"""Run state from the signed chain, never from pointer files (issue 15's attacks).

A store writer WITHOUT the key may read, copy, replay and delete any object.  Each test
replays what was found to break the old protocol, with the real sender / follower /
receiver code over a directory store, for a receiver that was kept running and one
started afresh, with context coding on and off.  The oracle is always integer views
against the trainer's committed bits, and every attack has a control.
"""
import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.sender import RefitSender
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    HEAD_KEY,
    Ack,
    Decision,
    Manifest,
    ack_key,
    decision_key,
    manifest_key,
)
from nemo_dcr.protocol.history import RunState
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.errors import ProtocolError


def _trained(tmp_path, key, context, versions=3, seed=0):
    """A run that committed ``versions`` versions with one receiver; returns the sender, the
    store, the weights, version 0's bits and the pointer files' bytes after version 1."""
    rng = np.random.default_rng(seed)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, coding="context" if context else "plain", ack_timeout_s=10)
    r = Rx("r0", store, key, sender.run_id, w0).start(until=versions)
    pointers = None
    for v in range(1, versions + 1):
        _step(w, rng)
        assert sender.refit(v).committed
        if v == 1:
            pointers = {k: store.get(k) for k in (HEAD_KEY, COMMITTED_KEY)}
    r.join()
    np.testing.assert_array_equal(r.w, bits_of(w))
    return sender, store, w, w0, pointers, r


def _restarted(sender, store, w, state):
    """The trainer restarted from its checkpoint: the same weights, a new sender."""
    again = RefitSender({"w": w}, sender.views, sender.projector, store, sender.cfg)
    again.claim(resume=state)
    return again


@pytest.mark.parametrize("context", [True, False], ids=["context", "plain"])
@pytest.mark.parametrize("attack", ["replay_v1_pointers", "delete_pointers"])
def test_resume_takes_its_position_from_the_checkpoint_not_the_pointers(tmp_path, key, context, attack):
    sender, store, w, w0, pointers, kept = _trained(tmp_path, key, context)
    checkpoint = sender.run_state()
    assert (checkpoint.committed_version, checkpoint.published_version) == (3, 3)
    if attack == "replay_v1_pointers":
        for k, data in pointers.items():
            store.put(k, data)
    else:
        store.delete(HEAD_KEY)
        store.delete(COMMITTED_KEY)
    again = _restarted(sender, store, w, checkpoint)
    assert again.baseline.version == 3 and again.committed_digest == checkpoint.committed_digest
    # a receiver kept running across the restart, and one started afresh from version 0
    kept_rx = kept  # the same receiver object, still holding v3, keeps following
    fresh = Rx("r1", store, key, sender.run_id, w0)
    again.cfg = sender.cfg.__class__(**{**sender.cfg.__dict__, "receivers": ("r0", "r1")})
    again.coordinator.receivers = ("r0", "r1")
    kept_rx.start(until=5)
    fresh.start(until=5)
    rng = np.random.default_rng(9)
    for v in (4, 5):
        _step(w, rng)
        stats = again.refit(v)
        assert stats.committed and stats.base_version == v - 1, stats.reason
    kept_rx.join()
    fresh.join()
    for r in (kept_rx, fresh):
        np.testing.assert_array_equal(r.w, bits_of(w))
    assert not np.array_equal(bits_of(w0), bits_of(w))  # control: the run did change the weights


def test_resume_refuses_a_checkpoint_the_signed_history_does_not_confirm(tmp_path, key):
    sender, store, w, w0, pointers, _ = _trained(tmp_path, key, True)
    good = sender.run_state()
    # an older checkpoint (v1) while the store's run committed v3: no silent relabelling
    older = RunState(run_id=good.run_id, committed_version=1, committed_digest="", published_version=1)
    with pytest.raises(ProtocolError, match="committed v3 after it; restart from the checkpoint of v3"):
        _restarted(sender, store, w, older)
    # the checkpoint's committed decision deleted: refused, naming the version
    store.delete(decision_key(3))
    with pytest.raises(ProtocolError, match="checkpoint holds committed v3, and the store has no commit decision"):
        _restarted(sender, store, w, good)
    # weights of a step that was not committed: no receiver holds them; refused, never relabelled
    import dataclasses

    ahead = dataclasses.replace(good, weights_version=4, published_version=4)
    with pytest.raises(ProtocolError, match="checkpoint's weights are step 4, the run's committed version is v3"):
        _restarted(sender, store, w, ahead)
    # a digest from another history (a forged checkpoint state) is refused
    store.put(decision_key(3), b"{}")
    with pytest.raises(ProtocolError, match="no commit decision for v3"):
        _restarted(sender, store, w, good)
    # control: a hand-typed resume (no digest) of the store's committed version goes through
    # once the decision is back; the digest then comes from the signed decision
    sender2, store2, w2, *_ = _trained(tmp_path / "b", key, True, seed=1)
    typed = RunState(run_id=sender2.run_id, committed_version=3, committed_digest="", published_version=3)
    assert _restarted(sender2, store2, w2, typed).committed_digest == sender2.committed_digest


def test_version_numbers_are_never_reused_even_with_pointers_deleted(tmp_path, key):
    sender, store, w, w0, pointers, _ = _trained(tmp_path, key, True, versions=2)
    rng = np.random.default_rng(3)
    _step(w, rng)
    assert not sender.refit(3).committed  # nobody listens: v3 published and aborted
    state = RunState(run_id=sender.run_id, committed_version=2, committed_digest=sender.committed_digest,
                     published_version=2)  # a checkpoint saved before v3
    store.delete(HEAD_KEY)
    store.delete(COMMITTED_KEY)
    store.delete(manifest_key(3))
    store.delete(decision_key(3))
    again = _restarted(sender, store, w, state)  # v3's chunks still name the number
    with pytest.raises(ProtocolError, match="never reused"):
        again.publish(3)
    assert again.run_state().published_version == 3


def test_bare_keys_planted_far_above_do_not_move_the_floor(tmp_path, key, caplog):
    """A writer without the key plants ``v/99999995/x`` .. ``v/99999998/x``: counted as used,
    they would leave the resumed run 1-4 version numbers (the keys have 8 digits).  The
    resumed trainer ignores them (one warning naming them) and publishes v3 as if they were
    not there; control: a bare number close above the history (an upload killed before its
    manifest) still counts as used."""
    from nemo_dcr.protocol.history import FLOOR_SLACK

    sender, store, w, *_ = _trained(tmp_path, key, True, versions=2)
    for n in range(99999995, 99999999):
        store.put(f"v/{n:08d}/x", b"junk")
    state = sender.run_state()
    with caplog.at_level("WARNING", logger="nemo_dcr.protocol.run"):
        again = _restarted(sender, store, w, state)
    planted = [r.message for r in caplog.records if "hold no signed manifest" in r.message]
    assert len(planted) == 1 and "99999995, 99999996, 99999997, 99999998" in planted[0]
    assert again.run_state().published_version == 2
    _step(w, np.random.default_rng(5))
    assert again.publish(3)[1].version == 3
    # control: a bare number within FLOOR_SLACK of the history is kept as used
    store.put(f"v/{2 + FLOOR_SLACK:08d}/x", b"junk")
    assert _restarted(sender, store, w, state).run_state().published_version == 2 + FLOOR_SLACK


def test_planted_numbers_cost_a_bounded_scan(tmp_path, key, caplog, monkeypatch):
    """Many bare numbers just above the history: the scan reads FLOOR_MISSES of them and
    stops, saying so (bounded work per resume, whatever was planted)."""
    from nemo_dcr.protocol import history as run_mod

    monkeypatch.setattr(run_mod, "FLOOR_MISSES", 8)
    reads = []
    sender, store, w, *_ = _trained(tmp_path, key, True, versions=2)
    for n in range(3, 40):
        store.put(f"v/{n:08d}/x", b"junk")
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda k, **kw: (reads.append(k), real_get(k, **kw))[1])
    with caplog.at_level("WARNING", logger="nemo_dcr.protocol.run"):
        again = _restarted(sender, store, w, sender.run_state())
    assert any("stopped at v10 after 8 in a row" in r.message for r in caplog.records)
    assert again.run_state().published_version == 10  # the numbers it read count as used
    assert not [k for k in reads if k.startswith(("v/00000011/", "v/00000039/"))]


def test_oversized_documents_planted_under_version_keys_and_head_are_misses(tmp_path, key, monkeypatch):
    """A writer without the key plants a HEAD.json and a decision of v3 over DOC_LIMITS
    (each refused before its body): the resumed trainer counts v3 as a bare number near
    the history (used: v4 is next) and reads HEAD as absent, instead of failing the resume
    on the first oversized read; the bytes the scan counts are what it read (limit + 1), not
    the size the object claims.  Control: the same oversized decision AT the committed
    version refuses the resume in one line (no commit decision signed with this key)."""
    from nemo_dcr.protocol import history as run_mod
    from nemo_dcr.protocol.manifest import DOC_LIMITS, decision_key

    sender, store, w, *_ = _trained(tmp_path, key, True, versions=2)
    state = sender.run_state()
    big = DOC_LIMITS["decision"] + 1000
    store.put(decision_key(3), b" " * big)
    store.put(HEAD_KEY, b" " * (DOC_LIMITS["head"] + 1))
    spent = []
    real = run_mod._open_signed
    monkeypatch.setattr(run_mod, "_open_signed", lambda *a: (lambda r: (spent.append(r[1]), r)[1])(real(*a)))
    again = _restarted(sender, store, w, state)
    assert again.run_state().published_version == 3
    assert DOC_LIMITS["decision"] + 1 in spent and big not in spent
    _step(w, np.random.default_rng(5))
    assert again.publish(4)[1].version == 4
    store.put(decision_key(2), b" " * big)  # control: the committed version's decision itself
    with pytest.raises(ProtocolError, match="no commit decision for v2 signed with this key"):
        _restarted(sender, store, w, state)


def test_a_version_beyond_the_key_width_is_refused_at_publish(tmp_path, key):
    from nemo_dcr.errors import ValidationError
    from nemo_dcr.protocol.manifest import MAX_VERSION

    sender, store, w, *_ = _trained(tmp_path, key, True, versions=1)
    with pytest.raises(ValidationError, match="does not fit the store's 8-digit version keys"):
        sender.publish(MAX_VERSION + 1)
    assert not [k for k in store.list("v/") if k.startswith(f"v/{MAX_VERSION + 1}")]  # nothing written
    assert sender.publish(MAX_VERSION)[1].version == MAX_VERSION  # control: the last number fits


@pytest.mark.parametrize("context", [True, False], ids=["context", "plain"])
def test_an_aborted_version_replayed_through_head_is_rolled_back_by_the_chain(tmp_path, key, context):
    """v2 aborted, v3 and v4 committed.  The writer restores v2's genuine HEAD and deletes its
    decision; a receiver restarted from version 0 catches up to v1 and applies v2.  When the
    real HEAD returns, v2 is not on its chain: rolled back, then v3 and v4 apply."""
    rng = np.random.default_rng(4)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w0 = w.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, coding="context" if context else "plain", ack_timeout_s=5)
    early = Rx("r0", store, key, sender.run_id, w0, refuse={2}).start(until=4)
    heads = {}
    for v in (1, 2, 3, 4):
        _step(w, rng)
        sender.refit(v)
        heads[v] = store.get(HEAD_KEY)
    early.join()
    assert [Decision.from_json(store.get(decision_key(v))).commit for v in (1, 2, 3, 4)] == [True, False, True, True]
    store.put(HEAD_KEY, heads[2])
    store.delete(decision_key(2))
    late = Rx("r0", store, key, sender.run_id, w0)
    applied = []
    late.rx.on_applied = applied.append
    for _ in range(50):
        late.follower.step()
    assert applied == [1, 2] and late.follower.state.tentative == 2  # served v2 (it cannot know yet)
    store.put(HEAD_KEY, heads[4])
    late.start(until=4)
    late.join()
    assert any(e.get("version") == 2 and "rolled back" in e.get("event", "") for e in late.events), late.events
    assert applied == [1, 2, 3, 4]
    assert late.follower.state.committed == 4
    np.testing.assert_array_equal(late.w, bits_of(w))


def test_a_head_that_does_not_extend_the_receivers_commit_is_refused_and_it_serves_on(tmp_path, key):
    """A key holder's fork (a trainer restarted from an older checkpoint whose later commit
    decision was deleted): receivers that committed the later version refuse it with an ack
    naming both versions and keep serving -- never exit."""
    sender, store, w, w0, pointers, kept = _trained(tmp_path, key, True)
    held = kept.w.copy()
    rx = kept  # the receiver that committed v3
    sealer = Sealer(load_key(key))
    d1 = Decision.from_json(store.get(decision_key(1)), sealer)
    fork_base = store.get(decision_key(1))
    from nemo_dcr.protocol.manifest import Head, doc_digest

    fork = Manifest(run_id=sender.run_id, model_id="m", version=7, base_version=d1.version,
                    base_digest=doc_digest(fork_base), chunks=())
    store.put(manifest_key(7), fork.to_json(sealer))
    store.put(HEAD_KEY, Head(sender.run_id, 7, 1).to_json(sealer))
    assert rx.follower.step()
    ack = Ack.from_json(store.get(ack_key("r0", 7)), sealer)
    assert not ack.ok and "v7 (base v1) does not extend v3" in ack.error and ack.held_version == 3
    for _ in range(5):
        rx.follower.step()  # awaiting v7's decision: no exit, no write
    np.testing.assert_array_equal(rx.w, held)
    # a manifest based on v3 by number but on another v3 (a different decision digest)
    other = Manifest(run_id=sender.run_id, model_id="m", version=8, base_version=3,
                     base_digest=doc_digest(fork_base), chunks=())
    store.put(manifest_key(8), other.to_json(sealer))
    store.put(decision_key(7), Decision(sender.run_id, 7, 1, False, ("r0",), reason="fork").to_json(sealer))
    store.put(HEAD_KEY, Head(sender.run_id, 8, 3).to_json(sealer))
    for _ in range(5):
        rx.follower.step()
    ack = Ack.from_json(store.get(ack_key("r0", 8)), sealer)
    assert not ack.ok and "is another v3" in ack.error
    np.testing.assert_array_equal(rx.w, held)


@pytest.mark.parametrize("context", [False, True])
def test_a_resume_takes_the_baseline_from_the_weights_restored_after_construction(tmp_path, key, context):
    """A framework may build the refit before it restores the checkpoint's weights: the
    resumed run must diff against the restored (committed) bits, not the initial ones.
    (Found by the fault campaign: context-free records then committed wrong bits silently.)"""
    rng = np.random.default_rng(0)
    w0 = torch.randn(64, 32).to(torch.bfloat16)
    w = w0.clone()
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512, coding="context" if context else "plain")
    rx = Rx("r0", store, key, sender.run_id, w0).start(until=2)
    _step(w, rng)
    assert sender.refit(1).committed
    state, ckpt = sender.run_state(), w.clone()
    w2 = w0.clone()  # a restarted job: fresh-init weights, the refit built on them...
    again = RefitSender({"w": w2}, sender.views, sender.projector, store, sender.cfg)
    w2.copy_(ckpt)  # ...then the checkpoint restored into them
    again.claim(resume=state)
    _step(w2, rng)
    stats = again.refit(2)
    rx.join()
    assert stats.committed and np.array_equal(rx.runtime.bits["canon.w"], bits_of(w2))
    flipped = rx.runtime.bits["canon.w"].copy()
    flipped[0] ^= 1  # control
    assert not np.array_equal(flipped, bits_of(w2))
