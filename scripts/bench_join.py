"""Join time of a fresh receiver at committed version N (issue 18): is it flat in N?

    .venv/bin/python scripts/bench_join.py [--versions 1,10,50 --repeats 3 --changed 0.03 --snapshot-every 20]

A trainer (the real ``RefitSender`` over a transformers Llama's BF16 tensors, context-mode
chunks, signed documents) commits versions 1..N with one in-process hf receiver acking
them, so every version on the store is a genuine signed commit.  With ``--snapshot-every
K`` (default 20, the elastic-membership default of ``refit.snapshot_every``; 0 = none, the
measurement before snapshots) the trainer also writes a committed-version snapshot at every
K-th version (``protocol/snapshot.py``).  At each N of ``--versions`` a fresh receiver joins
the way a user starts one: ``nemo-dcr receive`` as a subprocess (hf runtime, its own state
directory, ``--until-version N``), which loads the newest snapshot <= N (or version 0)
from the store.  It catches up from there to N-1 (replayed, or one composed delta when more
than ``compose_after`` = 4 versions behind: ``receiver/catchup.py``), then applies
version N, whose commit decision it reads.  Timed from the parent, on the receiver's
flushed JSON lines:

* ``start_s``: process start to its ``ready`` line (imports, run record, snapshot or
  version-0 download and check, model load, prewarm): its starting version loaded;
* ``catchup_s``: ``ready`` to the commit of N (chain walk, downloads, decodes, compose,
  apply; the follower's poll interval is 0.01 s);
* ``total_s``: process start to the commit of N.

Each (pattern, N) is joined ``--repeats`` times (medians), plus one more run with
``--dump-dir`` (the dump adds writes, so that run is not in the medians): its weights after
N are compared with the trainer's committed bits through integer views, and the same check
is run on a copy with one bit flipped (negative control, must be detected).

Change patterns (each version XORs low mantissa bits of ``--changed`` of every tensor's
elements, like small Adam steps):

* ``independent``: positions drawn afresh every version, so the composed delta from 0 to N
  changes ``1 - (1 - c)^N`` of the elements;
* ``concentrated``: positions drawn every version from a fixed ``--hot`` subset of each
  tensor, so the composed delta saturates at the hot fraction.

Writes ``benchmarks/results/join.json`` and ``join.png``; prints one row per (pattern, N).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = ("independent", "concentrated")
MODEL_ID = "bench-join"


class BenchError(Exception):
    """Bad arguments (exit status 2) or a join that did not end as expected (1)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what}: not a list of integers: {text!r}", 2) from None
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise BenchError(f"{what}: give distinct integers >= 1, got {text!r}", 2)
    return sorted(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--changed", type=float, default=0.03, help="fraction of each tensor changed per version")
    ap.add_argument("--hot", type=float, default=0.10,
                    help="concentrated pattern: the fixed fraction of each tensor the changes are drawn from")
    ap.add_argument("--versions", default="1,10,50", help="join at these committed versions")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--repeats", type=int, default=3, help="timed joins per (pattern, N); medians reported")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on one join")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-every", type=int, default=None,
                    help="the trainer's refit.snapshot_every (default: its elastic-membership default, 20); "
                         "0 = no snapshots (every joiner starts from version 0)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--name", default="join", help="output files OUT/NAME.json and OUT/NAME.png")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/NAME.png from OUT/NAME.json")
    a = ap.parse_args(argv)
    a.versions = _ints(a.versions, "--versions")
    a.patterns = [p for p in a.patterns.split(",") if p]
    if not a.patterns or set(a.patterns) - set(PATTERNS) or len(set(a.patterns)) != len(a.patterns):
        raise BenchError(f"--patterns: distinct names of {PATTERNS}, got {','.join(a.patterns)!r}", 2)
    if not 0 < a.changed <= a.hot <= 1:
        raise BenchError(f"need 0 < --changed <= --hot <= 1, got {a.changed} and {a.hot}", 2)
    if a.repeats < 1:
        raise BenchError("--repeats must be >= 1", 2)
    if a.hidden % 64:
        raise BenchError("--hidden must be a multiple of 64 (heads of 64)", 2)
    if a.snapshot_every is None:
        from nemo_dcr.sender.options import ELASTIC_SNAPSHOT_EVERY

        a.snapshot_every = ELASTIC_SNAPSHOT_EVERY
    if a.snapshot_every < 0:
        raise BenchError(f"--snapshot-every must be >= 0 (0 = off), got {a.snapshot_every}", 2)
    return a


# ---------------------------------------------------------------- the trainer
def make_model(a: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=max(1, a.hidden // 256), intermediate_size=a.ffn, vocab_size=a.vocab)
    torch.manual_seed(a.seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


class Changes:
    """Per-version changes of every tensor: ``--changed`` of its elements, low mantissa bits
    XORed (1..127), at positions drawn afresh (independent) or from a fixed hot subset."""

    def __init__(self, params: dict[str, torch.Tensor], pattern: str, changed: float, hot: float, seed: int):
        self.rng = np.random.default_rng(seed)
        self.changed = changed
        self.hot: dict[str, np.ndarray | None] = {}
        for name, t in params.items():
            n = t.numel()
            self.hot[name] = (None if pattern == "independent"
                              else np.sort(self.rng.choice(n, max(1, int(n * hot)), replace=False)))

    def step(self, params: dict[str, torch.Tensor]) -> int:
        total = 0
        for name, t in params.items():
            bits = t.view(torch.int16).reshape(-1)
            pool = self.hot[name]
            n = bits.numel() if pool is None else pool.size
            k = min(n, max(1, int(bits.numel() * self.changed)))
            pick = self.rng.choice(n, k, replace=False)
            idx = torch.from_numpy(pick if pool is None else pool[pick])
            bits[idx] ^= torch.from_numpy(self.rng.integers(1, 1 << 7, k).astype(np.int16))
            total += k
        return total


class Trainer:
    """A RefitSender over the model's tensors (one rank, identity layout) and one acking hf
    receiver in this process, on a signed directory store; ``advance(n)`` commits up to n."""

    def __init__(self, a: argparse.Namespace, pattern: str, workdir: str):
        from nemo_dcr.integrations.hf_export import write_checkpoint
        from nemo_dcr.sender import RefitOptions
        from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
        from nemo_dcr.receiver.bootstrap import build_receiver
        from nemo_dcr.receiver.engine import ReceiverConfig
        from nemo_dcr_testbed.flat_sender import flat_sender
        from nemo_dcr.transport.store import LocalDirStore

        os.makedirs(workdir, exist_ok=True)
        self.store_dir = os.path.join(workdir, "store")
        self.key = new_key_file(os.path.join(workdir, "key"))
        sealer = Sealer(load_key(self.key))
        model = make_model(a)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        self.config = model.config.to_dict()
        del model
        self.params = {n: t.clone() for n, t in state.items()}
        cfg = RefitOptions(model_id=MODEL_ID, receivers=("r0",), key_file=self.key, ack_timeout_s=a.timeout_s,
                           ack_poll_s=0.01, pipeline=False, snapshot_every=a.snapshot_every)
        self.store = LocalDirStore(self.store_dir)
        self.sender = flat_sender(self.params, self.store, cfg)
        run_id = self.sender.claim()
        self.sender.set_root(write_checkpoint(self.store, self.config, state, sealer=sealer, run_id=run_id))
        self.numel = sum(t.numel() for t in state.values())
        self.changes = Changes(self.params, pattern, a.changed, a.hot, a.seed + 1)
        self.rx = build_receiver(self.store, sealer, ReceiverConfig(receiver_id="r0", model_id=MODEL_ID, poll_s=0.01),
                                 state_dir=os.path.join(workdir, "r0"))
        self.version = 0
        self.v0 = self.committed_bits()
        self.wire_bytes: list[int] = []
        self.changed: list[int] = []

    def advance(self, n: int) -> None:
        """Commit versions up to ``n``, each acked by the in-process receiver."""
        if n <= self.version:
            return
        error: list[BaseException] = []

        def follow():
            try:
                self.rx.run(until_version=n, timeout_s=300)
            except BaseException as e:  # noqa: BLE001 - raised below
                error.append(e)

        th = threading.Thread(target=follow, daemon=True)
        with contextlib.redirect_stdout(io.StringIO()):  # the acking receiver's event lines
            th.start()
            for v in range(self.version + 1, n + 1):
                self.changed.append(self.changes.step(self.params))
                stats = self.sender.refit(v)
                if not stats.committed:
                    raise BenchError(f"trainer: v{v} was not committed ({stats})")
                self.wire_bytes.append(int(stats.wire_bytes))
            th.join(timeout=300)
        if error:
            raise error[0]
        if self.sender.wait_snapshot() is False:  # the joiners must find the snapshot at N (if any)
            raise BenchError(f"trainer: the snapshot upload before v{n} failed")
        self.version = n

    def committed_bits(self) -> dict[str, torch.Tensor]:
        from nemo_dcr.dtypes import int_view

        return {k: int_view(v).clone() for k, v in self.params.items()}

    def close(self) -> None:
        self.rx.close()


# ---------------------------------------------------------------- one join
@dataclass
class Join:
    """One fresh receiver's join, from the parent's clock on its flushed JSON lines."""

    start_s: float
    catchup_s: float
    total_s: float
    exit_s: float
    cpu_s: float
    """The receiver process's user + system CPU seconds (less sensitive to a shared machine)."""
    bootstrap: dict = field(default_factory=dict)
    """The receiver's ``bootstrap`` line: ``{"from": "init"}`` or ``{"from": "snapshot", "version": S}``."""
    catchup: dict = field(default_factory=dict)
    """The follower's ``caught up`` event (mode, versions, seconds, changed, wire bytes); empty at N = 1."""
    last: dict = field(default_factory=dict)
    """The ack stats of version N (download, decode, apply seconds, changed)."""


def receive_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "nemo-dcr")
    return [exe, "receive"] if os.path.exists(exe) else [sys.executable, "-m", "nemo_dcr.cli", "receive"]


def join_once(store_dir: str, key: str, n: int, rid: str, state_dir: str, timeout_s: float,
              dump_dir: str | None = None) -> Join:
    cmd = [*receive_command(), "--store", store_dir, "--receiver-id", rid, "--model-id", MODEL_ID,
           "--key-file", key, "--state-dir", state_dir, "--until-version", str(n), "--poll-s", "0.01",
           "--timeout-s", str(timeout_s)]
    if dump_dir:
        cmd += ["--dump-dir", dump_dir]
    err_path = os.path.join(state_dir + ".stderr")
    os.makedirs(state_dir, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    ready = committed = None
    catchup, last, boot = {}, {}, {}
    timer = threading.Timer(timeout_s + 60, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            now = time.perf_counter() - t0
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if "bootstrap" in ev:
                boot = ev["bootstrap"]
            elif ev.get("ready"):
                ready = now
                if boot.get("version") == n:  # started from the snapshot of N itself: nothing to decide
                    committed = now
            elif ev.get("event") == "caught up":
                catchup = ev
            elif ev.get("version") == n and "ok" in ev:
                last = ev
            elif ev.get("version") == n and ev.get("decision") == "commit":
                committed = now
        rc = proc.wait()
    finally:
        timer.cancel()
    exit_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0 or ready is None or committed is None:
        with open(err_path) as f:
            tail = f.read()[-2000:]
        raise BenchError(f"join of {rid} at v{n}: exit {rc}, ready={ready}, committed={committed}; stderr: {tail}")
    return Join(start_s=ready, catchup_s=committed - ready, total_s=committed, exit_s=exit_s, cpu_s=cpu_s,
                bootstrap=boot, catchup=catchup, last=last)


# ---------------------------------------------------------------- bit-exactness
def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names of ``want`` whose bits ``got`` does not hold (integer views; dtypes must agree)."""
    from nemo_dcr.dtypes import int_view

    bad = []
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.dtype != torch.bfloat16 or tuple(g.shape) != tuple(w.shape) \
                or not torch.equal(int_view(g), w):
            bad.append(name)
    return bad


def check_dump(path: str, want: dict[str, torch.Tensor]) -> dict:
    """Compare a receiver's dumped state with the trainer's committed bits, then the same
    with one bit flipped in one tensor (must be detected)."""
    from safetensors.torch import load_file

    got = load_file(path)
    bad = mismatches(got, want)
    name = max(want, key=lambda k: want[k].numel())
    flipped = dict(got)
    t = got[name].clone()
    t.view(torch.int16).reshape(-1)[t.numel() // 2] ^= 1
    flipped[name] = t
    control = mismatches(flipped, want)
    return {"bit_exact": not bad, "mismatched": bad[:5], "tensors": len(want),
            "negative_control_detected": control == [name] if not bad else name in control}


# ---------------------------------------------------------------- report
def median(xs):
    return round(statistics.median(xs), 3)


def summarize(pattern: str, n: int, joins: list[Join], check: dict, union_frac: float) -> dict:
    first = joins[0]
    return {
        "pattern": pattern, "versions": n, "repeats": len(joins),
        "start_s": median([j.start_s for j in joins]),
        "catchup_s": median([j.catchup_s for j in joins]),
        "total_s": median([j.total_s for j in joins]),
        "exit_s": median([j.exit_s for j in joins]),
        "cpu_s": median([j.cpu_s for j in joins]),
        "runs": [{k: round(v, 3) for k, v in asdict(j).items() if isinstance(v, float)} for j in joins],
        "bootstrap": first.bootstrap,
        "catchup_mode": first.catchup.get("mode", "none"),
        "catchup_versions": len(first.catchup.get("versions", [])),
        "catchup_event_s": median([j.catchup.get("seconds", 0.0) for j in joins]),
        "composed_changed": first.catchup.get("composed_changed"),
        "catchup_wire_bytes": first.catchup.get("wire_bytes"),
        "last_version_s": {k: median([j.last.get(k, 0.0) for j in joins]) for k in ("download_s", "decode_s",
                                                                                    "apply_s")},
        "union_changed_frac": round(union_frac, 4),
        **check,
    }


def print_table(rows: list[dict]) -> None:
    print("| pattern | N | starts from | start s | catch-up s | total s | receiver CPU s | catch-up mode "
          "| changed 0->N % | total / first N | catch-up / first N | bit-exact | control |", flush=True)
    print("|:--|--:|:--|--:|--:|--:|--:|:--|--:|--:|--:|:-:|:-:|")
    for r in rows:
        boot = r.get("bootstrap", {})
        start = f"snapshot v{boot['version']}" if boot.get("from") == "snapshot" else "v0"
        print(f"| {r['pattern']} | {r['versions']} | {start} | {r['start_s']:.2f} | {r['catchup_s']:.2f} "
              f"| {r['total_s']:.2f} | {r['cpu_s']:.1f} | {r['catchup_mode']} ({r['catchup_versions']}) + 1 "
              f"| {100 * r['union_changed_frac']:.1f} "
              f"| {r['total_vs_first']:.2f}x | {r['catchup_vs_first']:.2f}x | "
              f"{'yes' if r['bit_exact'] else 'NO'} | {'caught' if r['negative_control_detected'] else 'MISSED'} |")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for pattern, marker in zip(PATTERNS, ("o", "s")):
        rs = [r for r in rows if r["pattern"] == pattern]
        if not rs:
            continue
        ns = [r["versions"] for r in rs]
        axes[0].plot(ns, [r["total_s"] for r in rs], marker + "-", label=f"{pattern}: total")
        axes[0].plot(ns, [r["start_s"] for r in rs], marker + ":", label=f"{pattern}: start (snapshot or v0 loaded)")
        axes[1].plot(ns, [r["catchup_s"] for r in rs], marker + "-", label=pattern)
        axes[2].plot(ns, [r["cpu_s"] for r in rs], marker + "-", label=pattern)
    first = [r for r in rows if r["versions"] == rows[0]["versions"]]
    if first:
        goal = 1.5 * statistics.median(r["total_s"] for r in first)
        axes[0].axhline(goal, color="grey", lw=0.8, ls="--", label="1.5x total at first N")
    axes[0].set_ylabel("seconds (median)")
    axes[1].set_ylabel("catch-up seconds (median)")
    axes[2].set_ylabel("receiver process CPU seconds (median)")
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("committed version N at join")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
        return replot(a) if a.replot else run(a)
    except BenchError as e:
        print(f"bench_join: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def title(out: dict) -> str:
    every = out.get("snapshot_every", 0)
    return (f"fresh receiver joining at version N, {out['params'] / 1e6:.0f}M params, "
            f"{out['changed_per_version']:.0%} changed/version, "
            + (f"snapshot every {every} versions" if every else "no snapshots"))


def replot(a: argparse.Namespace) -> int:
    with open(os.path.join(a.out, f"{a.name}.json")) as f:
        out = json.load(f)
    plot(out["rows"], os.path.join(a.out, f"{a.name}.png"), title(out))
    return 0


def run(a: argparse.Namespace) -> int:
    rows = []
    tmp = tempfile.mkdtemp(prefix="dcr-join-")
    numel, wire, load = 0, {}, [os.getloadavg()[0]]
    try:
        for pattern in a.patterns:
            work = os.path.join(tmp, pattern)
            t0 = time.perf_counter()
            trainer = Trainer(a, pattern, work)
            numel = trainer.numel
            try:
                for n in a.versions:
                    trainer.advance(n)
                    print(f"[{pattern}] committed v{n} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                          flush=True)
                    want = trainer.committed_bits()
                    joins = [join_once(trainer.store_dir, trainer.key, n, f"j{n}-{i}",
                                       os.path.join(work, f"j{n}-{i}"), a.timeout_s) for i in range(a.repeats)]
                    dump = os.path.join(work, f"dump{n}")
                    verify = join_once(trainer.store_dir, trainer.key, n, f"j{n}-check", os.path.join(work, f"j{n}-c"),
                                       a.timeout_s, dump_dir=dump)
                    check = check_dump(os.path.join(dump, f"v{n}.safetensors"), want)
                    check["check_run_total_s"] = round(verify.total_s, 3)
                    union = sum(int((want[k] != trainer.v0[k]).sum()) for k in want)
                    rows.append(summarize(pattern, n, joins, check, union / trainer.numel))
                    load.append(os.getloadavg()[0])
                    for d in [os.path.join(work, f"j{n}-{i}") for i in range(a.repeats)] + [dump]:
                        shutil.rmtree(d, ignore_errors=True)
                    print(json.dumps({k: rows[-1][k] for k in ("pattern", "versions", "start_s", "catchup_s",
                                                               "total_s", "bit_exact")}), file=sys.stderr, flush=True)
                wire[pattern] = int(statistics.median(trainer.wire_bytes))
            finally:
                trainer.close()
        for r in rows:
            first = next(x for x in rows if x["pattern"] == r["pattern"])
            r["total_vs_first"] = round(r["total_s"] / first["total_s"], 3)
            r["catchup_vs_first"] = round(r["catchup_s"] / max(first["catchup_s"], 1e-9), 3)
        print_table(rows)
        out = {"params": numel, "hidden": a.hidden, "layers": a.layers, "ffn": a.ffn, "vocab": a.vocab,
               "changed_per_version": a.changed, "hot": a.hot, "versions": a.versions, "repeats": a.repeats,
               "snapshot_every": a.snapshot_every,
               "receiver": "nemo-dcr receive (subprocess, hf runtime, --poll-s 0.01)", "compose_after": 4,
               "goal": "total at max N within 1.5x of total at min N",
               "wire_bytes_per_version_median": wire, "dense_bytes": 2 * numel,
               "loadavg_1min": [round(x, 2) for x in load], "rows": rows}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
            json.dump(out, f, indent=1)
        plot(rows, os.path.join(a.out, f"{a.name}.png"), title(out))
        ok = all(r["bit_exact"] and r["negative_control_detected"] for r in rows)
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
