"""One epoch of the campaign: a trainer (torchrun, ``nemo_dcr_testbed.campaign_trainer``), its
receivers and, in a relay epoch, the relay tree, all on one store (one bucket of moto S3)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from .kinds import EVICT_AFTER, MIN_RECEIVERS, RECEIVERS, RECEIVER_UPSTREAMS, RELAYS
from .procs import Moto, ROOT, ReceiverProc, RelayProc, _descendants, _kill, _pid_alive, _tail


class Epoch:
    """One trainer run on a fresh bucket, with its receivers (and, in a relay epoch, the
    relay tree they read through)."""

    def __init__(self, work: str, index: int, moto: Moto, key_file: str, ack_timeout_s: float, seed: int,
                 relays: bool = False, hop_timeout_s: float = 2.0, retry_after_s: float = 2.0,
                 pipeline: bool = False, elastic: bool = False):
        import s3fs

        self.index = index
        self.seed = seed
        self.moto = moto  # store_stall_inflight stops it
        self.pipeline = pipeline
        self.elastic = elastic
        self.incarnation = 1  # trainer starts (pipelined epochs resume it after a kill)
        self.joins = 0  # receivers started with --join so far (named j1, j2, ...)
        self.dead: dict[str, ReceiverProc] = {}  # receivers killed for good (receiver_dies)
        self.ack_timeout_s = ack_timeout_s
        self.hop_timeout_s = hop_timeout_s
        self.retry_after_s = retry_after_s
        self.relays: dict[str, RelayProc] = {}
        self.quiet_at = 0.0  # relay epochs: no trial starts before (monotonic)
        self.dir = os.path.join(work, f"epoch-{index}")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.plan_dir = os.path.join(self.dir, "plan")
        for d in ("plan", "go", "dense"):
            os.makedirs(os.path.join(self.dir, d))
        bucket = f"dcr-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto.env["AWS_ENDPOINT_URL"]})
        fs.mkdir(bucket)
        self.uri = f"s3://{bucket}/run"
        self.env = dict(os.environ, **moto.env, NEMO_DCR_KEY_FILE=key_file, OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1")
        self.trainer_log = os.path.join(self.dir, "trainer.log")
        t0 = time.monotonic()
        self.receivers: dict[str, ReceiverProc] = {}
        ready = self.start_trainer()
        if ready.get("refused"):
            raise RuntimeError(f"campaign trainer refused to start: {ready}")
        self.run_id = ready["run_id"]
        self.members = set(RECEIVERS)  # as the last signed decision read names them
        from nemo_dcr.integrations.hf_export import download_checkpoint
        from nemo_dcr.transport.store import open_store

        os.environ.update(moto.env)
        self.store = open_store(self.uri)
        self.init_dir = download_checkpoint(self.store, os.path.join(self.dir, "init"))
        if relays:  # roots first: a relay's upstream list names its parent
            self.relays = {role: RelayProc(self, role) for role in RELAYS}
            for relay in self.relays.values():
                relay.start()
            for relay in self.relays.values():
                relay.wait_ready()
        self.receivers = {rid: ReceiverProc(self, rid) for rid in RECEIVERS}
        for rx in self.receivers.values():  # the first version must not race their start
            self.wait_ready(rx, t0)
        self.version = 0
        self.committed = 0
        self.heads: dict[int, bytes] = {}  # HEAD.json bytes after each trial (genuine, signed)
        self.aborted: set[int] = set()
        self.planted: set[int] = set()  # version numbers a key-less writer planted (planted_keys)
        self.rows_seen = 0
        self.setup_s = time.monotonic() - t0

    @staticmethod
    def wait_ready(rx: "ReceiverProc", t0: float, timeout: float = 300.0) -> None:
        while rx.log_count('"ready": true') < 1:
            if not rx.alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"receiver {rx.rid} did not start:\n"
                                   f"{_tail(os.path.join(rx.dir, f'log-{rx.incarnation}.txt'))}")
            time.sleep(0.1)

    def start_trainer(self, resume: bool = False) -> dict:
        """Start the trainer ranks (a pipelined epoch's resume: from its last checkpoint) and
        wait until they are ready; returns the ready file (pipelined: the next version) or
        ``{"refused": ...}`` when a resume was refused."""
        self.launch_trainer(resume)
        return self.wait_trainer()

    def launch_trainer(self, resume: bool = False) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "nemo_dcr_testbed.campaign_trainer", "--dir", self.dir, "--store", self.uri,
               "--ack-timeout-s", str(self.ack_timeout_s), "--seed", str(self.seed + self.index)]
        if self.pipeline:
            cmd += ["--pipeline", "--incarnation", str(self.incarnation)]
            if self.elastic:
                cmd += ["--membership", "elastic", "--min-receivers", str(MIN_RECEIVERS),
                        "--evict-after", str(EVICT_AFTER)]
            if resume:
                cmd.append("--resume")
        self.trainer_t0 = time.monotonic()
        self.trainer = subprocess.Popen(cmd, stdout=open(self.trainer_log, "a"), stderr=subprocess.STDOUT,
                                        env=self.env, cwd=ROOT, start_new_session=True)

    def wait_trainer(self) -> dict:
        t0 = self.trainer_t0
        ready = os.path.join(self.dir, f"ready-{self.incarnation}.json" if self.pipeline else "ready.json")
        refused = os.path.join(self.dir, f"refused-{self.incarnation}.json")
        while not os.path.exists(ready):
            if os.path.exists(refused):
                with open(refused) as f:
                    return {"refused": json.load(f)}
            if self.trainer.poll() is not None or time.monotonic() - t0 > 300:
                if os.path.exists(refused):
                    continue
                raise RuntimeError(f"campaign trainer did not start:\n{_tail(self.trainer_log)}")
            time.sleep(0.1)
        with open(ready) as f:
            return json.load(f)

    def kill_trainer(self) -> list[int]:
        """SIGKILL every trainer rank, then torchrun (the ranks run in sessions of their own,
        out of torchrun's process group).  Returns the ranks' pids still alive after it
        (must be none)."""
        ranks = _descendants(self.trainer.pid) if self.trainer.poll() is None else []
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill(self.trainer)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_pid_alive(p) for p in ranks):
            time.sleep(0.05)
        return [p for p in ranks if _pid_alive(p)]

    def store_uri(self, rid: str) -> str:
        """The store URI a receiver reads: the origin, or its relays then the origin."""
        if not self.relays:
            return self.uri
        return ",".join([self.relays[r].uri for r in RECEIVER_UPSTREAMS[rid]] + [self.uri])

    def heal(self) -> list[str]:
        """Start making the tree whole again: a relay still stopped is killed, a dead one is
        restarted on the same port (a relay never reads an earlier incarnation's spool: each
        start makes its own).  Returns what was done; :meth:`wait_healed` waits for it."""
        done = []
        for role, relay in self.relays.items():
            if relay.stopped:
                relay.kill()
                done.append(f"{role}: stopped, killed")
            if not relay.alive():
                relay.start()
                done.append(f"{role}: restarted")
        return done

    def wait_healed(self) -> None:
        for relay in self.relays.values():
            relay.wait_ready()

    def rows(self) -> list[dict]:
        try:
            with open(os.path.join(self.dir, "steps.jsonl")) as f:
                return [json.loads(x) for x in f.read().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def row(self, version: int) -> dict | None:
        """The trainer's row of ``version`` (versions skip numbers after a resume)."""
        return next((r for r in self.rows() if r["version"] == version), None)

    def dense(self, version: int) -> dict:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.dir, "dense", f"v{version}.safetensors"))

    def close(self) -> None:
        open(os.path.join(self.dir, "stop"), "w").close()
        for rx in self.receivers.values():
            rx.close()
        for relay in self.relays.values():
            relay.close()
        try:
            self.trainer.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.kill_trainer()
