"""Generation pause per refit of a ``vllm serve`` engine: nemo_dcr's backend against vLLM's dense path.

    .venv/bin/python scripts/bench_vllm_serve.py [--versions 5 --changed 0.03 --layers 8 --hidden 512 --vocab 32000]

Two engines of one configuration run side by side on loopback (``vllm serve`` through
``nemo_dcr_testbed.vllm_serve``, one core each: ``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1):

* **nemo_dcr**: the ``nemo_dcr`` weight-transfer backend, driven by the product's
  controller (``runtimes/vllm/controller.py``): wait until the version is staged (fetched,
  verified, decoded, validated while the engine serves), ``/pause?mode=keep``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``;
* **dense**: a stock engine (no backend) refit with vLLM's own dense path,
  ``/pause?mode=keep``, ``/collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` (vLLM's in-place layerwise reload of a checkpoint directory, the
  version's full safetensors already on local disk and read once before, so page-cached:
  its download is not counted), ``/resume``.

Versions come from a signed run of a Llama (``TinyRun``: a ``RefitSender`` over the
model's own BF16 tensors, ``--changed`` of every tensor's elements changed per version,
one receiver, the backend engine).  Per version: ``pause_s`` for each engine (``/pause``
sent to ``/resume`` answered), the backend's ``staged_s`` (publish to staged) and
``update_s``, the wire bytes, and ``pause_ratio`` = nemo_dcr pause / dense pause.  After
every version both engines must agree: greedy generations with top-5 logprobs on two
prompts, and ``/weight_checker`` checksums of every parameter the stock engine keeps plain
(``bit_exact``).  Medians over the versions.  Writes ``benchmarks/results/vllm_serve.json``
and ``vllm_serve.png``.
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
PROMPTS = [[1, 2, 3, 4], [17, 99, 5]]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--changed", type=float, default=0.03, help="fraction of every tensor's elements changed per version")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "vllm_serve.json"))
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    return ap.parse_args(argv)


def _bit_exact(a_url: str, b_url: str) -> tuple[bool, list[str]]:
    from nemo_dcr.runtimes.vllm.controller import ServerClient
    from nemo_dcr_testbed.vllm_serve import differing, differing_generations

    bad = differing(ServerClient(a_url).checksums(), ServerClient(b_url).checksums())
    bad += differing_generations(a_url, b_url, PROMPTS, 16)
    return not bad, bad


def main(argv=None) -> int:
    a = parse_args(argv)

    from nemo_dcr.runtimes.vllm.controller import Controller, ServerClient
    from nemo_dcr_testbed.vllm_serve import TinyRun, dense_reload, start_server

    work = a.workdir or tempfile.mkdtemp(prefix="bench-vllm-serve-")
    load = os.getloadavg()
    t0 = time.perf_counter()
    run = TinyRun(os.path.join(work, "run"), layers=a.layers, hidden=a.hidden, vocab=a.vocab, ack_timeout_s=300.0)
    numel = sum(t.numel() for t in run.params.values())
    print(f"model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}: {numel / 1e6:.1f} M params "
          f"({2 * numel / 1e6:.0f} MB BF16); load average before: {load[0]:.2f}", flush=True)
    servers = {}

    def start(name, **kw):
        servers[name] = start_server(run.init_dir, os.path.join(work, f"{name}.log"), max_model_len=256, **kw)

    threads = [threading.Thread(target=start, args=("nemo_dcr",), kwargs={"cpu": "0"}),
               threading.Thread(target=start, args=("dense",), kwargs={"cpu": "1", "backend": False})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if set(servers) != {"nemo_dcr", "dense"}:
            raise SystemExit("bench_vllm_serve: a server did not start (see the logs in " + work + ")")
        print(f"servers up in {time.perf_counter() - t0:.0f}s", flush=True)
        ours, dense = servers["nemo_dcr"], servers["dense"]
        status = os.path.join(work, "status.json")
        ctl = Controller([ServerClient(ours.url, status_path=status)], run_id=run.run_id)
        ctl.init([run.init_info("e0", status)])
        rows = []
        print(f"{'v':>3} {'changed':>8} {'wire MB':>8} {'staged s':>9} {'stage s':>8} {'dcr pause s':>12} {'update s':>9} {'write s':>8} {'dense pause s':>14} "
              f"{'ratio':>6} {'bit-exact':>9}", flush=True)
        for v in range(1, a.versions + 1):
            run.step(a.changed)
            publish = run.publish()
            (result,) = ctl.refit(v)
            publish.join()
            stats = publish.stats
            path = run.dense_dir(f"dense-v{v}")
            for name in os.listdir(path):  # read once: the dense path's download is not counted
                with open(os.path.join(path, name), "rb") as f:
                    while f.read(1 << 24):
                        pass
            t_pause = time.perf_counter()
            dense_reload(dense.url, path)
            dense_pause = time.perf_counter() - t_pause
            exact, bad = _bit_exact(ours.url, dense.url)
            row = {"version": v, "committed": stats.committed, "changed": stats.changed, "numel": stats.numel,
                   "wire_bytes": stats.wire_bytes, "dense_bytes": stats.dense_bytes, "coding": stats.coding,
                   "staged_s": round(result.staged_s, 4), "stage_s": result.status.get("stage_s"), "pause_s": round(result.pause_s, 4),
                   "update_s": round(result.update_s, 4), "write_s": result.status.get("write_s"), "dense_pause_s": round(dense_pause, 4),
                   "pause_ratio": round(result.pause_s / dense_pause, 4), "bit_exact": exact, "mismatches": bad[:5]}
            rows.append(row)
            print(f"{v:>3} {100 * stats.changed / stats.numel:>7.2f}% {stats.wire_bytes / 1e6:>8.2f} "
                  f"{row['staged_s']:>9.3f} {row['stage_s'] or 0:>8.3f} {row['pause_s']:>12.3f} {row['update_s']:>9.3f} {row['write_s'] or 0:>8.3f} {dense_pause:>14.3f} {row['pause_ratio']:>6.3f} "
                  f"{'yes' if exact else 'NO'!s:>9}", flush=True)
        med = {k: round(statistics.median(r[k] for r in rows), 4)
               for k in ("staged_s", "stage_s", "pause_s", "update_s", "write_s", "dense_pause_s", "pause_ratio")}
        out = {"command": "scripts/bench_vllm_serve.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "model": {"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "numel": numel},
               "changed": a.changed, "versions": a.versions, "load_average_before": round(load[0], 2),
               "load_average_after": round(os.getloadavg()[0], 2), "rows": rows, "median": med,
               "all_committed": all(r["committed"] for r in rows), "all_bit_exact": all(r["bit_exact"] for r in rows)}
        print(f"median: staged {med['staged_s']:.3f}s, pause nemo_dcr {med['pause_s']:.3f}s vs dense "
              f"{med['dense_pause_s']:.3f}s: ratio {med['pause_ratio']:.3f}; all bit-exact: {out['all_bit_exact']}",
              flush=True)
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        _plot(out, os.path.splitext(a.out)[0] + ".png")
        return 0 if out["all_committed"] and out["all_bit_exact"] else 1
    finally:
        for s in servers.values():
            s.stop()
        if a.workdir is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    xs = [r["version"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [r["pause_s"] for r in rows], w, label="nemo_dcr backend (staged, in place)")
    ax.bar([x + w / 2 for x in xs], [r["dense_pause_s"] for r in rows], w, label="vLLM dense reload_weights")
    ax.set_xlabel("version")
    ax.set_ylabel("generation pause per refit (s)")
    m = out["model"]
    ax.set_title(f"vllm serve, {m['numel'] / 1e6:.0f} M params, {100 * out['changed']:.0f}% changed: "
                 f"median ratio {out['median']['pause_ratio']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
