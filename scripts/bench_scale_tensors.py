"""Refit cost against the number of tensors, at a fixed parameter count: the demo pipeline
(Megatron-Core Qwen3-MoE under torchrun, EP=2 x DP=2 on 2 ranks -> local store -> one
receiver) over models whose expert count grows while the experts shrink, so the canonical
tensor count goes from ~150 to ~37 k with the parameters (~20 M) about fixed.

    .venv/bin/python scripts/bench_scale_tensors.py [--runtimes hf,vllm] [--points 4x8,4x64,12x128,24x256,48x256]
        [--vllm-layers 4,16,48,128] [--changed-lrs 5e-7,2e-6,8e-6] [--changed-point 12x128] [--steps 5]
        [--out-dir benchmarks/results] [--refit-from FILE] [hydra overrides ...]

A point ``LxE`` (the ``hf`` runtime) is a model of L layers with E experts each; every expert
is ``3 x hidden(64) x F`` with ``L * E * F`` held at 48*256*8 (the expert parameters are
fixed).  Canonical (Hugging Face) tensors: 3 per expert plus 9 per layer plus 3
(embeddings, final norm, head).  The ``vllm`` runtime takes dense Llama only (``VLLM_BASE``
says why), so its sweep grows the layers of a small dense Llama (``--vllm-layers``; 9 tensors
per layer, parameters growing with them: the fit separates the two).  ``--changed-lrs``
adds a sweep of the learning rate (and so of the changed fraction) at one point.

Per version (the first is left out: it carries the receiver's start) the trainer's row
gives diff / project / encode / upload / publish, the refit wall ``refit_s`` (end of the
optimizer step's hook to the joint decision), its changed elements, chunk and record
counts; the receiver's ack gives download / decode / apply and the manifest's bytes.
The timed runs leave ``refit.verify_dense`` off: its trainer-side dense gather of version N+1
runs while version N is still being encoded and applied, and at 37 k tensors took 6-8 s of the
two cores (``reference_s``).  ``--verify`` turns it on (every version compared bit for bit with
the trainer's dense export: ``bit_exact``; ``wall_s`` is then ``refit_s`` less the receiver's
comparison, ``verify_s``, but still carries the contention).  ``--refit-from FILE`` recomputes the medians, fits
and plot of a saved run without running it again.
Peak RSS of the trainer ranks and of the receiver (its process tree) are sampled every
0.25 s.

Fit, per runtime, by least squares over every measured version:
``wall = a + b * tensors + c * changed``; ``per_tensor_share`` of a case is
``b * tensors / wall`` at its median.  The manifest part: synthetic signed manifests of
1 k .. 70 k chunks (a 1T version at 3 % changed and 4 MiB chunks has about 70 k) opened
with the receiver's bounded parser and key, median of 3 -- its bytes and seconds per chunk.

Writes ``<out-dir>/scale_tensors.{json,png}``; a table on stdout, progress on stderr.  Stage
times are wall-clock on a 2-core VM; the load average at the start is in ``meta``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
HIDDEN = 64
EXPERT_UNITS = 48 * 256 * 8  # L * E * F, fixed
COMMON = ["model.vocab_size=1000", "refit.coding=plain"]
BASE = ["model.family=qwen3_moe", f"model.hidden_size={HIDDEN}", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.moe_router_topk=2",
        "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2",
        "parallel.expert_model_parallel_size=2", *COMMON]
# The vLLM receiver runs dense llama only (testbed config: vLLM's CPU build prepacks and pads
# MoE expert weights, CPUUnquantizedExperts, which its adapter does not re-derive yet; its
# attention takes head_dim 32+): its tensor count grows with layers, 9 per layer.
VLLM_BASE = ["model.family=llama", "model.hidden_size=128", "model.num_attention_heads=4",
             "model.num_query_groups=2", "model.ffn_hidden_size=128", "parallel.tensor_model_parallel_size=2",
             *COMMON]
MANIFEST_CHUNKS = (1_000, 10_000, 70_000)


def _say(msg: str) -> None:
    print(f"[bench_scale_tensors] {msg}", file=sys.stderr, flush=True)


def parse_point(text: str) -> tuple[int, int]:
    try:
        layers, experts = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bench_scale_tensors: a point is LAYERSxEXPERTS (e.g. 12x128), got {text!r}") from None
    if layers < 1 or experts < 2 or EXPERT_UNITS % (layers * experts):
        raise SystemExit(f"bench_scale_tensors: {text}: layers*experts must divide {EXPERT_UNITS} (experts >= 2)")
    return layers, experts


def canonical_tensors(layers: int, experts: int) -> int:
    """HF tensors of the test model: Qwen3-MoE, per layer 2 norms, q/k/v/o, q/k norms, router
    (9) and 3 per expert; dense llama (``experts`` 0), 2 norms, q/k/v/o, gate/up/down (9);
    plus embeddings, final norm and head."""
    return layers * (9 + 3 * experts) + 3


class RssSampler:
    """Peak RSS of this process's descendants, by role (from the command line)."""

    def __init__(self, period_s: float = 0.25):
        self.period_s = period_s
        self.peak = {"trainer": 0, "receiver": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.period_s):
            now = {"trainer": 0, "receiver": 0}
            try:
                procs = me.children(recursive=True)
            except psutil.Error:
                continue
            for p in procs:
                try:
                    cmd = " ".join(p.cmdline())
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                if "run_trainer" in cmd:
                    now["trainer"] = max(now["trainer"], rss)  # per rank
                elif "receiver" in cmd or "vllm" in cmd or "EngineCore" in cmd:
                    now["receiver"] += rss  # the receiver and its engine processes
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)


def wall_of(refit_s: float, verify_s: float) -> float:
    """The refit's wall without the receiver's dense comparison (inside the commit wait: it
    runs before the ack).  The trainer's dense gather (``reference_s``) runs before the
    refit's clock starts; the put of the reference (one local file) stays inside."""
    return refit_s - verify_s


def run_case(runtime: str, layers: int, experts: int, lr: float, steps: int, overrides: list[str],
             verify: bool = False) -> dict:
    from nemo_dcr_testbed.config import load_demo_config
    from nemo_dcr_testbed.demo import run

    if experts:
        ffn = EXPERT_UNITS // (layers * experts)
        model = [*BASE, f"model.num_moe_experts={experts}", f"model.moe_ffn_hidden_size={ffn}"]
    else:
        ffn, model = 0, list(VLLM_BASE)
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        cfg = load_demo_config([f"run_dir={tmp}/run", f"steps={steps}", f"train.lr={lr}", *model,
                                f"model.num_layers={layers}", f"receiver.runtime={runtime}",
                                f"refit.verify_dense={str(verify).lower()}", *overrides])
        t0 = time.perf_counter()
        with RssSampler() as rss:
            summary = run(cfg)
        with open(os.path.join(tmp, "run", "steps.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    versions = []
    for r in rows:
        stats = [a["stats"] for a in r["acks"]]
        verify_s = max((s.get("verify_s", 0.0) for s in stats), default=0.0)
        calls = [s.get("requests", {}).get("calls", {}) for s in stats]
        versions.append({
            "version": r["version"], "changed": r["changed"], "canonical_numel": r["canonical_numel"],
            "chunks": r["chunks"], "wire_bytes": r["wire_bytes"], "coding": r["coding"],
            "records": r.get("records"),
            "refit_s": r["refit_s"], "reference_s": r.get("reference_s", 0.0), "verify_s": verify_s,
            "wall_s": wall_of(r["refit_s"], verify_s),
            **{k: r[k] for k in ("diff_s", "project_s", "encode_s", "upload_s", "publish_s", "commit_wait_s",
                                 "pause_s")},
            **{k: max((s.get(k, 0.0) for s in stats), default=0.0) for k in ("download_s", "decode_s", "apply_s")},
            "manifest_bytes": max((c.get("get:manifest", {}).get("bytes", 0) for c in calls), default=0),
            "bit_exact": (all(s.get("bit_exact") is True for s in stats) and bool(stats)) if verify else None,
        })
    steady = versions[1:] or versions
    med = {k: statistics.median(v[k] for v in steady)
           for k in ("wall_s", "refit_s", "diff_s", "project_s", "encode_s", "upload_s", "download_s", "decode_s",
                     "apply_s", "changed", "chunks", "wire_bytes", "manifest_bytes")}
    return {"runtime": runtime, "layers": layers, "experts": experts, "moe_ffn": ffn, "lr": lr,
            "tensors": canonical_tensors(layers, experts), "params": rows[0]["canonical_numel"] if rows else 0,
            "bit_exact": (summary["bit_exact"] == len(rows) == steps and all(v["bit_exact"] for v in versions))
            if verify else None, "verified": verify,
            "run_s": round(time.perf_counter() - t0, 1), "trainer_peak_rss": rss.peak["trainer"],
            "receiver_peak_rss": rss.peak["receiver"], "median": med, "versions": versions}


def fit(cases: list[dict]) -> dict:
    """wall = a + b * tensors + c * changed over every steady version of the cases."""
    import numpy as np

    xs, ys = [], []
    for c in cases:
        for v in c["versions"][1:]:
            xs.append([1.0, c["tensors"], v["changed"]])
            ys.append(v["wall_s"])
    if len(xs) < 3:
        return {}
    coef, *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    pred = np.array(xs) @ coef
    resid = np.array(ys) - pred
    r2 = 1 - float(resid @ resid) / max(float(((np.array(ys) - np.mean(ys)) ** 2).sum()), 1e-12)
    return {"a_s": float(coef[0]), "b_s_per_tensor": float(coef[1]), "c_s_per_changed": float(coef[2]),
            "r2": r2, "n": len(ys)}


def stage_fits(cases: list[dict]) -> dict:
    """Per stage: seconds per tensor, a line through the tensor sweep's medians."""
    import numpy as np

    out = {}
    pts = [c for c in cases if c["sweep"] == "tensors"]
    if len(pts) < 2:
        return out
    t = np.array([c["tensors"] for c in pts], dtype=float)
    for k in ("diff_s", "project_s", "encode_s", "upload_s", "download_s", "decode_s", "apply_s", "wall_s"):
        y = np.array([c["median"][k] for c in pts])
        slope, icpt = np.polyfit(t, y, 1)
        out[k] = {"per_tensor_us": float(slope) * 1e6, "intercept_s": float(icpt)}
    return out


def manifest_parse() -> list[dict]:
    """Seconds to open a signed manifest of N chunks with the receiver's reader and key."""
    from nemo_dcr.protocol.manifest import ChunkRef, Manifest
    from nemo_dcr.protocol.signing import Sealer
    from nemo_dcr.protocol.keys import chunk_key

    sealer = Sealer(os.urandom(32))
    out = []
    for n in MANIFEST_CHUNKS:
        refs = tuple(ChunkRef(key=chunk_key(7, i % 512, i // 512), nbytes=4 << 20, digest="sha256:" + "ab" * 32,
                              rank=i % 512, tensors=3, changed=100_000) for i in range(n))
        m = Manifest(run_id="0" * 32, model_id="m", version=7, base_version=6, base_digest="sha256:" + "cd" * 32,
                     chunks=refs)
        data = m.to_json(sealer)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            back = Manifest.from_json(data, sealer)
            times.append(time.perf_counter() - t)
        assert len(back.chunks) == n
        out.append({"chunks": n, "bytes": len(data), "parse_s": statistics.median(times),
                    "bytes_per_chunk": len(data) / n, "parse_us_per_chunk": statistics.median(times) / n * 1e6})
        _say(f"manifest of {n} chunks: {len(data):,} B, opened in {statistics.median(times):.3f} s")
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, rt in enumerate(out["meta"]["runtimes"]):
        pts = sorted((c for c in out["cases"] if c["runtime"] == rt and c["sweep"] == "tensors"),
                     key=lambda c: c["tensors"])
        if not pts:
            continue
        t = [c["tensors"] for c in pts]
        axes[0].plot(t, [c["median"]["wall_s"] for c in pts], "o-", color=f"C{i}", label=f"{rt}: wall")
        f = out["fits"].get(rt) or {}
        if f:
            axes[0].plot(t, [f["a_s"] + f["b_s_per_tensor"] * c["tensors"] + f["c_s_per_changed"] * c["median"]["changed"]
                             for c in pts], "--", color=f"C{i}", label=f"{rt}: fit")
        if i == 0:
            bottom = [0.0] * len(pts)
            for j, k in enumerate(("diff_s", "project_s", "encode_s", "download_s", "decode_s", "apply_s")):
                y = [c["median"][k] for c in pts]
                axes[1].bar([str(x) for x in t], y, bottom=bottom, color=f"C{j}", label=k[:-2])
                bottom = [b + v for b, v in zip(bottom, y)]
            axes[1].set(title=f"stages ({rt}), median per version", xlabel="canonical tensors", ylabel="s")
            axes[1].legend(fontsize=7)
    axes[0].set(xscale="log", xlabel="canonical tensors (parameters fixed)", ylabel="s per version",
                title="refit wall vs tensor count")
    axes[0].legend(fontsize=7)
    m = out["manifest"]
    axes[2].plot([x["chunks"] for x in m], [x["parse_s"] for x in m], "o-")
    axes[2].set(xscale="log", yscale="log", xlabel="chunks in the manifest", ylabel="s to open (signed)",
                title="manifest open time")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtimes", default="hf,vllm")
    ap.add_argument("--points", default="4x8,4x64,12x128,24x256,48x256",
                    help="LAYERSxEXPERTS of the qwen3_moe sweep (the hf runtime)")
    ap.add_argument("--vllm-layers", default="4,16,48,128",
                    help="layers of the dense llama sweep (the vllm runtime: see VLLM_BASE)")
    ap.add_argument("--changed-runtimes", default="hf", help="runtimes of the changed-fraction sweep")
    ap.add_argument("--changed-lrs", default="5e-7,2e-6,8e-6", help="learning rates of the changed-fraction sweep")
    ap.add_argument("--changed-point", default="12x128")
    ap.add_argument("--lr", type=float, default=2e-6, help="learning rate of the tensor sweep")
    ap.add_argument("--steps", type=int, default=5, help="refits per case (the first is warm-up)")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for the demo config")
    ap.add_argument("--refit-from", default=None, help="a saved scale_tensors.json: recompute, do not run")
    ap.add_argument("--verify", action="store_true",
                    help="refit.verify_dense on: every version compared bit for bit with the trainer's dense export "
                         "(the dense gathers then compete with the refit for the cores: walls are not comparable)")
    ap.add_argument("--out-name", default="scale_tensors", help="<out-dir>/<out-name>.{json,png}")
    args = ap.parse_args(argv)
    if args.refit_from:
        with open(args.refit_from) as f:
            out = json.load(f)
        for c in out["cases"]:
            for v in c["versions"]:
                v["wall_s"] = wall_of(v["refit_s"], v["verify_s"])
            steady = c["versions"][1:] or c["versions"]
            c["median"]["wall_s"] = statistics.median(v["wall_s"] for v in steady)
        return finish(out, args.out_dir, args.out_name)
    runtimes = [r for r in args.runtimes.split(",") if r]
    points = [parse_point(p) for p in args.points.split(",") if p]
    lrs = [float(x) for x in args.changed_lrs.split(",") if x]
    if args.steps < 3:
        raise SystemExit("bench_scale_tensors: --steps must be >= 3 (the first refit is warm-up)")
    out = {"meta": {"runtimes": runtimes, "points": args.points, "steps": args.steps, "lr": args.lr,
                    "verify_dense": args.verify,
                    "changed_lrs": lrs, "changed_point": args.changed_point, "base": BASE,
                    "overrides": args.overrides, "loadavg_start": os.getloadavg(), "hidden": HIDDEN,
                    "expert_units": EXPERT_UNITS, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "cases": []}
    try:
        from nemo_dcr_testbed.linkbench import git_state

        out["meta"]["git"] = git_state(ROOT)
    except Exception as e:  # noqa: BLE001 - provenance only
        out["meta"]["git"] = f"unknown ({e})"
    out["manifest"] = manifest_parse()
    vllm_layers = [int(x) for x in args.vllm_layers.split(",") if x]
    plan = [(rt, p, args.lr, "tensors") for rt in runtimes for p in (points if rt == "hf" else
                                                                      [(n, 0) for n in vllm_layers])]
    cl, ce = parse_point(args.changed_point)
    plan += [(rt, (cl, ce), lr, "changed") for rt in args.changed_runtimes.split(",") if rt in runtimes
             for lr in lrs if lr != args.lr or (cl, ce) not in points]
    for n, (rt, (layers, experts), lr, sweep) in enumerate(plan, 1):
        _say(f"case {n}/{len(plan)}: {rt}, {layers} layers x {experts} experts "
             f"({canonical_tensors(layers, experts)} tensors), lr {lr:g}")
        case = run_case(rt, layers, experts, lr, args.steps, args.overrides, verify=args.verify)
        case["sweep"] = sweep
        out["cases"].append(case)
        m = case["median"]
        _say(f"  wall {m['wall_s']:.2f} s (diff {m['diff_s']:.2f} project {m['project_s']:.2f} encode "
             f"{m['encode_s']:.2f} download {m['download_s']:.2f} decode {m['decode_s']:.2f} apply {m['apply_s']:.2f}), "
             f"changed {m['changed']:.0f}, bit_exact {case['bit_exact']}, rss trainer "
             f"{case['trainer_peak_rss'] / 2**30:.2f} GiB receiver {case['receiver_peak_rss'] / 2**30:.2f} GiB")
    return finish(out, args.out_dir, args.out_name)


def finish(out: dict, out_dir: str, name: str = "scale_tensors") -> int:
    """Fits, the JSON, the plot and the table of a run's cases."""
    runtimes = out["meta"]["runtimes"]
    out["fits"] = {rt: fit([c for c in out["cases"] if c["runtime"] == rt]) for rt in runtimes}
    out["stage_fits"] = {rt: stage_fits([c for c in out["cases"] if c["runtime"] == rt]) for rt in runtimes}
    for c in out["cases"]:
        f = out["fits"].get(c["runtime"]) or {}
        c["wall_s"] = c["median"]["wall_s"]
        c["per_tensor_share"] = (f["b_s_per_tensor"] * c["tensors"] / c["wall_s"]) if f and c["wall_s"] > 0 else None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)
    plot(out, os.path.join(out_dir, f"{name}.png"))
    print("| runtime | sweep | layers x experts | tensors | changed | chunks | wall s | diff | project | encode "
          "| download | decode | apply | per-tensor share | bit-exact |")
    print("|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|:--|")
    for c in out["cases"]:
        m = c["median"]
        share = f"{100 * c['per_tensor_share']:.0f}%" if c["per_tensor_share"] is not None else "-"
        print(f"| {c['runtime']} | {c['sweep']} | {c['layers']}x{c['experts']} | {c['tensors']:,} | {m['changed']:,.0f} "
              f"| {m['chunks']:.0f} | {m['wall_s']:.2f} | {m['diff_s']:.2f} | {m['project_s']:.2f} | {m['encode_s']:.2f} "
              f"| {m['download_s']:.2f} | {m['decode_s']:.2f} | {m['apply_s']:.2f} | {share} | {c['bit_exact']} |")
    for rt, f in out["fits"].items():
        if f:
            print(f"fit {rt}: wall = {f['a_s']:.3f} s + {f['b_s_per_tensor'] * 1e6:.1f} us x tensors + "
                  f"{f['c_s_per_changed'] * 1e9:.1f} ns x changed (R^2 {f['r2']:.3f}, {f['n']} versions)")
    print(f"wrote {path} and {name}.png")
    return 0 if all(c["bit_exact"] is not False for c in out["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
