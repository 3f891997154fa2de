"""scripts/bench_join.py: its arguments, the bit-exact check with its negative control, and
one run at a tiny size (a trainer committing 6 versions, a fresh ``nemo-dcr receive``
joining at version 6 through a composed catch-up) whose JSON must have its shape and say
the check ran and caught the flipped bit."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from script_module import script_module



@pytest.fixture(scope="module")
def bench():
    with script_module("bench_join") as mod:
        yield mod


def test_defaults(bench):
    a = bench.parse_args([])
    assert a.versions == [1, 10, 50] and a.changed == 0.03 and a.patterns == ["independent", "concentrated"]
    assert a.snapshot_every == 20 and bench.parse_args(["--snapshot-every", "0"]).snapshot_every == 0


@pytest.mark.parametrize("argv", [["--versions", "0,5"], ["--versions", "x"], ["--versions", "3,3"],
                                  ["--patterns", "random"], ["--changed", "0.2", "--hot", "0.1"],
                                  ["--repeats", "0"], ["--hidden", "100"], ["--snapshot-every", "-1"]])
def test_bad_arguments_are_exit_2(bench, argv):
    with pytest.raises(bench.BenchError) as e:
        bench.parse_args(argv)
    assert e.value.exit_code == 2


def test_dump_check_and_its_negative_control(bench, tmp_path):
    torch.manual_seed(0)
    state = {"a": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(7).to(torch.bfloat16)}
    want = {k: v.view(torch.int16).clone() for k, v in state.items()}
    path = str(tmp_path / "v3.safetensors")
    save_file(state, path)
    got = bench.check_dump(path, want)
    assert got["bit_exact"] and got["negative_control_detected"] and got["tensors"] == 2
    # a receiver one bit off: reported, and the control still sees its own flip
    bad = dict(state)
    bad["b"] = state["b"].clone()
    bad["b"].view(torch.int16)[3] ^= 1 << 15
    save_file(bad, path)
    got = bench.check_dump(path, want)
    assert not got["bit_exact"] and got["mismatched"] == ["b"] and got["negative_control_detected"]
    # same bits under another dtype (a silent cast would hide a difference) are not accepted
    assert bench.mismatches({"a": state["a"].view(torch.float16), "b": state["b"]}, want) == ["a"]


@pytest.mark.slow  # starts `nemo-dcr receive` processes
def test_tiny_run_writes_its_json_with_the_check(bench, tmp_path):
    argv = ["--hidden", "64", "--layers", "1", "--ffn", "128", "--vocab", "256", "--versions", "6",
            "--repeats", "1", "--patterns", "independent", "--timeout-s", "120", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    out = json.loads((tmp_path / "join.json").read_text())
    assert (tmp_path / "join.png").stat().st_size > 0
    assert out["versions"] == [6] and out["params"] > 0 and out["dense_bytes"] == 2 * out["params"]
    (row,) = out["rows"]
    assert row["pattern"] == "independent" and row["versions"] == 6 and row["repeats"] == len(row["runs"]) == 1
    for k in ("start_s", "catchup_s", "total_s", "cpu_s"):
        assert row[k] > 0
    assert row["total_s"] == pytest.approx(row["start_s"] + row["catchup_s"], abs=2e-3)
    # the catch-up from 0 to 5 was one composed delta, then version 6 was applied
    assert row["catchup_mode"] == "composed" and row["catchup_versions"] == 5
    assert 0.03 < row["union_changed_frac"] < 0.2
    assert row["bit_exact"] is True and row["negative_control_detected"] is True and row["mismatched"] == []
    assert row["tensors"] > 0 and row["total_vs_first"] == 1.0


@pytest.mark.slow  # starts `nemo-dcr receive` processes
def test_tiny_run_with_snapshots_joins_from_the_newest_one(bench, tmp_path):
    """Snapshots every 3 versions, a join at 7: it loads the snapshot of v6 and applies v7,
    bit-exact (the dumped state against the trainer's committed bits, with the control)."""
    argv = ["--hidden", "64", "--layers", "1", "--ffn", "128", "--vocab", "256", "--versions", "7",
            "--repeats", "1", "--patterns", "independent", "--timeout-s", "120", "--out", str(tmp_path),
            "--snapshot-every", "3"]
    assert bench.main(argv) == 0
    out = json.loads((tmp_path / "join.json").read_text())
    (row,) = out["rows"]
    assert out["snapshot_every"] == 3 and row["bootstrap"] == {"from": "snapshot", "version": 6}
    assert row["catchup_mode"] == "none" and row["bit_exact"] is True and row["negative_control_detected"] is True


def test_replot_redraws_from_the_json(bench, tmp_path):
    rows = [{"pattern": p, "versions": n, "start_s": 10.0, "catchup_s": 0.3 * n, "total_s": 10 + 0.3 * n,
             "cpu_s": 8 + 0.2 * n} for p in ("independent", "concentrated") for n in (1, 10)]
    (tmp_path / "join.json").write_text(json.dumps({"params": 1000, "changed_per_version": 0.03, "rows": rows}))
    assert bench.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "join.png").stat().st_size > 0
