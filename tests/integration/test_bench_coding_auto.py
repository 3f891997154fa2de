"""``scripts/bench_coding_auto.py`` in process: its plan, and its summary and JSON/PNG writer on
a recorded run's rows (synthetic here: the run itself needs root, a shaped link and ~15 min)."""
from __future__ import annotations

import json
import os

import pytest
from script_module import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_coding_auto") as mod:
        yield mod


def test_defaults_and_bad_arguments(bench):
    a = bench.parse_args([])
    assert a.links == [50.0, 1000.0, None] and a.rounds == 3 and a.lead_in == 2 and a.model == "mid"
    for argv in (["--rounds", "0"], ["--lead-in", "-1"], ["--lr", "0"], ["--links", "50,50"]):
        with pytest.raises(bench.BenchError) as e:
            bench.parse_args(argv)
        assert e.value.exit_code == 2


def test_refuses_without_root(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--run-dir", str(tmp_path / "run")]) == 2
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_plan_rotates_the_codings_and_ends_with_the_check(bench):
    plan = bench.make_plan([50.0, None], rounds=3, lead_in=2, lr=1e-6, setup_mbit=10000.0)
    assert len(plan) == 2 * (2 + 3 * 4) + 1
    first = plan[:14]
    assert [p["coding"] for p in first[:2]] == ["auto", "auto"] and not any(p["timed"] for p in first[:2])
    rounds = [[p["coding"] for p in first[2 + 4 * r: 6 + 4 * r]] for r in range(3)]
    assert rounds == [["context", "plain", "fast", "auto"], ["plain", "fast", "auto", "context"],
                      ["fast", "auto", "context", "plain"]]
    assert all(p["link_mbit"] == 50.0 and p["case_link"] == 50.0 for p in first)
    assert all(p["link_mbit"] == 10000.0 and p["case_link"] is None for p in plan[14:])  # unshaped
    assert plan[-1]["dense"] and plan[-1].get("verify") and not plan[-1]["timed"]
    assert sum(p["dense"] for p in plan) == 1


def test_every_step_carries_what_the_link_driver_reads(bench):
    """bench_refit_link's Run.execute reads each step's link queueing and receive mode (it
    raised KeyError 'qdisc' after those were added there): every step names them, and they
    are one of its variants (the streaming one, a FIFO link)."""
    with script_module("bench_refit_link") as link:
        variants = link.VARIANTS
    plan = bench.make_plan([50.0, None], rounds=1, lead_in=1, lr=1e-6, setup_mbit=10000.0)
    for p in plan:
        assert (p["stream"], p["qdisc"]) == variants["stream"]
        assert {"lr", "link_mbit", "dense", "warmup"} <= p.keys()


def _row(step, coding, wall, wire):
    stats = {"version": step, "coding": coding, "next_coding": coding, "coding_walls": {}, "committed": True,
             "reason": "", "wire_bytes": wire, "raw_bytes": 10 * wire, "changed": 100, "encode_s": 0.1,
             "encode_cpu_s": 0.1, "upload_s": 0.2,
             "acks": [{"receiver": "r0", "stats": {"decode_cpu_s": 0.05, "download_s": 0.3, "apply_s": 0.01}}]}
    return {"step": step, "canonical_numel": 10_000, "dcr": {"wall_s": wall}, "stats": stats, "dense": None}


def test_summary_and_files_from_recorded_rows(bench, tmp_path, capsys):
    plan = bench.make_plan([50.0], rounds=2, lead_in=1, lr=1e-6, setup_mbit=10000.0)
    walls = {"context": 1.0, "plain": 1.5, "fast": 2.0}
    rows = []
    for n, p in enumerate(plan, 1):
        used = "context" if p["coding"] == "auto" else p["coding"]
        wall = {"auto": 1.05}.get(p["coding"], walls.get(p["coding"]))
        rows.append(_row(n, used, wall + 0.01 * n, {"context": 100, "plain": 150, "fast": 200}[used]))
    rows[-1]["dense"] = {"verify": [{"receiver": "r0", "bit_exact": True, "compared": 3, "summary": "3 tensors "
                                     "bit-identical", "negative_control": "detected"}]}
    records = [bench.step_record(r, p) for p, r in zip(plan, rows)]
    cases = bench.summarize(records, [50.0])
    by = {c["coding"]: c for c in cases}
    assert sorted(by) == ["auto", "context", "fast", "plain"] and all(c["steps_n"] == 2 for c in cases)
    assert by["context"]["best_fixed"] == "context"
    ratio = by["auto"]["wall_s"] / by["context"]["wall_s"]
    assert all(c["auto_over_best"] == pytest.approx(ratio) for c in cases) and 1 < ratio < bench.GOAL
    assert by["auto"]["codings_used"] == {"context": 2} and by["auto"]["goal_met"]
    # control: a slower auto misses the goal
    slow = [{**r, "wall_s": r["wall_s"] * 2} if r["plan_coding"] == "auto" else r for r in records]
    assert not bench.summarize(slow, [50.0])[0]["goal_met"]

    path = bench.write_results(str(tmp_path), cases, {"verification": bench._verification(list(zip(plan, rows)))})
    got = json.loads(open(path).read())
    assert {"link_mbit", "coding", "wall_s", "auto_over_best"} <= set(got["cases"][0])
    assert got["meta"]["verification"]["bit_exact"] == "1/1"
    assert (tmp_path / "coding_auto.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "auto/best" in table and "50 Mbit/s" in table
