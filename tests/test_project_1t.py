"""scripts/project_1t.py on synthetic result files: the stage model and which stage dominates."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def p1t():
    spec = importlib.util.spec_from_file_location("project_1t", os.path.join(ROOT, "scripts", "project_1t.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["project_1t"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _codec_row(pct: float, b: float, enc: float, dec: float) -> dict:
    changed = 1000
    fmts = {"nemo_dcr context": {"bytes_per_changed": b, "encode_gbps": enc, "decode_gbps": dec},
            "gap16+xor+zstd1": {"bytes_per_changed": 2 * b, "encode_gbps": 10 * enc, "decode_gbps": 10 * dec}}
    return {"pair": f"synthetic_{pct}", "changed_pct": pct, "changed": changed, "formats": fmts}


def write_results(d, *, dec: float = 10.0, gpu: bool = False) -> None:
    """Rates chosen so that, at the test's link speeds, the upload is the slowest stage."""
    d.mkdir(exist_ok=True)
    codec = {"rows": [_codec_row(1.0, 1.5, 10.0, dec), _codec_row(3.2, 0.7, 10.0, dec)]}
    (d / "codec.json").write_text(json.dumps(codec))
    xor = {"rows": [{"rate": r, "method": "C xor_diff, 1 thr", "median_gbps": 5.0, "best_gbps": 6.0}
                    for r in (0.005, 0.03, 0.1)]}
    (d / "bench_xor.json").write_text(json.dumps(xor))
    (d / "vllm_apply.json").write_text(json.dumps({"checkpoint_bytes": 20e9, "changed_pct": 3.0,
                                                   "runs": [{"tp": 1, "apply_s_median": 1.0}]}))
    if gpu:
        rows = [{"gib": 4.0, "rate": 0.03, "tile": t, "changed": 1000, "param_gbps": g, "to_host_s": 1e-6}
                for t, g in ((1024, 900.0), (4096, 1000.0))]
        (d / "bench_xor_gpu.json").write_text(json.dumps({"meta": {"device": "synthetic"}, "rows": rows}))


def run(p1t, tmp_path, *extra: str) -> dict:
    out = tmp_path / "out"
    args = ["--results", str(tmp_path / "res"), "--out", str(out), "--trainer-uplink-gbps", "1"]
    assert p1t.main(args + list(extra)) == 0
    assert (out / "project_1t.png").stat().st_size > 0
    return json.loads((out / "project_1t.json").read_text())


def test_dominating_stage_follows_the_slowest_rate(p1t, tmp_path):
    write_results(tmp_path / "res")
    res = run(p1t, tmp_path)
    assert res["projections"]["s3"]["dominating"] == "upload"
    assert res["projections"]["relay"]["dominating"] == "upload to root"

    write_results(tmp_path / "res", dec=1e-3)  # a tiny decode rate in codec.json, read at run time
    res = run(p1t, tmp_path)
    assert res["projections"]["s3"]["dominating"] == "decode + apply"
    assert res["projections"]["relay"]["dominating"] == "decode + apply"

    write_results(tmp_path / "res")
    res = run(p1t, tmp_path, "--encode-gbps", "1e-4")  # a tiny rate from the command line
    assert res["projections"]["s3"]["dominating"] == "encode"
    assert res["rates"]["encode"]["source"].startswith("--encode-gbps")

    res = run(p1t, tmp_path, "--fanout", "64", "--receiver-downlink-gbps", "0.01")  # thin relay links
    assert res["projections"]["relay"]["dominating"] == "relay hop 1"


def test_wall_is_slowest_stage_plus_fill(p1t, tmp_path):
    write_results(tmp_path / "res")
    for s3 in (run(p1t, tmp_path)["projections"]["s3"],
               run(p1t, tmp_path, "--chunk-bytes", str(1 << 50))["projections"]["s3"]):
        t = [s["seconds"] for s in s3["stages"]]
        assert s3["wall_s"] == pytest.approx(max(t) + (sum(t) - max(t)) / s3["waves"])
    assert s3["waves"] == 1 and s3["wall_s"] == pytest.approx(sum(t))  # one chunk per rank: no overlap


def test_rates_come_from_the_nearest_change_rate(p1t, tmp_path):
    write_results(tmp_path / "res")
    res = run(p1t, tmp_path, "--changed", "0.01")
    assert res["rates"]["bytes_per_changed"]["value"] == 1.5
    res = run(p1t, tmp_path)  # 3% is nearest the 3.2% row
    assert res["rates"]["bytes_per_changed"]["value"] == 0.7
    assert res["projections"]["s3"]["wire_bytes"] == pytest.approx(0.7 * 0.03 * 1e12)
    assert res["rates"]["apply"]["value"] == pytest.approx(10.0)  # 20 GB / 1 s / 2 cores
    gap16 = next(f for f in res["formats"] if f["format"] == "gap16+xor+zstd1")
    assert gap16["bytes_per_changed"] == 1.4


def test_gpu_rate_is_measured_or_labelled_an_assumption(p1t, tmp_path):
    write_results(tmp_path / "res")
    res = run(p1t, tmp_path)
    assert res["rates"]["diff_gpu"]["assumed"] and "ASSUMPTION" in res["rates"]["diff_gpu"]["source"]
    write_results(tmp_path / "res", gpu=True)
    res = run(p1t, tmp_path)
    assert not res["rates"]["diff_gpu"]["assumed"] and res["rates"]["diff_gpu"]["value"] == 1000.0
    assert res["rates"]["d2h"]["value"] == pytest.approx(1000 * 10 / 1e-6 / 1e9)


def test_missing_or_wrong_inputs_exit_2(p1t, tmp_path):
    (tmp_path / "res").mkdir()
    assert p1t.main(["--results", str(tmp_path / "res"), "--out", str(tmp_path / "out")]) == 2
    write_results(tmp_path / "res")
    assert p1t.main(["--results", str(tmp_path / "res"), "--out", str(tmp_path / "out"),
                     "--format", "no such format"]) == 2
    assert p1t.main(["--results", str(tmp_path / "res"), "--out", str(tmp_path / "out"), "--changed", "0"]) == 2


@pytest.mark.parametrize("receivers,fanout,levels", [(1, 4, 1), (5, 4, 2), (6, 4, 3), (16, 4, 3), (21, 4, 3),
                                                     (22, 4, 4), (3, 1, 3)])
def test_tree_levels(p1t, receivers, fanout, levels):
    assert p1t.tree_levels(receivers, fanout) == levels


def _relay_link(d, *, efficiency: float, hop_gbps: float, fixed_s: float) -> None:
    """relay_link.json's "hops" as scripts/bench_relay_link.py writes it."""
    hops = {"probe_small_bytes": 4096, "probe_chunk_bytes": 1 << 20, "chunk_bytes": 1 << 20,
            "link": [{"link_mbit": 50.0, "goodput_mbit": 50 * efficiency, "efficiency": efficiency}],
            "link_efficiency": efficiency, "relay_hop_fixed_s": fixed_s, "relay_hop_chunk_s": 0.01,
            "relay_hop_goodput_gbps": hop_gbps, "relay_hop_samples": 4}
    (d / "relay_link.json").write_text(json.dumps({"cases": [], "hops": hops}))


def test_relay_rows_use_the_measured_hop_rates(p1t, tmp_path):
    write_results(tmp_path / "res")
    plain = run(p1t, tmp_path)
    for name in ("link_efficiency", "relay_hop", "relay_latency"):  # no relay_link.json: link arithmetic only
        assert plain["rates"][name]["assumed"] and "ASSUMPTION" in plain["rates"][name]["source"]
    assert plain["projections"]["relay"]["latency_s"] == 0

    _relay_link(tmp_path / "res", efficiency=0.5, hop_gbps=0.002, fixed_s=0.25)
    res = run(p1t, tmp_path)
    assert res["rates"]["relay_hop"]["source"].startswith("relay_link.json")
    assert not res["rates"]["link_efficiency"]["assumed"]
    relay, s3 = res["projections"]["relay"], res["projections"]["s3"]
    W, dep = relay["wire_bytes"], res["deployment"]
    up = next(s for s in relay["stages"] if s["name"] == "upload to root")
    assert up["seconds"] == pytest.approx(W / (0.5 * 1e9))  # the 1 GB/s uplink at half its rate
    hop = next(s for s in relay["stages"] if s["name"] == "relay hop 1")
    # 4 nodes x 2 MB/s forwarding is below 4 x 12.5 GB/s x 0.5: the relays cap the hop
    assert hop["seconds"] == pytest.approx(W * dep["fanout"] / (dep["receiver_nodes"] * 0.002e9))
    assert hop["equation"] == "W f / (n_r r_relay)" and relay["dominating"] == "relay hop 1"
    assert relay["latency_s"] == pytest.approx(relay["tree_levels"] * 0.25)
    t = [s["seconds"] for s in relay["stages"]]
    assert relay["wall_s"] == pytest.approx(max(t) + (sum(t) - max(t)) / relay["waves"] + relay["latency_s"])
    s3_up = next(s for s in s3["stages"] if s["name"] == "upload")
    assert s3_up["seconds"] == pytest.approx(W / (0.5 * 1e9))  # the measured link share applies to the store too
    assert all(a == b for a, b in zip(s3["stages"][:3], plain["projections"]["s3"]["stages"][:3]))  # trainer stages

    _relay_link(tmp_path / "res", efficiency=0.9, hop_gbps=1000.0, fixed_s=0.0)  # a fast relay: the links cap
    hop = next(s for s in run(p1t, tmp_path)["projections"]["relay"]["stages"] if s["name"] == "relay hop 1")
    assert hop["equation"] == "W f / (e n_r B_down)"
    res = run(p1t, tmp_path, "--relay-hop-gbps", "0.001", "--link-efficiency", "1")  # overrides win
    assert res["rates"]["relay_hop"]["source"].startswith("--relay-hop-gbps")
    assert p1t.main(["--results", str(tmp_path / "res"), "--out", str(tmp_path / "out"),
                     "--link-efficiency", "1.5"]) == 2


def _scale_tensors(d, *, trainer_us: float, receiver_us: float, a_s: float) -> None:
    fits = {k: {"per_tensor_us": trainer_us / 3, "intercept_s": 0.0} for k in ("diff_s", "project_s", "encode_s")}
    fits.update({k: {"per_tensor_us": receiver_us / 3, "intercept_s": 0.0}
                 for k in ("download_s", "decode_s", "apply_s")})
    (d / "scale_tensors.json").write_text(json.dumps({
        "stage_fits": {"hf": fits},
        "fits": {"hf": {"a_s": a_s, "b_s_per_tensor": 1e-6, "c_s_per_changed": 1e-9, "r2": 0.9, "n": 9}}}))


def test_per_tensor_and_per_version_costs_come_from_scale_tensors(p1t, tmp_path):
    """Per-tensor stages: T x slope (trainer: x 2 sweep ranks, over G ranks; receiver: over
    its nodes); the fitted intercept is a fixed latency.  Without the file they are 0 and
    labelled assumptions; with a huge receiver slope that stage dominates."""
    write_results(tmp_path / "res")
    base = run(p1t, tmp_path, "--tensors", "70000")
    assert base["rates"]["per_tensor_receiver"]["assumed"] is True
    _scale_tensors(tmp_path / "res", trainer_us=30.0, receiver_us=60.0, a_s=1.5)
    res = run(p1t, tmp_path, "--tensors", "70000", "--trainer-gpus", "100", "--receiver-nodes", "4")
    s3 = {s["name"]: s["seconds"] for s in res["projections"]["s3"]["stages"]}
    assert s3["per-tensor (trainer)"] == pytest.approx(70000 * 30e-6 * 2 / 100)
    assert s3["per-tensor (receiver)"] == pytest.approx(70000 * 60e-6 / 4)
    assert res["projections"]["s3"]["latency_s"] == pytest.approx(1.5)
    _scale_tensors(tmp_path / "res", trainer_us=30.0, receiver_us=6e6, a_s=0.0)
    res = run(p1t, tmp_path, "--tensors", "70000")
    assert res["projections"]["relay"]["dominating"] == "per-tensor (receiver)"


def _scale_tree(d, *, wall_s: float) -> None:
    meta = {"receivers": 4, "fanouts": [2, 2], "fanout": None, "chunk_bytes": 1 << 20, "machine": {"cpus": 2},
            "model": {"family": "llama", "num_layers": 4, "canonical_params": 20_000_000}}
    case = {"topology": "relay", "link_mbit": 8.0, "changed_pct": 3.0, "wall_s": wall_s, "wire_bytes": 0.7 * 0.03 * 20e6}
    cases = [case, dict(case, topology="store"), dict(case, relay_killed={"name": "r1"})]
    (d / "scale_tree.json").write_text(json.dumps({"meta": meta, "cases": cases}))


def test_measured_check_projects_each_tree_case_with_its_own_inputs(p1t, tmp_path):
    """One machine: the CPU stages of every process add up on its cores; the link is the
    case's rate (relay: the root's reads; store: every receiver's, so the store's egress).
    The relay-kill case is not projected.  A wall far from the model is reported as such."""
    write_results(tmp_path / "res")
    _scale_tree(tmp_path / "res", wall_s=1.0)
    res = run(p1t, tmp_path)
    check = res["measured_check"]
    assert [c["topology"] for c in check["cases"]] == ["relay", "store"]
    relay, store = check["cases"]
    assert relay["deployment"]["shared_cores"] == 2 and relay["deployment"]["fanouts"] == "2,2"
    assert "CPU (2 shared cores)" in relay["stages"] and "relay hop 2" in relay["stages"]
    assert "relay hop 3" not in relay["stages"]
    wire = 0.7 * 0.03 * 20e6  # bytes per changed x changed elements
    assert relay["stages"]["upload to root"] == pytest.approx(wire / (1e6 * 1.0), rel=1e-6)  # 8 Mbit/s = 1 MB/s
    assert store["deployment"]["s3_egress_gbps"] == pytest.approx(0.001)
    assert relay["projected_over_measured"] == pytest.approx(relay["projected_wall_s"] / 1.0)
    _scale_tree(tmp_path / "res", wall_s=1e4)  # negative control: a wall the model cannot explain
    assert run(p1t, tmp_path)["measured_check"]["within_20pct"] is False
