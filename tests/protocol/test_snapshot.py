"""Committed-version snapshots (``refit.snapshot_every``, ``protocol/snapshot.py``): the
trainer writes one every K committed versions from the committed bits (never the live
parameters, never an aborted version) and keeps the newest two; a fresh receiver
(``build_receiver``) starts from the newest one that checks out and ends bit-exact with the
trainer, and every forged, tampered or incomplete snapshot makes it fall back (to an older
snapshot, then version 0), never use unverified bits.

Real directory stores signed with a key, the real sender (``protocol_helpers``) and the
real bootstrap; only the serving runtime is the numpy stand-in (``ArrayRuntime``), built by
a patched ``start_runtime`` from the checkpoint directory the bootstrap chose.  End states
are compared through integer views, each with a one-bit negative control.
"""
import json
import os

import numpy as np
import pytest
import torch
from protocol_helpers import ArrayRuntime, Rx, _sender, _step, bits_of, key, root_of  # noqa: F401 - key: fixture
from safetensors.torch import load_file

from nemo_dcr.integrations.dense import gather_canonical_state
from nemo_dcr.integrations.hf_export import write_checkpoint
from nemo_dcr.integrations.settings import RefitSetupError
from nemo_dcr.protocol.manifest import DOC_LIMITS, ManifestError, SNAPSHOT_RECORD, decision_key, doc_digest, \
    snapshot_key
from nemo_dcr.protocol.signing import Sealer, SignatureError, load_key, new_key_file
from nemo_dcr.protocol.snapshot import MAX_CANDIDATES, SnapshotRecord, listed_versions
from nemo_dcr.receiver import bootstrap
from nemo_dcr.receiver.engine import ReceiverConfig
from nemo_dcr.receiver.registry import ServedRuntime
from nemo_dcr.transport.store import LocalDirStore

MODEL = "model.safetensors"


def _trainer(tmp_path, key, every, store=None, **kw):
    """The protocol tests' sender over one tensor, with a real version 0 (``init/``) and the
    hook's snapshot source: the canonical gather over the committed baseline."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, store=store, snapshot_every=every, **kw)
    sender.snapshot_state = lambda: gather_canonical_state(sender.committed_bits(), sender.views, sender.projector)
    sender.set_root(write_checkpoint(store, {"model_type": "test"}, {"canon.w": w.clone()}, sealer=sender.sealer,
                                     run_id=sender.run_id))
    return sender, store, w


def _commit(sender, w, rng, versions, states, r0=None):
    for v in versions:
        _step(w, rng)
        states[v] = bits_of(w)
        stats = sender.refit(v)
        assert stats.committed, stats.reason
    return states


def _snap_bits(store, v) -> np.ndarray:
    from safetensors.torch import load

    return bits_of(load(store.get(snapshot_key(v, MODEL)))["canon.w"])


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.int16), want.view(np.int16))
    bad = got.copy()
    bad[len(bad) // 3] ^= 1  # negative control: one flipped bit is seen
    assert not np.array_equal(bad.view(np.int16), want.view(np.int16))


@pytest.fixture
def fake_runtime(monkeypatch):
    """``start_runtime`` builds an ArrayRuntime from the checkpoint directory it is given;
    records (directory, loaded bits)."""
    loaded = []

    def start(name, request):
        tensors = load_file(os.path.join(request.init_dir, MODEL))
        assert os.path.isfile(os.path.join(request.init_dir, "config.json"))
        loaded.append((request.init_dir, {k: bits_of(v) for k, v in tensors.items()}))
        return ServedRuntime(served=ArrayRuntime(tensors))

    monkeypatch.setattr(bootstrap, "start_runtime", start)
    return loaded


def _join(tmp_path, store, key, rid, until, logs=None, **kw):
    """A fresh receiver through the real bootstrap, followed to ``until``."""
    lines = [] if logs is None else logs
    session = bootstrap.build_receiver(store, Sealer(load_key(key)),
                                       ReceiverConfig(receiver_id=rid, model_id="m", poll_s=0.01),
                                       state_dir=str(tmp_path / rid), timeout_s=20, log=lines.append, **kw)
    start = session.committed
    session.run(until_version=until, timeout_s=20)
    return session, start, session.receiver.served.bits["canon.w"]


# ---------------------------------------------------------------- trainer side
@pytest.mark.parametrize("planted", [0, 3])
def test_planted_records_do_not_make_the_trainer_prune_genuine_snapshots(tmp_path, key, planted):
    """A store writer without the key plants ``planted`` records at versions above the run's
    (wrong key, unsigned, another run's); pruning counts only records that open with the key
    and name this run's commit, so the genuine v4 and v6 stay while v2 goes.  Control
    (planted=0): the same pruning."""
    from nemo_dcr.protocol.snapshot import prune_snapshots

    rng = np.random.default_rng(3)
    sender, store, w = _trainer(tmp_path, key, 2)
    r0 = Rx("r0", store, key, sender.run_id, w).start(until=6)
    for v in range(1, 7):
        _step(w, rng)
        assert sender.refit(v).committed
        sender.wait_snapshot()
    r0.join()
    forged = SnapshotRecord(run_id=sender.run_id, version=1, decision_digest="sha256:" + "0" * 64,
                            files={"model.safetensors": "sha256:" + "0" * 64}, sizes={"model.safetensors": 1})
    other_key = tmp_path / "other.key"
    new_key_file(str(other_key))
    docs = [lambda r: r.to_json(Sealer(load_key(str(other_key)))), lambda r: r.to_json(None),
            lambda r: SnapshotRecord(**{**r.__dict__, "run_id": "f" * 32}).to_json(sender.sealer)]
    for i in range(planted):
        v = 100 + i
        rec = SnapshotRecord(**{**forged.__dict__, "version": v})
        store.put(snapshot_key(v, SNAPSHOT_RECORD), docs[i % len(docs)](rec))
    assert listed_versions(store)[planted:] == [6, 4]  # after the trainer's own pruning at v6
    assert prune_snapshots(store, sender.sealer, sender.run_id) == []
    for v in (4, 6):
        assert store.exists(snapshot_key(v, SNAPSHOT_RECORD)) and store.exists(snapshot_key(v, "model.safetensors"))


def test_snapshots_come_from_committed_bits_every_k_skip_aborted_versions_and_are_pruned(tmp_path, key, capsys):
    """K=2, pipelined (each decision is settled after the next step already changed the live
    parameters), v4 refused and aborted: snapshots are taken at v2, v6, v8 (not v4), each
    holding its committed bits, not the live ones; only v6 and v8 remain."""
    rng = np.random.default_rng(0)
    sender, store, w = _trainer(tmp_path, key, 2, pipeline=True)
    r0 = Rx("r0", store, key, sender.run_id, w, refuse={4}).start(until=8)
    states = {}
    for v in range(1, 9):
        _step(w, rng)
        states[v] = bits_of(w)
        sender.submit(v)
    sender.finish()
    r0.join()
    err = capsys.readouterr().err
    assert [v for v in (2, 4, 6, 8) if f"snapshot of v{v} written" in err] == [2, 6, 8]
    assert "version 4 aborted" in err
    assert listed_versions(store) == [8, 6]  # v2 pruned, v4 never written
    assert not store.list("snapshots/v00000004/") and not store.list("snapshots/v00000002/")
    for v in (6, 8):
        _assert_same(_snap_bits(store, v), states[v])
        rec = SnapshotRecord.from_json(store.get(snapshot_key(v, SNAPSHOT_RECORD)), sender.sealer)
        assert rec.version == v and rec.run_id == sender.run_id
        assert rec.decision_digest == doc_digest(store.get(decision_key(v)))
    # v6 was gathered while the live parameters already held step 7: not those bits
    assert not np.array_equal(_snap_bits(store, 6), states[7])
    _assert_same(r0.w, bits_of(w))


@pytest.mark.parametrize("membership,every,interval", [("static", None, 0), ("elastic", 0, 0), ("static", 0, 0),
                                                      ("elastic", None, 20)])
def test_snapshot_every_zero_writes_nothing_and_the_default_follows_membership(tmp_path, key, membership, every,
                                                                               interval):
    rng = np.random.default_rng(1)
    sender, store, w = _trainer(tmp_path, key, every, membership=membership)
    assert sender.cfg.snapshot_interval == interval
    if interval:
        return  # the elastic default (20) is exercised by the benchmark, not 20 versions here
    r0 = Rx("r0", store, key, sender.run_id, w).start(until=4)
    _commit(sender, w, rng, range(1, 5), {})
    sender.finish()
    r0.join()
    assert store.list("snapshots/") == []


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_a_bad_snapshot_every_is_one_clear_error(tmp_path, key, bad):
    with pytest.raises(RefitSetupError, match=r"refit\.snapshot_every must be an int >= 0"):
        _sender(tmp_path, {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, key, snapshot_every=bad)


def test_a_failed_snapshot_upload_is_logged_and_training_goes_on_without_a_record(tmp_path, key, capsys):
    class Flaky(LocalDirStore):
        def put(self, k, data):
            if k == snapshot_key(2, MODEL):
                raise OSError("disk full (test)")
            super().put(k, data)

    rng = np.random.default_rng(2)
    sender, store, w = _trainer(tmp_path, key, 2, store=Flaky(str(tmp_path / "store")))
    r0 = Rx("r0", store, key, sender.run_id, w).start(until=4)
    _commit(sender, w, rng, range(1, 5), {})
    sender.finish()
    r0.join()
    assert "snapshot of v2 failed, skipped: OSError: disk full (test)" in capsys.readouterr().err
    assert not store.exists(snapshot_key(2, SNAPSHOT_RECORD)) and store.exists(snapshot_key(4, SNAPSHOT_RECORD))


# ---------------------------------------------------------------- receiver side
def _run_to_7(tmp_path, key, every=3):
    """Versions 1..7 committed with r0 acking; snapshots (K=3) at v3 and v6."""
    rng = np.random.default_rng(4)
    sender, store, w = _trainer(tmp_path, key, every)
    r0 = Rx("r0", store, key, sender.run_id, w).start(until=7)
    states = _commit(sender, w, rng, range(1, 8), {0: None})
    sender.finish()
    r0.join()
    assert listed_versions(store) == ([6, 3] if every == 3 else [])
    return sender, store, w, states


def test_a_joiner_boots_from_the_newest_snapshot_and_ends_bit_exact(tmp_path, key, fake_runtime):
    sender, store, w, states = _run_to_7(tmp_path, key)
    session, start, got = _join(tmp_path, store, key, "j", 7)
    assert session.bootstrap == {"from": "snapshot", "version": 6} and start == 6
    assert fake_runtime[0][0] == session.init_dir == str(tmp_path / "j" / "snapshots" / "v00000006")
    _assert_same(fake_runtime[0][1]["canon.w"], states[6])  # loaded v6's bits ...
    _assert_same(got, bits_of(w))  # ... and applied v7 on them
    assert session.follower.state.committed == 7


def test_without_snapshots_or_with_the_flag_off_the_joiner_starts_from_version_0(tmp_path, key, fake_runtime):
    sender, store, w, _ = _run_to_7(tmp_path, key)
    session, start, got = _join(tmp_path, store, key, "j0", 7, snapshot=False)
    assert session.bootstrap == {"from": "init"} and start == 0
    _assert_same(got, bits_of(w))
    from nemo_dcr.receiver.cli import parser

    base = ["--store", "s", "--receiver-id", "r", "--model-id", "m"]
    assert parser().parse_args(base).snapshot is True
    assert parser().parse_args([*base, "--no-snapshot"]).snapshot is False


def test_the_checkpoint_command_writes_the_newest_snapshot_and_the_start_check_holds_it_to_its_version(
        tmp_path, key, capsys):
    """``nemo-dcr checkpoint`` (an engine's start directory mid-run) and
    ``bootstrap.verify_start_dir`` (the weight-transfer backend's check of ``start_version``):
    the newest snapshot (v6) with version 0's ``config.json``; it checks out as v6 only, and
    not once a byte of it changes; ``--version-0`` and a bad store."""
    from nemo_dcr.cli import main as cli
    from nemo_dcr.errors import ProtocolError

    sender, store, w, states = _run_to_7(tmp_path, key)
    sealer = Sealer(load_key(key))

    def checkpoint(*extra):
        capsys.readouterr()
        assert cli(["checkpoint", "--store", store.root, "--out", str(tmp_path / "ckpt"), "--key-file", key,
                    *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    out = checkpoint()
    assert (out["version"], out["run_id"]) == (6, sender.run_id)
    d = out["directory"]
    _assert_same(bits_of(load_file(os.path.join(d, MODEL))["canon.w"]), states[6])
    assert bootstrap.verify_start_dir(store, sealer, sender.run_id, d, 6) == doc_digest(store.get(decision_key(6)))
    for wrong, needle in ((3, "is not this run's snapshot of v3"), (0, "is not this run's version 0"),
                          (5, "no usable snapshot of v5")):
        with pytest.raises(ProtocolError, match=needle):
            bootstrap.verify_start_dir(store, sealer, sender.run_id, d, wrong)
    with open(os.path.join(d, MODEL), "r+b") as f:  # one byte of the weights
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ProtocolError, match="is not this run's snapshot of v6"):
        bootstrap.verify_start_dir(store, sealer, sender.run_id, d, 6)
    zero = checkpoint("--version-0")
    assert zero["version"] == 0
    assert bootstrap.verify_start_dir(store, sealer, sender.run_id, zero["directory"], 0) == root_of(
        store, key, sender.run_id)
    assert cli(["checkpoint", "--store", "ftp://nowhere", "--out", str(tmp_path / "x")]) == 2
    assert "nemo-dcr checkpoint:" in capsys.readouterr().err
    # a store that holds no run: one line at once (no wait by default)
    assert cli(["checkpoint", "--store", str(tmp_path / "empty"), "--out", str(tmp_path / "x"), "--key-file", key]) == 1
    assert "no run record (RUN.json)" in capsys.readouterr().err


def _resealed(store, key_path, v, **change) -> bytes:
    rec = SnapshotRecord.from_json(store.get(snapshot_key(v, SNAPSHOT_RECORD)))
    fields = {**rec.__dict__, **change}
    return SnapshotRecord(**fields).to_json(Sealer(load_key(key_path)))


def _forge(kind, store, key, tmp_path, sender):
    """Damage the v6 snapshot the way ``kind`` says."""
    rec_key, model_key = snapshot_key(6, SNAPSHOT_RECORD), snapshot_key(6, MODEL)
    if kind == "wrong_key":
        store.put(rec_key, _resealed(store, new_key_file(str(tmp_path / "other.key")), 6))
    elif kind == "unsigned":
        rec = SnapshotRecord.from_json(store.get(rec_key))
        store.put(rec_key, rec.to_json(None))
    elif kind == "other_run":
        store.put(rec_key, _resealed(store, key, 6, run_id="f" * 32))
    elif kind == "decision_of_another_version":
        store.put(rec_key, _resealed(store, key, 6, decision_digest=doc_digest(store.get(decision_key(5)))))
    elif kind == "replayed_from_v3":
        store.put(rec_key, store.get(snapshot_key(3, SNAPSHOT_RECORD)))
    elif kind == "oversized":
        doc = json.loads(store.get(rec_key))
        doc["pad"] = "x" * DOC_LIMITS["snapshot"]
        store.put(rec_key, json.dumps(doc).encode())
    elif kind == "nested":
        store.put(rec_key, b'{"a":' * 300 + b"1" + b"}" * 300)
    elif kind == "tampered_model":
        blob = bytearray(store.get(model_key))
        blob[-3] ^= 1
        store.put(model_key, bytes(blob))
    elif kind == "deleted_model":
        store.delete(model_key)
    elif kind == "deleted_record":
        store.delete(rec_key)
    elif kind == "model_of_v3":
        store.put(model_key, store.get(snapshot_key(3, MODEL)))
    else:
        raise AssertionError(kind)


KINDS = ["wrong_key", "unsigned", "other_run", "decision_of_another_version", "replayed_from_v3", "oversized",
         "nested", "tampered_model", "deleted_model", "deleted_record", "model_of_v3"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_forged_or_damaged_snapshot_falls_back_to_the_older_one_and_ends_bit_exact(tmp_path, key, fake_runtime,
                                                                                     kind):
    sender, store, w, states = _run_to_7(tmp_path, key)
    _forge(kind, store, key, tmp_path, sender)
    logs = []
    session, start, got = _join(tmp_path, store, key, "j", 7, logs=logs)
    assert session.bootstrap == {"from": "snapshot", "version": 3} and start == 3
    _assert_same(fake_runtime[0][1]["canon.w"], states[3])
    _assert_same(got, bits_of(w))
    if kind != "deleted_record" or store.list("snapshots/v00000006/"):
        assert len(logs) == 1 and logs[0].startswith("nemo_dcr: snapshot v6 not used"), logs
    assert not os.path.exists(tmp_path / "j" / "snapshots" / "v00000006")  # the refused download is gone


@pytest.mark.parametrize("kind", ["wrong_key", "tampered_model", "decision_of_another_version"])
def test_with_every_snapshot_refused_the_joiner_starts_from_version_0_bit_exact(tmp_path, key, fake_runtime, kind):
    sender, store, w, _ = _run_to_7(tmp_path, key)
    _forge(kind, store, key, tmp_path, sender)
    store.put(snapshot_key(3, SNAPSHOT_RECORD), b"{}")  # and the older one unreadable
    logs = []
    session, start, got = _join(tmp_path, store, key, "j", 7, logs=logs)
    assert session.bootstrap == {"from": "init"} and start == 0
    assert [line.split(" not used")[0] for line in logs] == ["nemo_dcr: snapshot v6", "nemo_dcr: snapshot v3"]
    _assert_same(got, bits_of(w))


def test_a_snapshot_record_of_an_aborted_version_is_refused(tmp_path, key, fake_runtime):
    """The record, signed with the key, names the aborted v4's decision: not a commit."""
    rng = np.random.default_rng(5)
    sender, store, w = _trainer(tmp_path, key, 0)
    r0 = Rx("r0", store, key, sender.run_id, w, refuse={4}).start(until=5)
    for v in range(1, 6):
        _step(w, rng)
        sender.refit(v)
    r0.join()
    from nemo_dcr.protocol.snapshot import write_snapshot

    from safetensors.torch import save
    write_snapshot(store, sender.sealer, sender.run_id, 4, doc_digest(store.get(decision_key(4))),
                   {MODEL: save({"canon.w": w.clone()})})
    logs = []
    session, start, got = _join(tmp_path, store, key, "j", 5, logs=logs)
    assert session.bootstrap == {"from": "init"} and "not a commit" in logs[0]
    _assert_same(got, bits_of(w))


def test_junk_directories_are_bounded_and_cannot_hide_version_0(tmp_path, key, fake_runtime):
    """A key-less writer adds newer snapshot directories: at most MAX_CANDIDATES are tried
    (one line each), then version 0; the result is still bit-exact."""
    sender, store, w, _ = _run_to_7(tmp_path, key)
    for v in range(100, 100 + MAX_CANDIDATES + 3):
        store.put(snapshot_key(v, SNAPSHOT_RECORD), b"junk")
    logs = []
    session, start, got = _join(tmp_path, store, key, "j", 7, logs=logs)
    assert session.bootstrap == {"from": "init"} and len(logs) == MAX_CANDIDATES
    _assert_same(got, bits_of(w))


def test_an_elastic_joiner_from_a_snapshot_is_admitted(tmp_path, key, fake_runtime):
    """Its join request names the version it holds and that version's decision digest: the
    trainer admits it and then requires its ack (the chain link is the decision's digest)."""
    import threading

    rng = np.random.default_rng(6)
    sender, store, w = _trainer(tmp_path, key, 2, membership="elastic", ack_timeout_s=20)
    r0 = Rx("r0", store, key, sender.run_id, w).start(until=5)
    _commit(sender, w, rng, range(1, 4), {})
    sender.finish()  # the v2 snapshot is uploaded
    session = bootstrap.build_receiver(store, Sealer(load_key(key)),
                                       ReceiverConfig(receiver_id="j", model_id="m", poll_s=0.01),
                                       state_dir=str(tmp_path / "j"), timeout_s=20, log=print)
    assert session.bootstrap == {"from": "snapshot", "version": 2}
    session.follower.join = True
    t = threading.Thread(target=session.run, kwargs={"until_version": 5, "timeout_s": 20}, daemon=True)
    t.start()
    deadline = __import__("time").monotonic() + 20
    while not store.exists("acks/join.d/j.json"):
        assert __import__("time").monotonic() < deadline
        __import__("time").sleep(0.01)
    _step(w, rng)
    s4 = sender.refit(4)
    assert s4.committed and s4.joined == ("j",) and s4.members == ("r0", "j")
    _step(w, rng)
    assert sender.refit(5).committed
    t.join(timeout=30)
    r0.join()
    _assert_same(session.receiver.served.bits["canon.w"], bits_of(w))


# ---------------------------------------------------------------- the record
def test_snapshot_record_parsing_is_strict(key):
    sealer = Sealer(load_key(key))
    good = dict(run_id="a" * 32, version=3, decision_digest="sha256:" + "0" * 64, files={MODEL: "sha256:" + "1" * 64},
                sizes={MODEL: 10})
    assert SnapshotRecord.from_json(SnapshotRecord(**good).to_json(sealer), sealer) == SnapshotRecord(**good)
    with pytest.raises(SignatureError):
        SnapshotRecord.from_json(SnapshotRecord(**good).to_json(None), sealer)
    for change in ({"version": 0}, {"files": {"a/b": "sha256:" + "1" * 64}, "sizes": {"a/b": 1}},
                   {"sizes": {MODEL: -1}}, {"sizes": {}}, {"files": {MODEL: "md5:x"}},
                   {"files": {SNAPSHOT_RECORD: "sha256:" + "1" * 64}, "sizes": {SNAPSHOT_RECORD: 1}}):
        with pytest.raises(ManifestError):
            SnapshotRecord(**{**good, **change})
    doc = json.loads(SnapshotRecord(**good).to_json(None))
    doc["extra"] = 1
    with pytest.raises(ManifestError, match="unknown fields"):
        SnapshotRecord.from_json(json.dumps(doc).encode(), None)


# ---------------------------------------------------------------- the megatron hook, two ranks
@pytest.mark.spawns
def test_the_hook_snapshots_the_committed_state_gathered_over_two_tensor_parallel_ranks(tmp_path):
    """A real megatron-core model, TP=2 (gloo), the pipelined hook with snapshot_every=2:
    the snapshots of v2 and v4 are gathered from both ranks' committed baselines while the
    live parameters already hold the next step; each equals the dense state of its version
    (integer views, every tensor), not the next step's, and a flipped bit is seen.  The
    worker is this file run under torchrun (``_hook_worker``)."""
    import subprocess
    import sys

    from safetensors.torch import load

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(tmp_path), str(tmp_path / "store")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-6000:]
    store = LocalDirStore(str(tmp_path / "store"))
    assert listed_versions(store) == [4, 2]
    for v in (2, 4):
        got = load(store.get(snapshot_key(v, MODEL)))
        want, after = load_file(str(tmp_path / f"dense{v}.safetensors")), load_file(str(tmp_path / f"dense{v + 1}"
                                                                                                 ".safetensors"))
        assert sorted(got) == sorted(want) and len(want) > 3
        for name in want:
            assert got[name].dtype == want[name].dtype == torch.bfloat16
            assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name
        assert any(not torch.equal(got[n].view(torch.int16), after[n].view(torch.int16)) for n in want)
        name = max(want, key=lambda n: want[n].numel())
        flipped = got[name].clone()
        flipped.view(torch.int16).reshape(-1)[7] ^= 1
        assert not torch.equal(flipped.view(torch.int16), want[name].view(torch.int16))
        rec = SnapshotRecord.from_json(store.get(snapshot_key(v, SNAPSHOT_RECORD)),
                                       Sealer(load_key(str(tmp_path / "key"))))
        assert rec.decision_digest == doc_digest(store.get(decision_key(v)))


def _hook_worker(out_dir: str, store_dir: str) -> int:
    import sys

    import torch.distributed as dist
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
    # a signed stand-in receiver acking every manifest; the workers' model and key
    from pipeline_worker import stamp_acks, tiny_tp2_trainer

    import threading

    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions

    trainer, key_path = tiny_tp2_trainer(out_dir)
    rank = dist.get_rank()
    store = LocalDirStore(store_dir)
    sender_cfg = RefitOptions(model_id="snap", receivers=("r0",), key_file=key_path, ack_timeout_s=20,
                              ack_poll_s=0.01, pipeline=True, snapshot_every=2)
    hook = MegatronRefitHook.from_model(trainer.model, store=store, sender_cfg=sender_cfg, vocab_size=256)
    run_id = hook.export_initial()
    stop = threading.Event()
    if rank == 0:
        threading.Thread(target=stamp_acks, args=(store, hook.sender.sealer, run_id, stop), daemon=True).start()
    for step in range(1, 6):
        trainer.train_step()
        dense = hook.dense_state()  # the live parameters after this step: version `step`'s content
        if rank == 0:
            save_file(dense, os.path.join(out_dir, f"dense{step}.safetensors"))
        settled = hook(step=step)
        assert settled is None or settled.committed, settled.reason
    assert hook.finish().committed
    stop.set()
    trainer.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_hook_worker(sys.argv[1], sys.argv[2]))
