"""``nemo-dcr status`` (``nemo_dcr/status_cli.py``): where a run stands, from its signed
documents only.

* one process, the real sender and follower (``protocol_helpers``): committed, aborted and
  in-flight versions, each receiver's last ack and what it holds, a snapshot, a relay's
  stats; documents forged (another key, tampered bytes, unsigned), of another manifest, or
  read without the key are shown and never counted;
* the one-line refusals (exit 2): a store that does not exist or holds no run, a key file
  that does not load or does not open the run, a relay URL that is not one; a relay that
  cannot be reached is exit 1;
* a live demo (slow): the committed version is the demo's last, every receiver acked it,
  a forged ack is shown as forged and not counted, and the trainer logged one line per
  decided version.
"""
import json
import os
import re
import socket
from dataclasses import replace

import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, key  # noqa: F401 - key is a fixture

from nemo_dcr import status_cli
from nemo_dcr.protocol.manifest import Ack, Decision, JoinRequest, Manifest, ack_key, decision_key, join_key
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
from nemo_dcr.protocol.snapshot import write_snapshot
from nemo_dcr.transport.relay.thread import RelayThread
from nemo_dcr.transport.store.local import LocalDirStore


def _status(capsys, *args) -> tuple[int, dict | str, str]:
    code = status_cli.main(list(args))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args and out else out), err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.fixture
def run(tmp_path, key):
    """A run of the real sender and follower: v1 committed, v2 refused (aborted), v3
    committed; then v4 published and not decided (in flight); a snapshot of v3."""
    rng = np.random.default_rng(5)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512)
    rx = Rx("r0", store, key, sender.run_id, w, refuse={2}).start(until=3)
    for v in (1, 2, 3):
        _step(w, rng)
        sender.refit(v)
    rx.join()
    v4 = Manifest(run_id=sender.run_id, model_id="m", version=4, base_version=3,
                  base_digest=sender.committed_digest, chunks=())
    digest = sender.coordinator.publish(v4)
    write_snapshot(store, sender.sealer, sender.run_id, 3, sender.committed_digest, {"model.safetensors": b"x" * 10})
    return store, sender, digest


def test_status_shows_the_signed_run_and_counts_no_forged_document(run, key, tmp_path, capsys, monkeypatch):
    # "without the key" below means no --key-file and no $NEMO_DCR_KEY_FILE (which another test
    # in the same worker may have left set, e.g. the fault campaign's main run in process)
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    store, sender, v4_digest = run
    root = store.root
    code, r, err = _status(capsys, "--store", root, "--key-file", key, "--json")
    assert code == 0 and err == "", err
    assert r["run"]["run_id"] == sender.run_id and r["run"]["model_id"] == "m"
    assert r["run"]["signed"] and r["run"]["verified"]
    assert r["committed"]["version"] == 3 and r["committed"]["receivers"] == ["r0"]
    assert r["aborted"] == [2]
    assert r["in_flight"]["version"] == 4 and r["in_flight"]["acks"] == [] and r["in_flight"]["waiting_for"] == ["r0"]
    r0 = r["receivers"]["r0"]
    assert r0["last_ack"]["version"] == 3 and r0["last_ack"]["ok"] and r0["holds"] == 3 and r0["acked_committed"]
    assert [s["state"] for s in r["snapshots"]] == ["complete"] and r["snapshots"][0]["version"] == 3
    assert r["membership"]["members"] == ["r0"] and r["not_trusted"] == []

    # forgeries: an ack of v4 under another key, a genuine ack's bytes altered, an unsigned
    # decision committing v4, a join request under another key
    genuine = Ack.from_json(store.get(ack_key("r0", 3)), sender.sealer)
    other = Sealer(os.urandom(32))
    store.put(ack_key("r0", 4), replace(genuine, version=4, manifest_digest=v4_digest).to_json(other))
    store.put(ack_key("r1", 3), store.get(ack_key("r0", 3)).replace(b'"receiver": "r0"', b'"receiver": "r1"'))
    store.put(decision_key(4), Decision(run_id=sender.run_id, version=4, base_version=3, commit=True,
                                        receivers=("r0",), manifest_digest=v4_digest).to_json(Sealer(None)))
    store.put(join_key("r9"), JoinRequest(run_id=sender.run_id, receiver="r9", held_version=3,
                                          held_digest=sender.committed_digest).to_json(other))
    code, r, _ = _status(capsys, "--store", root, "--key-file", key, "--json")
    assert code == 0
    assert r["committed"]["version"] == 3  # the unsigned commit of v4 is not believed
    assert r["in_flight"]["version"] == 4 and r["in_flight"]["acks"] == []  # the forged ack is not counted
    r0 = r["receivers"]["r0"]
    assert r0["last_ack"]["version"] == 3 and r0["holds"] == 3
    assert [(n["version"], n["trust"]) for n in r0["not_counted"]] == [(4, "FORGED")]
    assert r["receivers"]["r1"]["last_ack"] is None and not r["receivers"]["r1"]["member"]
    assert r["receivers"]["r1"]["not_counted"][0]["trust"] == "FORGED"
    forged = {n["key"]: n["trust"] for n in r["not_trusted"]}
    assert forged == {"acks/r0/00000004.json": "FORGED", "acks/r1/00000003.json": "FORGED",
                      "v/00000004/DECISION.json": "FORGED", "acks/join.d/r9.json": "FORGED"}, forged
    assert r["membership"]["join_requests"][0]["trust"] == "FORGED"
    text = _status(capsys, "--store", root, "--key-file", key)[1]
    assert re.search(r"^in flight\s+v4 \(base v3, 0 B\): acked by nobody; waiting for r0$", text, re.M), text
    assert re.search(r"^receivers\s+r0\s+acked v3 ok, decision commit; holds v3$", text, re.M), text
    assert re.search(r"FORGED ack v4: ack: bad signature .* \(not counted\)$", text, re.M), text

    # control: r0's genuine ack of v4 counts (so the refusal above was the signature's doing)
    store.put(ack_key("r0", 4), replace(genuine, version=4, manifest_digest=v4_digest).to_json(sender.sealer))
    r = _status(capsys, "--store", root, "--key-file", key, "--json")[1]
    assert r["in_flight"]["acks"] == ["r0"] and r["in_flight"]["waiting_for"] == []
    assert r["receivers"]["r0"]["last_ack"]["version"] == 4 and r["receivers"]["r0"]["tentative"]
    # a genuinely signed ack of another manifest than the one published is not counted either
    store.put(ack_key("r0", 4), replace(genuine, version=4).to_json(sender.sealer))  # (v3's digest)
    r = _status(capsys, "--store", root, "--key-file", key, "--json")[1]
    assert r["in_flight"]["acks"] == [] and r["receivers"]["r0"]["not_counted"][0]["trust"] == "REJECTED"

    # without the key: every document UNVERIFIED, nothing counted, one line on stderr
    code, r, err = _status(capsys, "--store", root, "--json")
    assert code == 0 and "is signed and no key was given" in _one_line(err)
    assert not r["run"]["verified"] and r["committed"]["version"] == 0 and r["committed"]["unverified_claim"] == 3
    assert all(e["last_ack"] is None for e in r["receivers"].values())
    assert {n["trust"] for e in r["receivers"].values() for n in e["not_counted"]} >= {"UNVERIFIED"}


def test_status_reads_a_relays_stats(run, key, capsys):
    store, sender, _ = run
    with RelayThread(LocalDirStore(store.root)) as relay:
        url = relay.uri.replace("relay://", "http://")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        code, r, err = _status(capsys, "--store", store.root, "--key-file", key, "--relay", url, "--json")
        assert code == 0 and err == ""
        assert r["relays"][0]["relay"] == url and "served_bytes" in r["relays"][0]["stats"]
        code, text, err = _status(capsys, "--store", store.root, "--key-file", key, "--relay", url, "--relay", dead)
        assert code == 1 and f"relay {dead}: " in _one_line(err)
        assert re.search(rf"^relays\s+{re.escape(url)}  served ", text, re.M), text
        assert f"{dead}  UNREACHABLE" in text


@pytest.mark.parametrize("case", ["no-dir", "no-run", "bad-key", "open-key", "other-key", "bad-relay"])
def test_bad_input_is_one_line_exit_2(run, key, tmp_path, capsys, case):
    store, _, _ = run
    args = ["--store", store.root, "--key-file", key]
    if case == "no-dir":
        args[1] = str(tmp_path / "nope")
        needle = "no such directory"  # (transport/preflight.py's reader check)
    elif case == "no-run":
        (tmp_path / "empty").mkdir()
        args[1] = str(tmp_path / "empty")
        needle = "no run here (RUN.json not found)"
    elif case == "bad-key":
        (tmp_path / "bad.key").write_text("not hex")
        os.chmod(tmp_path / "bad.key", 0o600)
        args[3] = str(tmp_path / "bad.key")
        needle = "not a hex string"
    elif case == "open-key":
        os.chmod(key, 0o644)
        needle = "chmod 600"
    elif case == "other-key":
        args[3] = new_key_file(str(tmp_path / "other.key"))
        needle = "RUN.json is not signed with this key"
    else:
        args += ["--relay", "ftp://x"]
        needle = "give a relay as http://HOST:PORT"
    code, _, err = _status(capsys, *args)
    assert code == 2 and needle in _one_line(err) and _one_line(err).startswith("nemo-dcr status: "), err
    assert not (tmp_path / "nope").exists()  # a mistyped store is not created
    os.chmod(key, 0o600)
    assert _status(capsys, "--store", store.root, "--key-file", key)[0] == 0  # control


@pytest.mark.slow
def test_status_of_a_live_demo_store(tmp_path, capsys):
    """One small demo (2 trainer ranks, 2 receivers, 2 steps) to its end; then status."""
    from nemo_dcr_testbed import demo
    from nemo_dcr_testbed.config import load_demo_config

    small = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
             "model.num_query_groups=2", "model.ffn_hidden_size=256", "model.vocab_size=1003",
             "model.seq_length=32", "steps=2", "train.lr=3e-6"]
    summary = demo.run(load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", *small,
                                         "refit.receivers=[r0,r1]"]))
    assert summary["refits"] == summary["committed"] == 2, summary
    rows = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows if r["committed"])
    key_file = str(tmp_path / "run" / "refit.key")
    capsys.readouterr()
    code, r, err = _status(capsys, "--store", str(tmp_path / "store"), "--key-file", key_file, "--json")
    assert code == 0 and err == "", err
    assert r["committed"]["version"] == last == 2 and r["in_flight"] is None
    assert sorted(r["committed"]["receivers"]) == ["r0", "r1"]
    for rid in ("r0", "r1"):
        e = r["receivers"][rid]
        assert e["acked_committed"] and e["last_ack"]["version"] == last and e["holds"] == last, (rid, e)

    # a forged ack: r1's genuine ack of the last version, tampered to claim the next one
    store = LocalDirStore(str(tmp_path / "store"))
    genuine = store.get(ack_key("r1", last))
    store.put(ack_key("r1", last + 1), genuine.replace(f'"version": {last}'.encode(),
                                                       f'"version": {last + 1}'.encode()))
    # and one under another key
    sealer = Sealer(load_key(key_file))
    ack = Ack.from_json(genuine, sealer)
    store.put(ack_key("r0", last + 1), replace(ack, version=last + 1).to_json(Sealer(os.urandom(32))))
    code, r, _ = _status(capsys, "--store", str(tmp_path / "store"), "--key-file", key_file, "--json")
    assert code == 0 and r["committed"]["version"] == last
    for rid in ("r0", "r1"):
        e = r["receivers"][rid]
        assert e["last_ack"]["version"] == last and e["acked_committed"], (rid, e)  # the forgery is not counted
        assert [(n["version"], n["trust"]) for n in e["not_counted"]] == [(last + 1, "FORGED")], (rid, e)
    text = _status(capsys, "--store", str(tmp_path / "store"), "--key-file", key_file)[1]
    print(text)
    assert re.search(rf"^committed\s+v{last} \(base v{last - 1}\) by r0,r1", text, re.M), text
    assert text.count(f"FORGED ack v{last + 1}") == 2 and "NOT TRUSTED" in text

    # the trainer's one line per decided version (rank 0's log)
    log = (tmp_path / "run" / "trainer.log").read_text()
    print("\n".join(x for x in log.splitlines() if re.match(r"nemo_dcr: v\d+ ", x)))
    for v in (1, 2):
        assert re.search(rf"nemo_dcr: v{v} committed by r0,r1 in \d+\.\d s, \d+\.\d kB", log), log[-3000:]
