"""``scripts/bench_refit_link.py`` end to end at its smallest configuration: a tiny model,
one link rate, one learning rate, one step, through a real shaped link (network namespace,
veth pair, tc htb on both ends), a real moto S3 server behind it, the megatron-core trainer
at TP=2 under torchrun and the transformers receiver.  Checks the JSON has every field,
that the delta refit was verified bit-exact against the dense one (with the negative
control seen), and that the namespace and the veth pair are gone afterwards.

The run needs root and iproute2 (``ip``, ``tc``) and is skipped without them; the refusal
without root is checked either way (in process, with ``os.geteuid`` reporting a user).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_refit_link.py")
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "model.num_query_groups=2",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=16"]
CASE_FIELDS = ("link_mbit", "lr", "changed_pct", "wire_bytes", "dense_bytes", "wire_ratio", "dcr_s", "dense_s",
               "speedup", "link_bound", "stages", "dense_stages", "overlap", "slowest_stage", "bit_exact", "refits")
STAGES = ("diff_s", "project_s", "encode_s", "publish_s", "rx_download_s", "rx_decode_s", "rx_apply_s")


def _missing_privileges() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespace, veth pair, tc shaping)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_missing_privileges() is not None, reason=_missing_privileges() or "")
def test_smallest_configuration_refits_bit_exact_over_a_shaped_link(tmp_path):
    out, run = tmp_path / "out", tmp_path / "run"
    cmd = [sys.executable, SCRIPT, "--rates", "50", "--lrs", "1e-4", "--steps", "1", "--dense-steps", "1",
           "--variants", "stream,nostream+small-first", "--warmup", "0",
           "--probe-mib", "1", "--out-dir", str(out), "--run-dir", str(run), *TINY]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"

    d = json.loads((out / "refit_link.json").read_text())
    assert (out / "refit_link.png").stat().st_size > 0
    meta = d["meta"]
    assert "bench_refit_link.py --rates 50" in meta["command"]
    assert meta["tp"] == 2 and meta["link_probe"][0]["link_mbit"] == 50
    stream, other, dense_step = d["cases"]
    assert [c["variant"] for c in d["cases"]] == ["stream", "nostream+small-first", "stream (dense steps)"]
    assert meta["variants"]["nostream+small-first"] == {"stream": False, "qdisc": "small-first"}
    for case in d["cases"]:
        for field in CASE_FIELDS:
            assert field in case, field
        assert set(case["stages"]) == set(STAGES)
        assert case["link_mbit"] == 50 and case["lr"] == 1e-4 and 0 < case["changed_pct"] <= 100
        assert case["wire_ratio"] == pytest.approx(case["dense_bytes"] / case["wire_bytes"])
        assert case["speedup"] == pytest.approx(case["dense_s"] / case["dcr_s"])
        assert case["dcr_s"] > 0 and case["dense_s"] > 0 and case["overlap"] >= 1.0 and case["dense_n"] == 1
        for refit in case["refits"]:
            assert refit["bit_exact"] is True and refit["verify"][0]["compared"] > 0
            # the critical path adds up to the wall; the counters and the request accounting are there
            segments = [v for k, v in refit["timeline"].items() if not k.startswith("_")]
            assert sum(segments) == pytest.approx(refit["dcr_s"], abs=2e-3)
            assert refit["up_mb"] > 0 and refit["down_mb"] > 0 and refit["trainer_cpu_s"] > 0
            assert refit["requests"]["trainer"]["put:chunk"]["n"] == refit["chunks"]
            assert refit["requests"]["receiver"]["get:chunk"]["n"] == refit["chunks"]
            assert "stat:chunk" not in refit["requests"]["receiver"]
    # the dense step's nemo_dcr refit is a case of its own (its dense refit is every case's dense side)
    for case in d["cases"]:
        assert case["committed"] == case["bit_exact"] == "1/1"
    assert dense_step["refits"][0]["dense_step"] and not stream["refits"][0]["dense_step"]
    assert dense_step["refits"][0]["negative_control"] == ["detected"]
    assert other["prefetched_share"] == 0 and other["refits"][0]["rx_stream"] is False
    assert meta["verification"]["bit_exact_refits"] == "3/3"
    assert p.stdout.splitlines()[0].split()[:2] == ["link", "Mbit/s"]  # the table on stdout, progress on stderr
    assert "[bench_refit_link] step 3/3" in p.stderr

    # everything the run created is gone
    assert meta["link"]["namespace"] not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                           text=True).stdout
    assert subprocess.run(["ip", "link", "show", meta["link"]["host_if"]], capture_output=True).returncode != 0


def test_refuses_to_run_without_root(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_refit_link", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # an unprivileged user
    assert bench.main(["--run-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before anything was created
