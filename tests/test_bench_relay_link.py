"""The pure parts of scripts/bench_relay_link.py: arguments, the relay tree, the link
counters, the stats deltas, the hop summary and the bit-exact check with its negative
control.  The benchmark itself needs root and network namespaces and is not run here."""
from __future__ import annotations

import json
import os

import pytest
import torch
from script_module import script_module



@pytest.fixture(scope="module")
def bench():
    with script_module("bench_relay_link") as mod:
        yield mod


# ---------------------------------------------------------------- arguments
def test_defaults(bench):
    a = bench.parse_args([])
    assert a.rates == [50.0, 200.0] and a.receivers == 4 and a.fanout == 2 and a.fanouts is None
    assert a.topologies == ["store", "relay"] and a.steps == 2 and a.model == "link"
    assert a.kill_relay is None and a.out_name == "relay_link"


def test_fanouts_set_the_receivers(bench):
    a = bench.parse_args(["--fanouts", "2,2,4", "--kill-relay", "r1", "--out-name", "scale_tree"])
    assert a.fanouts == [2, 2, 4] and a.receivers == 16 and a.kill_relay == "r1" and a.out_name == "scale_tree"
    assert bench.parse_args(["--fanouts", "2,2,1", "--receivers", "4"]).receivers == 4
    assert bench.parse_args(["--fanouts", "1,3"]).receivers == 3  # a chain above a fanout is a tree too
    tree = bench.build_tree(a)
    assert len(tree.relays) == 7 and tree.levels() == [["r0"], ["r1", "r2"], ["r3", "r4", "r5", "r6"]]
    assert bench.build_tree(bench.parse_args([])).levels() == [["r0"], ["r1", "r2"]]  # --fanout as before


@pytest.mark.parametrize("argv", [["--rates", "0,50"], ["--rates", "x"], ["--receivers", "0"],
                                  ["--topologies", "store,mesh"], ["--topologies", "store,store"],
                                  ["--fanout", "1"], ["--steps", "0"], ["--model", "huge"], ["--lr", "-1"],
                                  ["--fanouts", "2,2,4", "--receivers", "4"], ["--fanouts", "2,x"], ["--fanouts", "2,0"],
                                  ["--fanouts", ""], ["--kill-relay", "r0"], ["--kill-relay", "rx0"],
                                  ["--kill-relay", "r1", "--topologies", "store"], ["--fanouts", "4", "--kill-relay", "r1"],
                                  ["--out-name", "../relay_link"], ["--out-name", ""]])
def test_bad_arguments_are_exit_2(bench, argv):
    with pytest.raises(bench.BenchError) as e:
        bench.parse_args(argv)
    assert e.value.exit_code == 2


def test_refuses_without_root(bench, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--rates", "50"]) == 2
    assert "needs root" in capsys.readouterr().err


# ---------------------------------------------------------------- the tree
def test_tree_of_four_receivers_fanout_two(bench):
    t = bench.relay_tree(["rx0", "rx1", "rx2", "rx3"], 2)
    assert [(n.name, n.parent, n.children) for n in t.relays] == [
        ("r0", None, ("r1", "r2")), ("r1", "r0", ("rx0", "rx1")), ("r2", "r0", ("rx2", "rx3"))]
    addr = {"r0": "h:7000", "r1": "h:7001", "r2": "h:7002"}
    assert t.upstreams("rx3", addr, "s3://b/run") == "relay://h:7002,relay://h:7000,s3://b/run"
    assert t.upstreams("r1", addr, "s3://b/run") == "relay://h:7000,s3://b/run"
    assert t.upstreams("r0", addr, "s3://b/run") == "s3://b/run"


@pytest.mark.parametrize("n,fanout", [(1, 1), (1, 2), (3, 2), (4, 4), (5, 2), (9, 3), (16, 2)])
def test_tree_shape(bench, n, fanout):
    rx = [f"rx{i}" for i in range(n)]
    t = bench.relay_tree(rx, fanout)
    roots = [r for r in t.relays if r.parent is None]
    assert len(roots) == 1 and t.relays[0] is roots[0]
    assert all(len(r.children) <= fanout for r in t.relays)
    assert sorted(t.receiver_parent) == sorted(rx)
    seen = set()
    for r in t.relays:  # a parent starts before its children
        assert r.parent is None or r.parent in seen
        seen.add(r.name)
    for x in rx:  # every receiver's chain ends at the root
        assert t.ancestors(x)[-1] == "r0"


def test_tree_per_level_2_2_4(bench):
    rx = [f"rx{i}" for i in range(16)]
    t = bench.relay_tree_levels(rx, [2, 2, 4])
    assert [(n.name, n.parent, n.children) for n in t.relays[:4]] == [
        ("r0", None, ("r1", "r2")), ("r1", "r0", ("r3", "r4")), ("r2", "r0", ("r5", "r6")),
        ("r3", "r1", ("rx0", "rx1", "rx2", "rx3"))]
    assert t.relays[-1].children == ("rx12", "rx13", "rx14", "rx15")
    assert t.levels() == [["r0"], ["r1", "r2"], ["r3", "r4", "r5", "r6"]]
    assert t.receiver_parent["rx5"] == "r4" and t.ancestors("rx5") == ["r4", "r1", "r0"]
    addr = {n.name: f"h:{7000 + i}" for i, n in enumerate(t.relays)}
    assert t.upstreams("rx5", addr, "s3://b/run") == "relay://h:7004,relay://h:7001,relay://h:7000,s3://b/run"
    assert t.upstreams("r4", addr, "s3://b/run") == "relay://h:7001,relay://h:7000,s3://b/run"
    assert t.below("r1") == ["r3", "rx0", "rx1", "rx2", "rx3", "r4", "rx4", "rx5", "rx6", "rx7"]
    assert bench.probe_leaf(t, set()) == "r6" and bench.probe_leaf(t, {"r2"}) == "r4"


@pytest.mark.parametrize("fanouts", [[1], [4], [2, 2], [3, 1], [1, 1, 5], [2, 3, 2]])
def test_tree_per_level_shape(bench, fanouts):
    import math

    rx = [f"rx{i}" for i in range(math.prod(fanouts))]
    t = bench.relay_tree_levels(rx, fanouts)
    assert [len(level) for level in t.levels()] == [math.prod(fanouts[:i]) for i in range(len(fanouts))]
    assert sorted(t.receiver_parent) == sorted(rx) and all(len(t.ancestors(x)) == len(fanouts) for x in rx)
    assert [n.name for n in t.relays] == [f"r{i}" for i in range(len(t.relays))]  # a parent starts first
    for depth, level in enumerate(t.levels()):
        for name in level:
            node = next(n for n in t.relays if n.name == name)
            assert len(node.children) == fanouts[depth]


def test_tree_per_level_refuses_a_mismatch(bench):
    with pytest.raises(ValueError, match="seat 16 receivers, not 15"):
        bench.relay_tree_levels([f"rx{i}" for i in range(15)], [2, 2, 4])
    with pytest.raises(ValueError):
        bench.relay_tree_levels(["rx0"], [0, 1])


def test_tree_refuses_fanout_one_over_many(bench):
    with pytest.raises(ValueError):
        bench.relay_tree(["a", "b"], 1)


# ---------------------------------------------------------------- counters
TC = """class htb 1:10 root prio 0 rate 50Mbit ceil 50Mbit burst 1600b cburst 1600b
 Sent 123456789 bytes 90123 pkt (dropped 0, overlimits 4 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_tc_class_sent(bench):
    assert bench.tc_class_sent(TC) == 123456789
    with pytest.raises(bench.BenchError):
        bench.tc_class_sent(TC, "1:20")


def test_counter_log_interpolates_and_finds_the_busy_span(bench):
    log = bench.CounterLog()
    for t, v in [(0.0, 0), (1.0, 100), (2.0, 100 + 10 ** 6), (3.0, 100 + 3 * 10 ** 6), (4.0, 3 * 10 ** 6 + 200)]:
        log.add(t, v)
    assert log.at(-1) == 0 and log.at(9) == 3 * 10 ** 6 + 200
    assert log.at(0.5) == 50
    assert log.delta(1.0, 3.0) == 3 * 10 ** 6
    assert log.busy_span(0.0, 4.0) == (2.0, 3 * 10 ** 6)  # the 100-byte polls are not busy
    assert log.busy_span(0.0, 1.0) is None
    with pytest.raises(ValueError):
        log.add(3.5, 0)


def test_stats_delta_keys_upstreams_by_uri(bench):
    before = {"requests": 3, "upstreams": [{"uri": "s3://b/run", "chunk_bytes_read": 10, "bytes_read": 50}],
              "versions": [1], "sending": []}
    after = {"requests": 9, "upstreams": [{"uri": "s3://b/run", "chunk_bytes_read": 1010, "bytes_read": 1100}],
             "versions": [1, 2], "sending": [{"key": "k", "size": 1, "sent": 0}]}
    d = bench.stats_delta(before, after)
    assert d == {"requests": 6, "upstreams.s3://b/run.bytes_read": 1050, "upstreams.s3://b/run.chunk_bytes_read": 1000}
    assert bench.origin_chunk_bytes(d, "s3://b/run") == 1000
    assert bench.origin_chunk_bytes(d, "s3://other") is None


def test_summarize_hops(bench):
    rows = []
    for m in (50.0, 200.0):
        per_mb = 8 / m  # seconds per MB at the rate, goodput = the rate
        for path, extra in (("origin", 0.0), ("root", 0.01), ("leaf", 0.02)):
            rows.append({"link_mbit": m, "path": path, "bytes": 4096, "seconds": [0.002 + extra / 10] * 3})
            rows.append({"link_mbit": m, "path": path, "bytes": 1_004_096,
                         "seconds": [0.002 + per_mb + extra] * 3})
    h = bench.summarize_hops(rows, 1 << 20)
    assert h["link_efficiency"] == pytest.approx(1.0)
    assert h["relay_hop_fixed_s"] == pytest.approx(0.001)
    assert h["relay_hop_chunk_s"] == pytest.approx(0.01)
    assert h["relay_hop_goodput_gbps"] == pytest.approx(1e6 / 0.009 / 1e9)
    assert h["relay_hop_samples"] == 2 * 2 * 3  # two hops, two rates, three rounds


def test_summarize_hops_pairs_rounds_and_admits_no_goodput(bench):
    # round 2 is slow on every path (a loaded machine): paired differences cancel it
    rows = [{"link_mbit": 50.0, "path": p, "bytes": b, "seconds": [t, t + 5, t]}
            for p, d in (("origin", 0.0), ("root", 0.05), ("leaf", 0.1))
            for b, t in ((4096, 0.01 + d), (1 << 20, 0.2 + d))]
    h = bench.summarize_hops(rows, 1 << 20)
    assert h["relay_hop_fixed_s"] == pytest.approx(0.05) and h["relay_hop_chunk_s"] == pytest.approx(0.05)
    assert h["relay_hop_goodput_gbps"] is None  # a chunk costs the hop no more than a small object
    assert h["link"][0]["goodput_mbit"] == pytest.approx(((1 << 20) - 4096) * 8 / 0.19 / 1e6)


def test_summarize_hops_divides_by_the_leaf_hops(bench):
    rows = [{"link_mbit": 50.0, "path": p, "bytes": b, "seconds": [t + d] * 3}
            for p, d in (("origin", 0.0), ("root", 0.01), ("leaf", 0.03))  # the leaf: two hops below the root
            for b, t in ((4096, 0.001), (1 << 20, 0.2))]
    assert bench.summarize_hops(rows, 1 << 20, leaf_hops=2)["relay_hop_fixed_s"] == pytest.approx(0.01)
    assert bench.summarize_hops(rows, 1 << 20)["relay_hop_fixed_s"] == pytest.approx(0.015)  # control: taken as one


# ---------------------------------------------------------------- origin reads, timelines
MOTO = (
    '10.0.0.2 - - [07/Dec/2026 03:31:27] "\x1b[35m\x1b[1mGET /relay-link/run/v/00000003/chunks/r000-00001.dcr '
    'HTTP/1.1\x1b[0m" 206 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:27] "GET /relay-link/run/v/00000003/chunks/r000-00002.dcr HTTP/1.1" 200 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:28] "GET /relay-link/run/v/00000003/chunks/r000-00002.dcr HTTP/1.1" 200 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:28] "HEAD /relay-link/run/v/00000003/chunks/r000-00003.dcr HTTP/1.1" 200 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:28] "GET /relay-link/run/v/00000003/chunks/r000-00003.dcr HTTP/1.1" 404 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:28] "GET /relay-link?list-type=2&prefix=run/v/00000003/chunks/ HTTP/1.1" 200 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:29] "GET /relay-link/run/v/00000003/MANIFEST.json HTTP/1.1" 200 -\n'
    '10.0.0.2 - - [07/Dec/2026 03:31:29] "GET /other/run/v/00000003/chunks/r000-00001.dcr HTTP/1.1" 200 -\n')


def test_origin_reads_from_the_moto_log(bench):
    gets = bench.origin_chunk_gets(MOTO, "relay-link", "run")
    assert gets == {"v/00000003/chunks/r000-00001.dcr": 1, "v/00000003/chunks/r000-00002.dcr": 2}
    sizes = {"v/00000003/chunks/r000-00001.dcr": 100, "v/00000003/chunks/r000-00002.dcr": 10,
             "v/00000003/chunks/r000-00003.dcr": 7}
    assert bench.origin_reads(gets, sizes) == {
        "origin_read_bytes": 100 + 2 * 10, "origin_chunk_gets": 3, "origin_chunks": 3,
        "origin_chunks_read_twice": 1, "origin_chunks_never_read": 1}


def test_level_times_and_lags(bench):
    levels = [["r0"], ["r1", "r2"]]
    tl = bench.level_times(levels, {"r0": 100.5, "r1": 100.75, "r2": None}, {"rx0": 102.0, "rx1": 101.5, "rx2": None},
                           100.0)
    assert tl["levels"] == [
        {"level": 1, "nodes": 1, "first_s": 0.5, "last_s": 0.5, "missing": []},
        {"level": 2, "nodes": 2, "first_s": 0.75, "last_s": 0.75, "missing": ["r2"]},
        {"level": "receivers", "nodes": 3, "first_s": 1.5, "last_s": 2.0, "missing": ["rx2"]}]
    assert tl["receiver_lag_s"] == {"rx0": 0.5, "rx1": 0.0, "rx2": None}
    med = bench.timeline_medians([{"timeline": tl}, {"timeline": tl}, {}])
    assert med["levels"][2]["last_s"] == 2.0 and med["receiver_lag_s"]["rx0"] == 0.5


def test_log_tail_hands_out_each_complete_line_once(bench, tmp_path):
    log = tmp_path / "relay-r1.log"
    log.write_text('{"relay": "listening", "ts": 1.0}\nnot json\n{"relay": "version", "vers')
    tail = bench.LogTail(str(log))
    is_v2 = lambda e: e.get("relay") == "version" and e.get("version") == 2  # noqa: E731
    assert tail.new_events(is_v2) == []  # the last line is not complete yet
    with open(log, "a") as f:
        f.write('ion": 2, "held": [2], "ts": 2.0}\n')
    assert tail.new_events(is_v2) == [{"relay": "version", "version": 2, "held": [2], "ts": 2.0}]
    assert tail.new_events(is_v2) == []


# ---------------------------------------------------------------- bit-exactness
def _state():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(128, generator=g).to(torch.bfloat16)}


def test_verify_equal_and_negative_control(bench):
    ref = _state()
    got = {k: v.clone() for k, v in ref.items()}
    v = bench.verify(got, ref, negative_control=True)
    assert v["bit_exact"] and v["compared"] == 2 and v["negative_control"] == "detected"
    assert torch.equal(got["a.weight"].view(torch.int16), ref["a.weight"].view(torch.int16))  # the copy was flipped


def test_verify_sees_one_bit_and_signed_zero(bench):
    ref = _state()
    got = {k: v.clone() for k, v in ref.items()}
    got["b.weight"].view(torch.int16)[5] ^= 1
    assert bench.verify(got, ref, negative_control=False)["differing"] == ["b.weight"]
    z = {"z": torch.zeros(4, dtype=torch.bfloat16)}
    assert bench.bit_differences({"z": -z["z"]}, z) == ["z"]  # -0.0 == 0.0 as floats, not as bits
    assert bench.bit_differences({"z": z["z"].float()}, z) == ["z"]  # dtype first
    assert bench.bit_differences({}, z) == ["z"]


def test_read_persistent_weights_round_trip(bench, tmp_path):
    from nemo_dcr.runtimes.persistent import bind_persistent

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    bind_persistent(model, str(tmp_path), "run-1")
    with torch.no_grad():
        model[0].weight.view(-1)[3] = 7.0  # an in-place write lands in the mapped file
    got = bench.read_persistent_weights(str(tmp_path))
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert bench.bit_differences(got, ref) == []
    assert json.loads((tmp_path / "weights.json").read_text())["run_id"] == "run-1"
