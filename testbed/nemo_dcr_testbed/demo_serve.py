"""The demo's ``receiver.runtime=vllm_serve``: rollout engines as users run them.

Instead of ``nemo-dcr receive`` processes, each receiver id is a ``vllm serve`` engine started
from the run's version 0 with the ``nemo_dcr`` weight-transfer backend (TP from
``receiver.tensor_parallel_size``), driven over vLLM's RL routes by the product's controller
(``nemo_dcr.runtimes.vllm.controller``) on a thread beside the demo's loop: for every version
the trainer publishes, wait until each engine staged it, start one long completion per engine,
then ``refit`` (pause keep, update, finish with ``"<run_id>:<N>"``, resume).

Checked per version:

* *spans*: each in-flight completion's ``weight_versions`` spans end with the new version and
  start with the version before it (contiguous, covering every token);
* *checksums* (with ``refit.verify_dense``): a stock engine of the same TP size (no backend),
  started from version 0 beside them, is refit densely from the trainer's dense export of the
  version with vLLM's own ``reload_weights``; every engine's ``/weight_checker`` checksums must
  equal its checksums for every parameter the stock engine keeps plain (integer-view equality,
  worker by worker), and greedy generations with top-5 logprobs on two prompts must be equal
  (they run the packed kernels, which checksums cannot see); control: the stock engine's
  checksums from before its reload (the previous version) must differ from each engine's.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

PROMPTS = ([1, 2, 3, 4, 5], [7, 42, 11])


@dataclass
class VersionCheck:
    version: int
    ok: bool = False
    pause_s: float = 0.0
    staged_s: float | None = None
    spans_ok: bool = False
    checksums_equal: bool | None = None
    error: str = ""
    mismatches: list[str] = field(default_factory=list)


class ServeFleet:
    """The engines of ``receiver.runtime=vllm_serve`` and the thread that refits them."""

    def __init__(self, cfg, *, init_dir: str, reads_from: list[str], key_path: str, run_dir: str, popen,
                 store, say) -> None:
        self.cfg = cfg
        self.init_dir = init_dir
        self.reads_from = reads_from
        self.key_path = key_path
        self.run_dir = run_dir
        self.popen = popen  # (cmd, log, env) -> Popen, the demo's tracked children
        self.store = store
        self.say = say
        self.servers = []
        self.reference = None
        self.ctl = None
        self.checks: list[VersionCheck] = []
        self.failure = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.long = cfg.model.seq_length - len(PROMPTS[0])
        """Tokens of the completion kept in flight across each refit (the model's whole context)."""

    # ------------------------------------------------------------ engines
    def start(self) -> None:
        from nemo_dcr.protocol.run import read_run
        from nemo_dcr.protocol.signing import Sealer, load_key
        from nemo_dcr.runtimes.vllm.controller import Controller, ServerClient
        from nemo_dcr_testbed.vllm_serve import start_server

        cfg = self.cfg
        tp = cfg.receiver.tensor_parallel_size
        # no "Loading safetensors checkpoint shards" bars in the engines' logs (vllm-serve-*.log)
        extra = ["--no-use-tqdm-on-load", *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]
        cpu = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)) if tp > 1 else None
        kw = dict(max_model_len=cfg.model.seq_length, cpu=cpu, extra=extra, popen=self.popen)
        t0 = time.perf_counter()
        for rid in cfg.refit.receivers:
            self.servers.append(start_server(self.init_dir, os.path.join(self.run_dir, f"vllm-serve-{rid}.log"), **kw))
        if cfg.refit.verify_dense:
            self.reference = start_server(self.init_dir, os.path.join(self.run_dir, "vllm-serve-reference.log"),
                                          backend=False, **kw)
        run_id = read_run(self.store, Sealer(load_key(self.key_path))).run_id
        clients = [ServerClient(s.url, status_path=os.path.join(self.run_dir, f"status-{rid}.json"))
                   for s, rid in zip(self.servers, cfg.refit.receivers)]
        self.ctl = Controller(clients, run_id=run_id)
        self.ctl.init([{"store": store_uri, "receiver_id": rid, "model_id": cfg.refit.model_id,
                        "key_file": self.key_path, "status_path": c.status_path,
                        "update_timeout_s": float(cfg.refit.ack_timeout_s)}
                       for rid, store_uri, c in zip(cfg.refit.receivers, self.reads_from, clients)])
        ref = " and a stock reference engine" if self.reference else ""
        self.say(f"vllm_serve: {len(self.servers)} engine(s) (TP={tp}){ref} serving version 0 with the nemo_dcr "
                 f"backend ({time.perf_counter() - t0:.1f}s)")

    def follow(self, trainer_running) -> None:
        """Refit versions 1..steps on a thread as the trainer publishes them."""
        self._thread = threading.Thread(target=self._loop, args=(trainer_running,), daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._stop.set()
                self._thread.join(30)

    def _loop(self, trainer_running) -> None:
        label = "default"  # vLLM's weight version before the first finish_weight_update
        try:
            for v in range(1, self.cfg.steps + 1):
                if not self._wait_staged(v, trainer_running):
                    self.failure = f"v{v} was never staged by every engine"
                    return
                check = self._refit(v, label)
                self.checks.append(check)
                if check.ok:
                    label = f"{self.ctl.run_id}:{v}"
                self._report(check)
        except Exception as e:  # noqa: BLE001 - reported by the demo as one line
            self.failure = f"{type(e).__name__}: {' '.join(str(e).split())}"

    def _wait_staged(self, version: int, trainer_running) -> bool:
        """Every engine staged its way to ``version`` (the controller's rule, ``staged_for``)."""
        while not self._stop.is_set():
            sts = [c.status() for c in self.ctl.servers]
            if all(c.staged_for(version, st) for c, st in zip(self.ctl.servers, sts)):
                return True
            if not trainer_running() and not any(st.get("fetching") == version for st in sts):
                time.sleep(2.0)  # the last version's documents may still be in flight
                return all(c.staged_for(version) for c in self.ctl.servers)
            time.sleep(0.01)
        return False

    def _refit(self, version: int, label: str) -> VersionCheck:
        from nemo_dcr.runtimes.vllm.controller import RefitFailed
        from nemo_dcr_testbed.vllm_serve import InFlight

        check = VersionCheck(version)
        flights = [InFlight(s.url, list(PROMPTS[0]), self.long) for s in self.servers]
        for f in flights:
            f.started.wait(60)
        try:
            results = self.ctl.refit(version)
        except RefitFailed as e:
            check.error = str(e)
            for f in flights:
                f.join()
            return check
        check.ok = True
        check.pause_s = max(r.pause_s for r in results)
        check.staged_s = max((r.staged_s or 0.0) for r in results)
        want = f"{self.ctl.run_id}:{version}"
        spans_ok = True
        for f in flights:
            spans = f.join()["weight_versions"] or []
            names = [s["version"] for s in spans]
            covered = bool(spans) and spans[0]["start"] == 0 and spans[-1]["end"] == self.long and all(
                a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
            # the completion started on the version before; it ends on this one (it may have
            # finished on the old one if it outran the pause: then one span, the old version)
            spans_ok &= covered and names[0] == label and names[-1] in (want, label) and len(names) <= 2
        check.spans_ok = spans_ok
        if self.reference is not None:
            check.checksums_equal, check.mismatches = self._compare(version)
        return check

    def _compare(self, version: int) -> tuple[bool, list[str]]:
        from nemo_dcr.protocol.keys import dense_key
        from nemo_dcr.runtimes.vllm.controller import ServerClient
        from nemo_dcr_testbed.vllm_serve import EMPTY, dense_reload, differing, differing_generations

        ref = self.reference
        # the comparison's own control: the reference still at the version before must differ
        # from every engine at this one (a comparison that sees no difference proves nothing)
        before = ServerClient(ref.url).checksums()
        d = tempfile.mkdtemp(prefix=f"dcr-dense-v{version}-", dir=self.run_dir)
        try:
            shutil.copy(os.path.join(self.init_dir, "config.json"), os.path.join(d, "config.json"))
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(self.store.get(dense_key(version)))
            dense_reload(ref.url, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        want = ServerClient(ref.url).checksums()
        bad: list[str] = []
        for s, rid in zip(self.servers, self.cfg.refit.receivers):
            got = ServerClient(s.url).checksums()
            bad += [f"{rid}/{k}" for k in differing(got, want)]
            if all(got.get(k) == before[k] for k in before if before[k] != EMPTY):
                bad.append(f"{rid}: control failed (the reference one version earlier has the same checksums)")
            bad += [f"{rid}/{g}" for g in differing_generations(s.url, ref.url, PROMPTS, 12)]
        return not bad, bad

    def _report(self, c: VersionCheck) -> None:
        if not c.ok:
            self.say(f"vllm_serve v{c.version}: NOT taken: {c.error}")
            return
        eq = "n/a" if c.checksums_equal is None else ("yes" if c.checksums_equal else f"NO {c.mismatches[:3]}")
        self.say(f"vllm_serve v{c.version}: staged {c.staged_s:.3f}s, generation paused {c.pause_s * 1e3:.0f} ms, "
                 f"spans ok: {'yes' if c.spans_ok else 'NO'}, checksums equal to a dense engine: {eq}")

    def summary(self) -> dict:
        return {
            "refits_taken": sum(c.ok for c in self.checks),
            "checksums_equal": sum(c.checksums_equal is True for c in self.checks),
            "weight_version_spans_ok": bool(self.checks) and all(c.spans_ok for c in self.checks if c.ok),
            "generation_pause_s_max": round(max((c.pause_s for c in self.checks), default=0.0), 4),
            "staged_s_max": round(max((c.staged_s or 0.0 for c in self.checks), default=0.0), 4),
        }

    def stop(self) -> None:
        self._stop.set()
        for s in [*self.servers, *([self.reference] if self.reference else [])]:
            s.stop()

