"""The demo over a relay tree (``refit.transport=relay``, docs/relay.md).

* the settings: ``refit.transport`` / ``refit.relay_fanout`` are the demo's own (not the
  callbacks' ``RefitOptions``), refused in one line when they make no tree;
* the tree's shape rule (``demo.relay_tree``), checked on many sizes;
* one real demo run, 4 receivers under 3 relays: every version committed and bit-exact, the
  origin store served about one copy of the chunks (``origin_read_bytes`` <= 1.2 x
  ``wire_bytes``), and no relay outlives the demo; the negative control, a run without
  relays where the origin served one copy per receiver, rides on the two-receiver demo of
  ``test_refit_e2e.py`` (one demo run fewer).
"""
from __future__ import annotations

import json
import sys
from dataclasses import fields

import psutil
import pytest

from nemo_dcr.integrations.settings import RefitOptions
from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import RefitConfig, load_demo_config
from nemo_dcr_testbed.demo import main, relay_tree

from .test_demo_cleanup import FAIL_R1, _Watcher


@pytest.mark.parametrize("override,needle", [
    ("refit.transport=tcp", "refit.transport must be one of ('store', 'relay'), got 'tcp'"),
    ("refit.transport=relay refit.relay_fanout=0", "refit.relay_fanout must be >= 1, got 0"),
    ("refit.relay_fanout=3", "refit.relay_fanout=3 applies to refit.transport=relay only"),
    ("refit.transport=relay refit.relay_fanout=1 refit.receivers=[a,b]",
     "refit.relay_fanout=1 cannot join 2 receivers under one root relay"),
    ("refit.transport=relay refit.receivers=[]", "refit.receivers is empty"),
    ("refit.relay_fanout=two", "refit.relay_fanout=two: Value 'two' of type 'str' could not be converted to Integer"),
    ("store.uri='a,b'", "store.uri is the one store the trainer writes, not an upstream list"),
])
def test_bad_relay_settings_are_one_line(override, needle, capsys, tmp_path):
    args = [*override.split(), f"run_dir={tmp_path}/run"]
    if not override.startswith("store.uri"):
        args.append(f"store.uri={tmp_path}/store")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_relay_settings_load_and_are_the_demos_own():
    """Control for the refusals above; and the two keys describe the rollout side's topology,
    so they are the demo's ``refit`` section's, not the schema every callback shares."""
    cfg = load_demo_config(["refit.transport=relay", "refit.relay_fanout=3", "refit.receivers=[a,b,c,d]"])
    assert (cfg.refit.transport, cfg.refit.relay_fanout) == ("relay", 3)
    one = load_demo_config(["refit.transport=relay", "refit.relay_fanout=1"])  # one receiver: one relay
    assert (one.refit.relay_fanout, one.refit.receivers) == (1, ("r0",))
    default = load_demo_config([])
    assert (default.refit.transport, default.refit.relay_fanout) == ("store", 2)
    schema = {f.name for f in fields(RefitOptions)}
    assert {"transport", "relay_fanout"} <= {f.name for f in fields(RefitConfig)} - schema


@pytest.mark.parametrize("receivers,fanout,relays,depth", [
    (1, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (3, 2, 3, 2), (4, 2, 3, 2), (5, 2, 6, 3), (8, 2, 7, 3),
    (9, 3, 4, 2), (10, 3, 7, 3), (4, 4, 1, 1), (16, 4, 5, 2),
])
def test_the_relay_tree_is_balanced(receivers, fanout, relays, depth):
    tree = relay_tree(receivers, fanout)
    assert len(tree.parents) == relays and len(tree.receiver_parents) == receivers
    chains = [tree.ancestors(p) for p in tree.receiver_parents]
    assert all(len(c) == depth and c[-1] == 0 for c in chains)  # every receiver at the same depth, one root
    children = [0] * relays
    for p in [*tree.parents[1:], *tree.receiver_parents]:
        children[p] += 1
    assert 1 <= min(children) and max(children) <= fanout  # no idle relay, none over its fanout
    assert len({c[0] for c in chains}) == -(-receivers // fanout)  # receivers packed under their relays


def test_fanout_one_makes_no_tree_over_several_receivers():
    with pytest.raises(ValueError, match="no relay tree for 2 receivers with fanout 1"):
        relay_tree(2, 1)


def test_a_plain_store_counts_the_chunk_bytes_it_read(tmp_path):
    """What a receiver reading the origin directly reports in its final event
    (``origin_chunk_bytes``): every chunk byte its ``get`` calls returned, nothing else."""
    from nemo_dcr.transport.failover import origin_chunk_bytes
    from nemo_dcr.transport.relay_client import RelayStore
    from nemo_dcr.transport.store import open_store

    store = open_store(str(tmp_path / "origin"))
    store.put("v/1/chunks/r0-0", b"x" * 100)
    store.put("v/1/MANIFEST.json", b"{}" * 5)
    assert origin_chunk_bytes(store) == 0  # control: nothing read yet
    store.get("v/1/chunks/r0-0")
    store.get_with_info("v/1/chunks/r0-0", max_bytes=100)
    store.get("v/1/MANIFEST.json")
    store.stat("v/1/chunks/r0-0")
    assert origin_chunk_bytes(store) == 200
    assert origin_chunk_bytes(RelayStore("relay://127.0.0.1:9")) == 0  # a relay is not the origin


SMALL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.ffn_hidden_size=256", "model.vocab_size=1003",
         "model.seq_length=32", "steps=2", "train.lr=3e-6", "refit.verify_dense=true"]


def _demo(tmp_path, name, *overrides) -> tuple[dict, dict[int, str], list[int]]:
    """One demo run: its summary, the relay processes seen while it ran (pid -> command
    line) and the pids of every process it started that is still alive after it returned."""
    watcher = _Watcher()
    watcher.start()
    try:
        summary = demo.run(load_demo_config([f"run_dir={tmp_path}/{name}", f"store.uri={tmp_path}/{name}-store",
                                             *SMALL, *overrides]))
    finally:
        watcher.halt.set()
        watcher.join()
        left = [pid for pid in watcher.seen if watcher.alive(pid)]
        for pid in left:  # so that a failing test leaves nothing behind either
            psutil.Process(pid).kill()
    relays = {pid: cmd for pid, (_, cmd) in watcher.seen.items() if "nemo_dcr.cli relay" in cmd}
    return summary, relays, left


@pytest.mark.slow
def test_the_demo_over_a_relay_tree_reads_the_origin_once(tmp_path):
    summary, relays, left = _demo(tmp_path, "relay", "refit.receivers=[r0,r1,r2,r3]", "refit.transport=relay",
                                  "refit.relay_fanout=2")
    print(json.dumps({k: summary[k] for k in ("transport", "relays", "wire_bytes", "origin_read_bytes")}))
    # every version committed by all 4 receivers, each bit-exact against the dense export
    # (the receivers compare integer views; the table's bit_exact needs every ack's yes)
    assert (summary["refits"], summary["committed"], summary["bit_exact"]) == (2, 2, 2)
    assert summary["transport"] == "relay" and summary["relays"] == 3
    assert 0 < summary["wire_bytes"] <= summary["origin_read_bytes"] <= 1.2 * summary["wire_bytes"]
    # 3 relays ran (control: the orphan check below is not vacuous) and none outlived the demo
    assert len(relays) == 3, relays
    assert left == [], left
    # the shape: relay0 reads the origin; relay1 and relay2 read relay0, then the origin
    listening = [next(e for e in demo._events(str(tmp_path / "relay" / f"relay{i}.log"))
                      if e.get("relay") == "listening") for i in range(3)]
    root, origin = f"relay://{listening[0]['address']}", listening[0]["upstreams"][0]
    assert origin.endswith("relay-store") and listening[0]["upstreams"] == [origin]
    assert listening[1]["upstreams"] == listening[2]["upstreams"] == [root, origin]


@pytest.mark.slow
def test_a_failing_receiver_under_relays_leaves_no_relay_running(tmp_path, monkeypatch, capsys):
    """The relays are stopped on failure too: receiver r1 fails one second after it starts,
    the demo fails, and no process it started (relays included) is left."""
    real_start = demo._Children.start

    def start(self, cmd, log, env):
        if "--receiver-id" in cmd and cmd[cmd.index("--receiver-id") + 1] == "r1":
            cmd = [sys.executable, "-c", FAIL_R1]
        return real_start(self, cmd, log, env)

    monkeypatch.setattr(demo._Children, "start", start)
    watcher = _Watcher()
    watcher.start()
    try:
        code = main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", *SMALL,
                     "refit.receivers=[r0,r1,r2,r3]", "refit.transport=relay"])
    finally:
        watcher.halt.set()
        watcher.join()
        left = [pid for pid in watcher.seen if watcher.alive(pid)]
        for pid in left:
            psutil.Process(pid).kill()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "receiver r1 failed (exit 3): RuntimeError: injected receiver failure" in err[-1], err
    relays = [cmd for _, cmd in watcher.seen.values() if "nemo_dcr.cli relay" in cmd]
    assert len(relays) == 3, relays  # control: the relays were running when r1 failed
    assert left == [], [watcher.seen[pid][1] for pid in left]
