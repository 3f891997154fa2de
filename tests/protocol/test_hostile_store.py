"""What a store writer without the key can plant, read by the real trainer and receiver code:
malformed or oversized documents, traversal keys, replays -- never a crash, never a read
beyond the cap, one log line per object, and the run goes on once the real object is back."""
import json
import os
import resource
import threading

import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.errors import FormatError, ProtocolError
from nemo_dcr.protocol.run import wait_for_run
from nemo_dcr.protocol.manifest import (
    HEAD_KEY,
    RUN_KEY,
    Head,
    Manifest,
    ManifestError,
    ack_key,
    chunk_key,
    manifest_key,
)
from nemo_dcr.protocol.run import ForeignRunError
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file

HOSTILE = {  # each under HEAD.json's 64 KiB cap, so that the parser, not the size check, meets it
    "deep_nesting": b"[" * 60_000,
    "deep_object": b'{"a":' * 6_000 + b"1" + b"}" * 6_000,
    "huge_int": b'{"run_id": "x", "version": ' + b"9" * 5000 + b', "base_version": 0, "signature": "none"}',
    "nan": b'{"version": NaN, "signature": "none"}',
    "duplicate_keys": b'{"version": 1, "version": 2, "signature": "none"}',
    "not_utf8": b'{"version": "\xff\xfe"}',
    "not_object": b"[1, 2, 3]",
}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sparse(store, key: str, size: int = 2 << 30) -> None:
    """A 2 GiB object at ``key`` of a directory store, without writing 2 GiB."""
    path = os.path.join(store.root, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_malformed_head_never_crashes_a_receiver_and_is_logged_once(tmp_path, key, what):
    rng = np.random.default_rng(0)
    w = torch.randn(32, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    r = Rx("r0", store, key, sender.run_id, w.clone())
    store.put(HEAD_KEY, HOSTILE[what])
    for _ in range(20):
        assert not r.follower.step()
    ignored = [e for e in r.events if e.get("ignored") == HEAD_KEY]
    assert len(ignored) == 1 and ignored[0]["error"].startswith("head:"), r.events
    # control: the real run goes through once the trainer rewrites HEAD.json
    r.start(until=1)
    _step(w, rng)
    assert sender.refit(1).committed
    r.join()
    np.testing.assert_array_equal(r.w, bits_of(w))


@pytest.mark.parametrize("what", ["deep_nesting", "huge_int"])
def test_a_malformed_run_record_is_one_error_not_a_traceback(tmp_path, key, what):
    from nemo_dcr.transport.store import LocalDirStore

    store = LocalDirStore(str(tmp_path / "s"))
    store.put(RUN_KEY, HOSTILE[what])
    with pytest.raises(FormatError, match="^run record: "):
        wait_for_run(store, Sealer(load_key(key)), run_id=None, timeout_s=1)


def test_a_traversal_chunk_key_is_refused_when_the_manifest_is_parsed(tmp_path):
    sealer = Sealer(None)  # no key: the chunk key is all a writer needs to forge
    good = Manifest(run_id="a" * 32, model_id="m", version=1, base_version=0, base_digest="sha256:" + "0" * 64,
                    chunks=())
    doc = json.loads(good.to_json(sealer))
    for bad in ("v/00000001/chunks/../../../RUN.json", "/etc/passwd", "v/00000001/chunks/r000-00000.dcr/.."):
        doc["chunks"] = [{"key": bad, "nbytes": 1, "digest": "sha256:" + "0" * 64, "rank": 0, "tensors": 1,
                          "changed": 1}]
        data = json.dumps(doc).encode()
        with pytest.raises(ManifestError, match="chunk key"):
            Manifest.from_json(data, sealer)
    doc["chunks"][0]["key"] = chunk_key(1, 0, 0)  # control
    assert Manifest.from_json(json.dumps(doc).encode(), sealer).chunks[0].key == chunk_key(1, 0, 0)


def test_oversized_objects_are_refused_by_their_size_never_read(tmp_path, key):
    """2 GiB at an ack key (the trainer), at HEAD.json (a receiver) and at a chunk key (a
    receiver applying a version): each refused before its body is read; peak RSS grows by
    well under the 300 MB the issue allows (it would grow by >= 2 GiB if read)."""
    rng = np.random.default_rng(1)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, ack_timeout_s=1, max_consecutive_failures=10)
    before = _peak_rss_mb()
    _sparse(store, ack_key("r0", 1))
    _step(w, rng)
    stats = sender.refit(1)
    assert not stats.committed and "ack rejected" in stats.reason and str(2 << 30) in stats.reason, stats.reason
    r = Rx("r0", store, key, sender.run_id, torch.zeros_like(w))
    r.runtime.bits["canon.w"] = sender.baseline.bits("w").copy()  # v1 was aborted: the receiver holds v0
    r.follower.state.handled = r.follower.state.decided = 1
    real_head = store.get(HEAD_KEY)
    _sparse(store, HEAD_KEY)
    for _ in range(5):
        assert not r.follower.step()
    assert sum(1 for e in r.events if e.get("ignored") == HEAD_KEY) == 1
    # a chunk replaced by 2 GiB after the manifest was signed: the version is refused
    store.put(HEAD_KEY, real_head)
    _step(w, rng)
    t = threading.Thread(target=lambda: sender.refit(2))
    t.start()
    while not store.exists(manifest_key(2)):
        pass
    m = Manifest.from_json(store.get(manifest_key(2)), Sealer(load_key(key)))
    _sparse(store, m.chunks[0].key)
    r.start(until=2)
    t.join()
    r.join()
    event = next(e for e in r.events if e.get("version") == 2 and "ok" in e)
    assert not event["ok"] and m.chunks[0].key in event["error"], event
    grown = _peak_rss_mb() - before
    print(f"\npeak RSS growth over three 2 GiB objects: {grown:.1f} MB")
    assert grown < 300


def test_a_replayed_manifest_is_logged_once_not_per_poll(tmp_path, key):
    rng = np.random.default_rng(2)
    w = torch.randn(32, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    r = Rx("r0", store, key, sender.run_id, w.clone()).start(until=1)
    _step(w, rng)
    assert sender.refit(1).committed
    r.join()
    sealer = Sealer(load_key(key))
    store.put(manifest_key(2), store.get(manifest_key(1)))  # v1's genuine manifest, replayed as v2
    store.put(HEAD_KEY, Head(sender.run_id, 2, 1).to_json(sealer))
    for _ in range(100):
        assert not r.follower.step()
    lines = [e for e in r.events if e.get("ignored") == manifest_key(2)]
    assert len(lines) == 1 and "names version 1" in lines[0]["error"], lines


def test_a_receiver_without_the_key_refuses_a_signed_run_unless_told(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    with pytest.raises(ProtocolError, match="is signed, and no key was given.*--insecure-no-key"):
        wait_for_run(store, Sealer(None), run_id=None, timeout_s=1)
    assert wait_for_run(store, Sealer(None), run_id=None, timeout_s=1, allow_unverified=True) == sender.run_id


def test_another_key_names_the_run_the_record_claims(tmp_path, key):
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    other = new_key_file(str(tmp_path / "other.key"))
    with pytest.raises(ForeignRunError, match=f"not signed with this key \\(run {sender.run_id}, model 'm', "
                                              "created .* UTC\\): another run holds this prefix"):
        wait_for_run(store, Sealer(load_key(other)), run_id=None, timeout_s=1)


def test_receive_cli_refuses_a_signed_run_without_a_key_in_one_line(tmp_path, key, capsys, monkeypatch):
    from nemo_dcr.receiver.cli import main

    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    args = ["--store", store.root, "--receiver-id", "r0", "--model-id", "m", "--timeout-s", "1"]
    assert main(args) == 2  # bad input, found at start (receiver/bootstrap.RunMismatch), nothing written
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nemo-dcr receive: store ") and "--insecure-no-key" in err[-1], err
    assert not store.exists("acks/r0/00000001.json") and store.list("acks/") == []
    assert main(args + ["--insecure-no-key", "--key-file", key]) == 2  # both: contradictory input
    assert "--insecure-no-key with a key" in capsys.readouterr().err
