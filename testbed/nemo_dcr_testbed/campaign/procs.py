"""The processes of an epoch: the moto S3 server, a receiver (``nemo_dcr_testbed.faults``) and a
relay (``nemo_dcr_testbed.relay_faults``), each wrapped with its log; killing a process tree."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .kinds import RELAY_UPSTREAMS

if TYPE_CHECKING:
    from .epoch import Epoch


# the repository (testbed/nemo_dcr_testbed/campaign/ -> ../../..): the processes' cwd, the default results
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    def __init__(self, log_path: str):
        self.port = free_port()
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def stall(self, seconds: float) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _log_count(directory: str, needle: str) -> int:
    """Occurrences of ``needle`` in the ``log-*`` files of a node's directory (one per start)."""
    n = 0
    for name in os.listdir(directory):
        if name.startswith("log-"):
            with open(os.path.join(directory, name), errors="replace") as f:
                n += f.read().count(needle)
    return n


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: the parent is the 4th field of stat)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


class ReceiverProc:
    def __init__(self, epoch: Epoch, rid: str, join: bool = False):
        self.epoch = epoch
        self.rid = rid
        self.join = join  # elastic: asks to become a member (Follower.join)
        self.dir = os.path.join(epoch.dir, "rx", rid)
        os.makedirs(self.dir, exist_ok=True)
        self.incarnation = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, download_init: bool = False) -> None:
        """(Re)start from scratch; ``download_init``: version 0 through its upstream list (the
        product's bootstrap), not from the driver's copy."""
        self.incarnation += 1
        state_dir = os.path.join(self.dir, f"state-{self.incarnation}")  # from scratch
        log = open(os.path.join(self.dir, f"log-{self.incarnation}.txt"), "w")
        cmd = [sys.executable, "-m", "nemo_dcr_testbed.faults", "--store", self.epoch.store_uri(self.rid),
               "--receiver-id", self.rid, "--model-id", "fault-campaign", "--init-dir", self.epoch.init_dir,
               "--plan-dir", self.epoch.plan_dir, "--dir", self.dir, "--state-dir", state_dir]
        if self.join:
            cmd.append("--join")
        if download_init:
            cmd.append("--download-init")
        if self.epoch.relays:  # faults are the relays' here (see main: no receiver store faults)
            cmd += ["--hop-timeout-s", str(self.epoch.hop_timeout_s), "--retry-after-s", str(self.epoch.retry_after_s),
                    "--no-store-faults"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.epoch.env,
                                     cwd=ROOT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask(self, req: str) -> None:
        """Ask for a settled dump (answered in ``status.json``)."""
        with open(os.path.join(self.dir, "req.tmp"), "w") as f:
            f.write(req)
        os.replace(os.path.join(self.dir, "req.tmp"), os.path.join(self.dir, "req"))

    def status(self, req: str, timeout: float) -> tuple[dict | None, int]:
        """Ask for a settled dump; restarts the process when it died.  (status, restarts)."""
        self.ask(req)
        restarts = 0
        deadline = time.monotonic() + timeout
        path = os.path.join(self.dir, "status.json")
        while time.monotonic() < deadline:
            if not self.alive():
                if restarts >= 3:
                    return None, restarts
                restarts += 1
                self.start()
            try:
                with open(path) as f:
                    st = json.load(f)
                if st["req"] == req:
                    return st, restarts
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.05)
        return None, restarts

    def log_count(self, needle: str) -> int:
        return _log_count(self.dir, needle)

    def close(self) -> None:
        open(os.path.join(self.dir, "stop"), "w").close()
        _kill(self.proc)


class RelayProc:
    """One relay of a relay epoch: the product's relay server, run by the test-bed launcher
    ``nemo_dcr_testbed.relay_faults`` (which can make it serve flipped chunk bytes, per plan),
    on a port fixed for the epoch so that a restarted relay is found at the same address."""

    def __init__(self, epoch: Epoch, role: str):
        self.epoch = epoch
        self.role = role
        self.dir = os.path.join(epoch.dir, "relays", role)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.uri = f"relay://127.0.0.1:{self.port}"
        self.launches = 0
        self.stopped = False
        self.proc: subprocess.Popen | None = None
        # a warm spare (imports done, upstreams opened, waiting to bind): a restart under load
        # then takes a bind, not a Python start (tens of seconds on the loaded 2-core machine)
        self.spare: tuple[subprocess.Popen, str] | None = None

    def _launch(self, standby: str | None) -> subprocess.Popen:
        self.launches += 1  # every launch has its own log and its own, empty spool directory
        upstream = ",".join([self.epoch.relays[r].uri for r in RELAY_UPSTREAMS[self.role]] + [self.epoch.uri])
        cmd = [sys.executable, "-m", "nemo_dcr_testbed.relay_faults", "--role", self.role,
               "--plan-dir", self.epoch.plan_dir, "--upstream", upstream, "--listen", f"127.0.0.1:{self.port}",
               "--spool", os.path.join(self.dir, f"spool-{self.launches}"),
               "--hop-timeout-s", str(self.epoch.hop_timeout_s), "--retry-after-s", str(self.epoch.retry_after_s)]
        if standby:
            cmd += ["--standby", standby]
        log = open(os.path.join(self.dir, f"log-{self.launches}.txt"), "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.epoch.env, cwd=ROOT,
                                start_new_session=True)

    def start(self) -> None:
        """(Re)start on the epoch's port, on a new, empty spool: the warm spare when there is
        one (then a new spare is launched)."""
        self.stopped = False
        if self.spare is not None and self.spare[0].poll() is None:
            self.proc, go = self.spare
            open(go, "w").close()
        else:
            self.proc = self._launch(None)
        go = os.path.join(self.dir, f"go-{self.launches + 1}")
        self.spare = (self._launch(go), go)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"relay {self.role} did not start (pid {self.proc.pid})")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    def kill(self) -> None:
        _kill(self.proc)
        self.stopped = False

    def log_count(self, needle: str) -> int:
        return _log_count(self.dir, needle)

    def close(self) -> None:
        self.kill()
        if self.spare is not None:
            _kill(self.spare[0])


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
