"""The trainer's pause with the refit off, synchronous and pipelined, over a rate-limited
link and unshaped (issue 18).

    sudo .venv/bin/python scripts/bench_pipeline.py [--links 50,unshaped] [--steps 3]
        [--lr 2.4e-6] [--micro-batches 1] [--model link|small|tiny] [--out-dir benchmarks/results]
        [hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml ...]

Needs root (network namespace, ``tc``); refuses to run otherwise.  The topology is
``scripts/bench_refit_link.py``'s (its ``Link``, imported): the store (moto_server, S3 API)
in a network namespace behind a veth pair shaped with htb on both ends, the trainer ranks
(TP=2 under torchrun) and the receiver (transformers, ``link_refit receiver``) in the root
namespace.  ``unshaped`` leaves the link at ``--setup-mbit`` (10 Gbit/s by default), far
above what moto_server serves on one machine: the link is then not what limits a refit.

The store, the receiver and the trainer start once.  For each link, the trainer runs three
phases back to back (``testbed/nemo_dcr_testbed/pipeline_bench.py``): ``off`` (no refit), ``sync``
(``refit.pipeline=false``) and ``pipelined`` (``refit.pipeline=true``, then
``hook.finish()``), each ``--steps`` timed steps after one lead-in step (not in the
medians: the first step of a phase pays the switch, e.g. the sync lead-in carries every
change of the ``off`` phase, and the first pipelined step has nothing to settle).  The
link is reshaped only between phases, when nothing is in flight.  After each link's phases
a dense refit at ``--setup-mbit`` checks the receiver's delta-refit model bit for bit
against the trainer's last committed version (every delta of the run applied on the way;
a one-bit negative control on the first check).

Per step: ``step_s`` = wall of ``train_step()`` (forward/backward, optimizer step and the
refit hook; steps run back to back, so this is the step-to-step time), ``pause_s`` = wall
of the refit hook call on the slowest rank (0 with the refit off), and the published
version's ``diff_s + project_s`` (each the slowest rank's).  Writes
``<out-dir>/pipeline.{json,png}``; prints a table on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from nemo_dcr_testbed.linkbench import BenchError, check_prerequisites, execute_run, fresh_run_dir, git_state, progress, run_cli
from nemo_dcr_testbed.linkbench import read_rows as _read_rows
from nemo_dcr_testbed.linkbench import sh as _sh
from nemo_dcr_testbed.linkbench import write_json_atomic as _write_json_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BUCKET = "pipeline-bench"
MODES = ("off", "sync", "pipelined")
GOAL = 1.5
"""Issue 18: pipelined pause <= GOAL x (diff + projection) where the link is slow."""


def _link_bench():
    """``scripts/bench_refit_link.py`` as a module (its ``Link``, ``Run`` plumbing, probe)."""
    name = "bench_refit_link"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", "bench_refit_link.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


MODELS = {
    "link": None,  # bench_refit_link's MODEL: 155.7 M canonical parameters, 311 MB BF16
    "small": ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8",
              "model.num_query_groups=4", "model.ffn_hidden_size=1408", "model.vocab_size=8000"],
    "tiny": ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "model.num_query_groups=2",
             "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=16"],
}


def _progress(msg: str) -> None:
    progress("bench_pipeline", msg)


# ------------------------------------------------------------------------- arguments
def parse_links(text: str) -> list[float | None]:
    """``50,unshaped`` -> ``[50.0, None]`` (None: the link left at --setup-mbit)."""
    out: list[float | None] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok == "unshaped":
            out.append(None)
            continue
        try:
            v = float(tok)
        except ValueError:
            raise BenchError(f"--links: {tok!r} is neither a rate in Mbit/s nor 'unshaped'", 2) from None
        if not v > 0:
            raise BenchError(f"--links: rates must be positive, got {tok!r}", 2)
        out.append(v)
    if not out or len(set(out)) != len(out):
        raise BenchError(f"--links must list distinct links, got {text!r}", 2)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="50,unshaped", help="link rates in Mbit/s (each direction) or 'unshaped'")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per phase (after one lead-in step)")
    ap.add_argument("--lr", type=float, default=2.4e-6, help="learning rate (~3%% of BF16 elements change per "
                    "step on the link model)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="train.num_microbatches: the compute per step (on CPU one BF16 micro-batch of the link "
                         "model already takes tens of seconds)")
    ap.add_argument("--model", choices=sorted(MODELS), default="link")
    ap.add_argument("--setup-mbit", type=float, default=10000.0,
                    help="link rate for version 0, the verification and 'unshaped'")
    ap.add_argument("--probe-mib", type=int, default=8, help="size of the link probe at each shaped rate (MiB)")
    ap.add_argument("--step-timeout-s", type=float, default=900.0, help="limit on any one phase")
    ap.add_argument("--out-dir", default=RESULTS, help="where pipeline.json / .png go")
    ap.add_argument("--run-dir", default=None, help="logs and phase rows (default runs/pipeline/<date-time>)")
    ap.add_argument("--summarize-run", default=None, metavar="RUN_DIR[,RUN_DIR...]",
                    help="run nothing: write the results of the phases the runs in RUN_DIR finished")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml")
    args = ap.parse_args(argv)
    args.links = parse_links(args.links)
    if args.steps < 1 or args.micro_batches < 1 or not args.lr > 0:
        raise BenchError("--steps and --micro-batches must be >= 1 and --lr positive", 2)
    return args


# --------------------------------------------------------------------------- results
def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def case_entry(row: dict, link_mbit: float | None) -> dict:
    """One (link, mode) case from the trainer's phase row: medians over the timed steps
    (the lead-in step is kept in ``steps`` with ``timed: false``)."""
    mode = row["mode"]
    steps = []
    for i, s in enumerate(row["steps"]):
        st = s["stats"]
        dp = st["diff_s"] + st["project_s"] if st else None
        steps.append({"step": s["step"], "timed": i > 0, "version": s["version"], "step_s": s["step_s"],
                      "pause_s": s["pause_s"], "diff_project_s": dp,
                      "pause_over_diff_project": s["pause_s"] / dp if dp else None,
                      "step_s_ranks": s["step_s_ranks"], "pause_s_ranks": s["pause_s_ranks"],
                      "loss": s["loss"], "stats": st})
    timed = [s for s in steps if s["timed"]]
    refits = [s["stats"] for s in timed if s["stats"]]
    case = {
        "mode": mode, "link_mbit": link_mbit, "steps_n": len(timed),
        "pause_s": _med([s["pause_s"] for s in timed]),
        "step_s": _med([s["step_s"] for s in timed]),
        "diff_project_s": _med([s["diff_project_s"] for s in timed]),
        "pause_over_diff_project": _med([s["pause_over_diff_project"] for s in timed]),
        "refit_s": _med([r["refit_s"] for r in refits]),
        "stats_pause_s": _med([r["pause_s"] for r in refits]),
        "encode_s": _med([r["encode_s"] for r in refits]), "upload_s": _med([r["upload_s"] for r in refits]),
        "wire_bytes": _med([r["wire_bytes"] for r in refits]),
        "changed_pct": (100 * sum(r["changed"] for r in refits) / sum(r["numel"] for r in refits)) if refits else None,
        "committed": f"{sum(bool(r['committed']) for r in refits)}/{len(refits)}" if mode != "off" else None,
        "finish_s": row["finish_s"], "steps": steps,
    }
    if mode == "pipelined":
        case["goal_met"] = (case["pause_over_diff_project"] is not None
                            and case["pause_over_diff_project"] <= GOAL)
    return case


def link_label(mbit: float | None) -> str:
    return "unshaped" if mbit is None else f"{mbit:g} Mbit/s"


def print_table(cases: list[dict]) -> None:
    cols = [("link", 10), ("mode", 9), ("steps", 5), ("step s", 7), ("pause s", 7), ("diff+proj s", 11),
            ("pause/(d+p)", 11), ("refit s", 7), ("wire B", 10), ("changed %", 9), ("committed", 9)]
    print(" ".join(n.rjust(w) for n, w in cols), flush=True)
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    for c in cases:
        cells = [link_label(c["link_mbit"]), c["mode"], str(c["steps_n"]), f(c["step_s"], ".2f"),
                 f(c["pause_s"], ".2f"), f(c["diff_project_s"], ".2f"), f(c["pause_over_diff_project"], ".2f"),
                 f(c["refit_s"], ".2f"), f(c["wire_bytes"], ".0f"), f(c["changed_pct"], ".2f"), c["committed"] or "-"]
        print(" ".join(v.rjust(w) for v, (_, w) in zip(cells, cols)), flush=True)


def plot(cases: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(link_label(c["link_mbit"]) for c in cases))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.26
    for j, mode in enumerate(MODES):
        mine = {link_label(c["link_mbit"]): c for c in cases if c["mode"] == mode}
        xs = [i + (j - 1) * width for i in range(len(links))]
        for ax, key in zip(axes, ("step_s", "pause_s")):
            pts = [(x, mine[lk][key] or 0.0) for x, lk in zip(xs, links) if lk in mine]  # a case not run: no bar
            ax.bar([x for x, _ in pts], [v for _, v in pts], width, color=f"C{j}", label=mode)
            for x, v in pts:
                ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
    for i, lk in enumerate(links):
        dp = [c["diff_project_s"] for c in cases if link_label(c["link_mbit"]) == lk and c["mode"] == "pipelined"]
        if dp and dp[0]:
            axes[1].plot([i - 1.5 * width, i + 1.5 * width], [GOAL * dp[0]] * 2, "k--", lw=1,
                         label=f"{GOAL:g} x (diff + projection), pipelined" if i == 0 else None)
    for ax, title in zip(axes, ("step time (median, s)", "trainer pause: refit hook wall, slowest rank (median, s)")):
        ax.set_xticks(range(len(links)), links)
        ax.set(title=title, ylabel="seconds")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------- the run
def _run_class():
    """``bench_refit_link.Run`` (process tracking, cleanup, the link) with this benchmark's
    sequence of phases."""
    lb = _link_bench()

    class Run(lb.Run):
        def _wait_rows(self, path: str, n: int, what: str) -> list[dict]:
            t0 = time.monotonic()
            while True:
                rows = _read_rows(path)
                if len(rows) >= n:
                    return rows
                self._check_alive()
                self.children.refresh()
                if time.monotonic() - t0 > self.args.step_timeout_s:
                    raise BenchError(f"{what} not finished after {self.args.step_timeout_s:g}s -- logs in "
                                     f"{self.run_dir}")
                time.sleep(0.2)

        def execute(self) -> dict:
            args, cfg = self.args, self.cfg
            from nemo_dcr.protocol.signing import KEY_ENV, new_key_file

            t_start = time.monotonic()
            self.link.up(args.setup_mbit)
            _progress(f"link: {self.link.host_if} {self.link.host_addr} (root) <-> {self.link.ns_if} "
                      f"{self.link.ns_addr} (namespace {self.link.ns}), htb both directions")
            endpoint = f"http://{self.link.ns_addr}:{lb.S3_PORT}"
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                               "NO_PROXY": self.link.ns_addr, "no_proxy": self.link.ns_addr})
            moto_exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
            self.moto = self._start("moto", [*self.link.exec_prefix(), moto_exe, "-H", self.link.ns_addr,
                                             "-p", str(lb.S3_PORT)], dict(os.environ))
            lb._wait_port(self.link.ns_addr, lb.S3_PORT, self.moto)
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
            from nemo_dcr.transport.store import open_store

            probe_store = open_store(f"s3://{BUCKET}/linkprobe")
            probes = []
            for mbit in [m for m in args.links if m is not None]:
                self.link.set_rate(mbit)
                probes.append(lb.measure_link(probe_store, mbit, args.probe_mib << 20))
                _progress(f"link probe at {mbit:g} Mbit/s: put {probes[-1]['put_mbit']} Mbit/s, "
                          f"get {probes[-1]['get_mbit']} Mbit/s through S3")
            self.link.set_rate(args.setup_mbit)

            cfg_path = os.path.join(self.run_dir, "config.json")
            with open(cfg_path, "w") as f:
                json.dump(cfg.to_dict(), f, indent=1)
            key_path = os.path.join(self.run_dir, "refit.key")
            new_key_file(key_path)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEY_ENV: key_path})
            go_dir = os.path.join(self.run_dir, "go")
            os.makedirs(go_dir)
            self._start("trainer", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={cfg.parallel.world_size}", "-m",
                                    "nemo_dcr_testbed.pipeline_bench", "--config", cfg_path, "--dir", self.run_dir,
                                    "--driver-pid", str(os.getpid())], env)
            rdirs = {}
            for rid in cfg.refit.receivers:
                rdirs[rid] = os.path.join(self.run_dir, f"receiver-{rid}")
                os.makedirs(rdirs[rid])
                self._start(f"receiver-{rid}", [sys.executable, "-m", "nemo_dcr_testbed.link_refit", "receiver",
                                                "--store", cfg.store.uri, "--receiver-id", rid,
                                                "--model-id", cfg.refit.model_id, "--dir", rdirs[rid],
                                                "--timeout-s", str(args.step_timeout_s),
                                                "--driver-pid", str(os.getpid())], env)
            _progress(f"trainer ({cfg.parallel.world_size} ranks) and {len(rdirs)} receiver(s) starting; "
                      f"logs in {self.run_dir}")
            deadline = time.monotonic() + args.step_timeout_s
            while not all(os.path.exists(os.path.join(d, "ready")) for d in rdirs.values()):
                self._check_alive()
                self.children.refresh()
                if time.monotonic() > deadline:
                    raise BenchError(f"receivers not ready after {args.step_timeout_s:g}s (version 0 not loaded)")
                time.sleep(0.2)
            _progress(f"version 0 written and loaded ({time.monotonic() - t_start:.0f}s)")

            plan = []
            for mbit in args.links:
                plan += [{"kind": "run", "mode": m, "steps": args.steps + 1, "lr": args.lr, "link_mbit": mbit}
                         for m in MODES]
                plan.append({"kind": "verify", "link_mbit": mbit})
            path = os.path.join(self.run_dir, "phases.jsonl")
            rows: list[dict] = []
            for n, p in enumerate(plan):
                rate = args.setup_mbit if p["kind"] == "verify" or p["link_mbit"] is None else p["link_mbit"]
                self.link.set_rate(rate)
                _write_json_atomic(os.path.join(go_dir, f"{n}.json"), p)
                what = f"phase {n + 1}/{len(plan)} ({p['kind']} {p.get('mode', '')} {link_label(p['link_mbit'])})"
                rows = self._wait_rows(path, n + 1, what)
                r = rows[n]
                if r["kind"] == "verify":
                    v = r["dense"]["verify"]
                    ok = all(x["bit_exact"] for x in v)
                    _progress(f"{what}: version {r['version']} bit-exact {'yes' if ok else 'NO'} "
                              f"({', '.join(x['summary'] for x in v)}), {time.monotonic() - t_start:.0f}s elapsed")
                    if not ok:
                        raise BenchError(f"version {r['version']} is not bit-exact at the receivers: {v} -- logs in "
                                         f"{self.run_dir}")
                else:
                    c = case_entry(r, p["link_mbit"])
                    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                    _progress(f"{what}: step {fmt(c['step_s'])}s, pause {fmt(c['pause_s'])}s, diff+proj "
                              f"{fmt(c['diff_project_s'])}s, committed {c['committed']}, "
                              f"{time.monotonic() - t_start:.0f}s elapsed")
                    if c["committed"] is not None and not all(s["stats"] and s["stats"]["committed"]
                                                              for s in c["steps"]):
                        raise BenchError(f"{what}: a version was not committed -- logs in {self.run_dir}")
            _write_json_atomic(os.path.join(go_dir, f"{len(plan)}.json"), {"kind": "stop"})
            self._stop_all(rdirs, "phase")
            return {"rows": rows, "plan": plan, "probes": probes, "wall_s": time.monotonic() - t_start}

    return Run


def _main(args) -> int:
    check_prerequisites()
    run_dir = fresh_run_dir(args.run_dir, os.path.join(ROOT, "runs", "pipeline", time.strftime("%Y%m%d-%H%M%S")))

    from nemo_dcr_testbed.config import describe_config_error, load_demo_config

    lb = _link_bench()
    model = lb.MODEL if MODELS[args.model] is None else MODELS[args.model]
    try:
        cfg = load_demo_config([*model, f"run_dir={run_dir}", f"store.uri=s3://{BUCKET}/run", "steps=1",
                                "refit.model_id=pipeline-bench", "refit.verify_dense=false", "refit.ack_timeout_s=900",
                                f"train.num_microbatches={args.micro_batches}", *args.overrides])
    except Exception as e:  # noqa: BLE001 - a configuration error is the user's: one line
        raise BenchError(f"invalid configuration: {describe_config_error(e)}", 2) from None
    if cfg.receiver.runtime != "hf" or cfg.refit.verify_dense:
        raise BenchError("this benchmark runs the transformers receiver (receiver.runtime=hf) and does its own "
                         "dense verification (refit.verify_dense=false)", 2)
    os.makedirs(run_dir, exist_ok=True)
    stale = lb.remove_stale_links()
    if stale:
        _progress(f"removed namespaces left by killed runs: {', '.join(stale)}")

    load0 = os.getloadavg()
    git = git_state(ROOT)
    run = _run_class()(args, cfg, run_dir)
    out = execute_run(run)
    link = {"namespace": run.link.ns, "host_if": run.link.host_if, "ns_if": run.link.ns_if,
            "host_addr": run.link.host_addr, "ns_addr": run.link.ns_addr}
    return write_results(args, cfg, out, {"git": git, "loadavg_start": load0, "link": link, "run_dir": run_dir})


def summarize_run(args) -> int:
    """``--summarize-run DIR[,DIR...]``: the results of runs from their directories (config,
    go/ plans, phases.jsonl) -- the phases each finished, e.g. of a run stopped before its
    last phase -- as one set of cases, in the order given (same model and settings)."""
    from nemo_dcr_testbed.config import DemoConfig

    run_dirs = [os.path.abspath(d) for d in args.summarize_run.split(",") if d.strip()]
    rows, plan, cfgs = [], [], []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "config.json")) as f:
            raw = json.load(f)
        cfgs.append({k: raw[k] for k in ("model", "train", "parallel")})
        mine = [{**r, "run_dir": run_dir} for r in _read_rows(os.path.join(run_dir, "phases.jsonl"))]
        if not any(r["kind"] == "run" for r in mine):
            raise BenchError(f"{run_dir}: no finished phase in phases.jsonl", 2)
        for n in range(len(mine)):
            with open(os.path.join(run_dir, "go", f"{n}.json")) as f:
                plan.append(json.load(f))
        rows += mine
    if any(c != cfgs[0] for c in cfgs):
        raise BenchError("--summarize-run: the runs differ in model, train or parallel settings", 2)
    with open(os.path.join(run_dirs[0], "config.json")) as f:
        cfg = DemoConfig.from_dict(json.load(f))
    args.lr = next(p["lr"] for p in plan if p["kind"] == "run")
    args.steps = next(p["steps"] for p in plan if p["kind"] == "run") - 1
    out = {"rows": rows, "plan": plan, "probes": None, "wall_s": None}
    return write_results(args, cfg, out, {"git": git_state(ROOT), "loadavg_start": None, "link": None,
                                          "run_dir": run_dirs, "summarized_from_run_dir": True})


def write_results(args, cfg, out: dict, extra: dict) -> int:
    """``pipeline.{json,png}`` and the table, from the phase rows of a run."""
    load0 = extra["loadavg_start"]
    cases, verification = [], []
    for p, row in zip(out["plan"], out["rows"]):
        if row["kind"] == "run":
            cases.append(case_entry(row, p["link_mbit"]))
            if "run_dir" in row:  # --summarize-run: which run a case comes from (the plot shows the last)
                cases[-1]["run_dir"] = row["run_dir"]
        else:
            verification.append({"link_mbit": p["link_mbit"], "version": row["version"], "run_dir": row.get("run_dir"),
                                 "bit_exact": all(v["bit_exact"] for v in row["dense"]["verify"]),
                                 "receivers": [{k: v.get(k) for k in ("receiver", "bit_exact", "compared", "summary",
                                                                      "negative_control")}
                                               for v in row["dense"]["verify"]]})
    numel = next(r["canonical_numel"] for r in out["rows"] if r["kind"] == "run")
    result = {
        "meta": {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "git": extra["git"],
            "summarized_from_run_dir": extra.get("summarized_from_run_dir", False),
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load0 and [round(x, 2) for x in load0],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "topology": "scripts/bench_refit_link.py's: moto_server in a network namespace behind a veth pair "
                        "shaped with htb on both ends; trainer (TP=2, gloo on lo) and receiver in the root namespace",
            "link": extra["link"],
            "link_probe": out["probes"],
            "unshaped_means": f"link_mbit null: htb left at --setup-mbit={args.setup_mbit:g} Mbit/s",
            "model": {**cfg.to_dict()["model"], "canonical_params": numel},
            "train": {"micro_batch_size": cfg.train.micro_batch_size, "num_microbatches": cfg.train.num_microbatches,
                      "lr": args.lr},
            "tp": cfg.parallel.tensor_model_parallel_size, "receivers": cfg.refit.receivers,
            "upload_workers": cfg.refit.upload_workers, "chunk_bytes": cfg.refit.chunk_bytes,
            "timed_steps_per_case": args.steps, "lead_in_steps_per_case": 1, "overrides": args.overrides,
            "wall_s": out["wall_s"] and round(out["wall_s"], 1), "run_dir": extra["run_dir"], "goal": f"pipelined pause_s <= {GOAL:g} x "
                                                                          "diff_project_s where the link is slow",
            "verification": {
                "bit_exact": f"{sum(v['bit_exact'] for v in verification)}/{len(verification)}",
                "how": "after each link's three phases, a dense refit of the last committed version: the receiver "
                       "loads it into a second model and compares its delta-refit model with it, every parameter "
                       "and buffer as integer views (compare_modules); the first comparison also flips one bit "
                       "of the dense model and must see it (negative control)",
                "negative_control": [r["negative_control"] for v in verification for r in v["receivers"]
                                     if r.get("negative_control")],
                "checks": verification,
            },
            "definitions": {
                "step_s": "wall of train_step() on the slowest rank: forward/backward over the micro-batches, "
                          "optimizer step and the refit hook; steps run back to back",
                "pause_s": "wall of the refit hook call on the slowest rank (0 with the refit off); pipelined: "
                           "settle the previous version (waiting if its decision is not there yet) + diff + "
                           "projection of this one",
                "diff_project_s": "the published version's diff_s + project_s (PublishStats, each the slowest rank's)",
                "pause_over_diff_project": "median over the timed steps of pause_s / diff_project_s of the same step",
                "refit_s": "PublishStats.refit_s: diff start -> decision (rank 0)",
                "stats_pause_s": "PublishStats.pause_s as the sender reports it",
                "medians": "over the timed steps; each case's first step is a lead-in (steps[*].timed false)",
            },
        },
        "cases": cases,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "pipeline.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(cases)
    plot(cases, os.path.join(args.out_dir, "pipeline.png"))
    _progress(f"wrote {json_path} and pipeline.png" + (f" ({out['wall_s']:.0f}s)" if out["wall_s"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        args = parse_args(argv)
        return summarize_run(args) if args.summarize_run else _main(args)

    return run_cli("bench_pipeline", body)


if __name__ == "__main__":
    sys.exit(main())
