"""``scripts/bench_pipeline.py``: its arguments and per-case summary in process, and the
script end to end at its tiniest (a tiny model, one shaped link, one timed step per mode)
through a real shaped link, moto S3 server, the megatron-core trainer at TP=2 under
torchrun and the transformers receiver.  The run needs root and iproute2 and is skipped
without them; it checks the JSON's shape and that the bit-exact check (with its negative
control) ran and passed."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from script_module import script_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_pipeline.py"
CASE_FIELDS = ("mode", "link_mbit", "pause_s", "step_s", "diff_project_s", "pause_over_diff_project", "steps_n",
               "committed", "steps")


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_pipeline") as mod:
        yield mod


def test_defaults(bench):
    a = bench.parse_args([])
    assert a.links == [50.0, None] and a.steps == 3 and a.model == "link" and a.micro_batches == 1


def test_links(bench):
    assert bench.parse_links("unshaped, 50,200") == [None, 50.0, 200.0]


@pytest.mark.parametrize("argv", [["--links", "0"], ["--links", "fast"], ["--links", "50,50"], ["--links", ""],
                                  ["--steps", "0"], ["--micro-batches", "0"], ["--lr", "0"]])
def test_bad_arguments_are_exit_2(bench, argv):
    with pytest.raises(bench.BenchError) as e:
        bench.parse_args(argv)
    assert e.value.exit_code == 2


def test_refuses_without_root(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--run-dir", str(tmp_path / "run")]) == 2
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _stats(version, diff_s, project_s):
    return {"version": version, "base_version": version - 1, "changed": 10, "numel": 1000, "wire_bytes": 100,
            "chunks": 1, "diff_s": diff_s, "project_s": project_s, "encode_s": 0.1, "upload_s": 0.2,
            "publish_s": 0.3, "commit_wait_s": 0.1, "committed": True, "reason": "", "pause_s": 0.05,
            "refit_s": 0.5}


def test_case_entry_medians_leave_out_the_lead_in(bench):
    steps = [{"step": s, "loss": 1.0, "t_start": float(s), "version": s, "step_s": step_s, "pause_s": pause_s,
              "step_s_ranks": [step_s], "pause_s_ranks": [pause_s], "stats": _stats(s, 0.1, 0.1)}
             for s, step_s, pause_s in ((1, 9.0, 9.0), (2, 2.0, 0.2), (3, 3.0, 0.4), (4, 4.0, 0.3))]
    c = bench.case_entry({"mode": "pipelined", "steps": steps, "finish_s": 0.7}, 50.0)
    assert c["steps_n"] == 3 and not c["steps"][0]["timed"] and all(s["timed"] for s in c["steps"][1:])
    assert c["step_s"] == 3.0 and c["pause_s"] == 0.3 and c["diff_project_s"] == pytest.approx(0.2)
    assert c["pause_over_diff_project"] == pytest.approx(1.5) and c["goal_met"] is True
    assert c["committed"] == "3/3" and c["changed_pct"] == pytest.approx(1.0)
    off = bench.case_entry({"mode": "off", "finish_s": 0.0, "steps": [
        {**s, "pause_s": 0.0, "version": None, "stats": None} for s in steps]}, None)
    assert off["pause_s"] == 0.0 and off["diff_project_s"] is None and off["committed"] is None
    assert "goal_met" not in off


def _missing_privileges() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespace, veth pair, tc shaping)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_missing_privileges() is not None, reason=_missing_privileges() or "")
def test_tiniest_run_writes_every_case_and_checks_bit_exactness(tmp_path):
    out, run = tmp_path / "out", tmp_path / "run"
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny", "--links", "50", "--steps", "1", "--micro-batches", "1",
           "--probe-mib", "1", "--out-dir", str(out), "--run-dir", str(run)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    d = json.loads((out / "pipeline.json").read_text())
    assert (out / "pipeline.png").stat().st_size > 0
    meta = d["meta"]
    assert "bench_pipeline.py --model tiny" in meta["command"] and meta["tp"] == 2
    assert [c["mode"] for c in d["cases"]] == ["off", "sync", "pipelined"]
    for c in d["cases"]:
        for field in CASE_FIELDS:
            assert field in c, field
        assert c["link_mbit"] == 50.0 and c["steps_n"] == 1 and len(c["steps"]) == 2  # lead-in + timed
        assert c["step_s"] > 0
    off, sync, pipe = d["cases"]
    assert off["pause_s"] == 0.0 and off["diff_project_s"] is None
    for c in (sync, pipe):
        assert c["committed"] == "1/1" and c["pause_s"] > 0 and c["diff_project_s"] > 0  # the timed refit
        assert c["pause_over_diff_project"] == pytest.approx(c["steps"][1]["pause_s"] / c["steps"][1]["diff_project_s"])
    assert isinstance(pipe["goal_met"], bool)
    v = meta["verification"]
    assert v["bit_exact"] == "1/1" and v["negative_control"] == ["detected"]
    (check,) = v["checks"]
    assert check["bit_exact"] and check["version"] == pipe["steps"][-1]["version"] and check["receivers"][0]["compared"] > 0
    assert p.stdout.splitlines()[0].split()[:2] == ["link", "mode"]
    # everything the run created is gone
    assert meta["link"]["namespace"] not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                           text=True).stdout
    assert subprocess.run(["ip", "link", "show", meta["link"]["host_if"]], capture_output=True).returncode != 0


def test_summarize_run_writes_the_finished_phases(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "git_state", lambda root: None)  # no `git` subprocess here
    from nemo_dcr_testbed.config import load_demo_config

    run = tmp_path / "run"
    (run / "go").mkdir(parents=True)
    cfg = load_demo_config(["model.num_layers=1", f"run_dir={run}", "refit.verify_dense=false"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    steps = [{"step": s, "loss": 1.0, "t_start": float(s), "version": s, "step_s": 2.0, "pause_s": 0.3,
              "step_s_ranks": [2.0, 1.9], "pause_s_ranks": [0.3, 0.2], "stats": _stats(s, 0.1, 0.1)} for s in (1, 2)]
    plans = [{"kind": "run", "mode": "pipelined", "steps": 2, "lr": 1e-5, "link_mbit": 50.0},
             {"kind": "verify", "link_mbit": 50.0}, {"kind": "run", "mode": "off", "steps": 2, "lr": 1e-5,
                                                     "link_mbit": None}]
    rows = [{"kind": "run", "plan": plans[0], "mode": "pipelined", "steps": steps, "finish_s": 0.5,
             "canonical_numel": 1000, "committed_version": 2},
            {"kind": "verify", "plan": plans[1], "version": 2, "dense": {"verify": [
                {"receiver": "r0", "bit_exact": True, "compared": 3, "summary": "3 tensors bit-identical",
                 "negative_control": "detected"}]}}]
    for n, p in enumerate(plans):  # the third phase was started but never finished
        (run / "go" / f"{n}.json").write_text(json.dumps(p))
    (run / "phases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert bench.main(["--summarize-run", str(run), "--out-dir", str(out)]) == 0
    d = json.loads((out / "pipeline.json").read_text())
    (case,) = d["cases"]
    assert case["mode"] == "pipelined" and case["link_mbit"] == 50.0 and case["steps_n"] == 1
    assert d["meta"]["summarized_from_run_dir"] and d["meta"]["verification"]["bit_exact"] == "1/1"
    assert d["meta"]["timed_steps_per_case"] == 1 and (out / "pipeline.png").stat().st_size > 0
    assert bench.main(["--summarize-run", str(tmp_path / "missing"), "--out-dir", str(out)]) != 0
