"""Plumbing shared by the shaped-link benchmarks (``scripts/bench_refit_link.py``,
``scripts/bench_relay_link.py``, ``scripts/bench_pipeline.py``): one-line failures, their
prerequisites and run directory, shell calls, stale network namespaces of a killed run,
argument parsing, the git state and the JSON files they write.  Test bed, not product."""
from __future__ import annotations

import atexit
import bisect
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable


class BenchError(Exception):
    """A one-line failure; ``exit_code`` 2 = bad input or environment, 1 = the run failed."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def progress(tag: str, msg: str) -> None:
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def run_cli(tag: str, body: Callable[[], int]) -> int:
    """A link benchmark's command line: ``body()``'s exit code, or one line on stderr per
    failure and its code (a BenchError its own, Ctrl-C 130, a library, OS or timeout error 1)."""
    from nemo_dcr.errors import DcrError

    try:
        return body()
    except BenchError as e:
        progress(tag, f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        progress(tag, "interrupted; stopped every process and removed the link")
        return 130
    except (DcrError, OSError, TimeoutError) as e:  # e.g. the store failing after its retries
        progress(tag, f"failed: {type(e).__name__}: {' '.join(str(e).split())}")
        return 1


def execute_run(run) -> dict:
    """``run.execute()`` of a benchmark's ``Run``, its processes stopped and its link removed
    however it ends: on return, on an exception, at interpreter exit and on SIGTERM."""
    from nemo_dcr_testbed.demo import _interrupt_on_sigterm

    atexit.register(run.cleanup)
    restore = _interrupt_on_sigterm()
    try:
        return run.execute()
    finally:
        try:
            run.cleanup()
        finally:
            restore()


def sh(*cmd: str, check: bool = True) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        err = " ".join((p.stderr or p.stdout).split()) or f"exit {p.returncode}"
        raise BenchError(f"`{shlex.join(cmd)}` failed: {err}")
    return p.stdout


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_links(ns_prefix: str, veth_prefix: str) -> list[str]:
    """Delete the namespaces ``<ns_prefix><pid>`` a killed run left behind (its pid is gone),
    killing whatever still runs in them, and their root-side veth ``<veth_prefix><pid>a``;
    returns their names."""
    removed = []
    for line in sh("ip", "netns", "list").splitlines():
        m = re.match(rf"^{re.escape(ns_prefix)}(\d+)\b", line.strip())
        if not m or pid_alive(int(m.group(1))):
            continue
        name = f"{ns_prefix}{m.group(1)}"
        for pid in sh("ip", "netns", "pids", name, check=False).split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", name, check=False)
        sh("ip", "link", "del", f"{veth_prefix}{m.group(1)}a", check=False)
        removed.append(name)
    return removed


def parse_floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--{what} must be comma-separated numbers, got {text!r}", 2) from None
    if not vals or any(not v > 0 for v in vals):
        raise BenchError(f"--{what} must list positive numbers, got {text!r}", 2)
    return vals


def write_json_atomic(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def read_rows(path: str) -> list[dict]:
    """The complete JSON lines of ``path`` (a line still being written is left out)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def check_prerequisites() -> None:
    """What every shaped-link run needs before it creates anything: root (network namespace,
    veth pair, tc shaping), iproute2, and moto_server next to this interpreter."""
    import shutil

    if os.geteuid() != 0:
        raise BenchError("needs root (network namespace, veth pair, tc shaping); run it with sudo", 2)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise BenchError(f"`{tool}` (iproute2) not found on PATH", 2)
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "moto_server")):
        raise BenchError(f"moto_server not found next to {sys.executable} (pip install 'moto[server]')", 2)


def fresh_run_dir(given: str | None, default: str) -> str:
    """The run's directory (``given``, else ``default``), refused unless absent or empty."""
    run_dir = os.path.abspath(given or default)
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise BenchError(f"run dir {run_dir} is not empty; choose another --run-dir", 2)
    return run_dir


def git_state(root: str) -> dict | None:
    """HEAD and the paths changed against it when the run started (others may be changing
    the tree concurrently; the numbers belong to this state)."""
    try:
        head = sh("git", "-C", root, "rev-parse", "--short", "HEAD").strip()
        status = sh("git", "-C", root, "status", "--porcelain", "--untracked-files=no")
    except (BenchError, OSError):
        return None
    return {"head": head, "modified": [ln[3:] for ln in status.splitlines()]}


class CounterLog:
    """Timestamped samples of a monotonically growing byte counter; ``at(t)`` interpolates
    linearly between the samples around ``t`` (clamped to the first / last)."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.v: list[int] = []
        self._lock = threading.Lock()

    def add(self, t: float, value: int) -> None:
        with self._lock:
            if self.t and t <= self.t[-1]:
                raise ValueError("samples must come in time order")
            self.t.append(t)
            self.v.append(value)

    def at(self, t: float) -> float:
        with self._lock:
            if not self.t:
                raise ValueError("no samples")
            i = bisect.bisect_left(self.t, t)
            if i == 0:
                return float(self.v[0])
            if i == len(self.t):
                return float(self.v[-1])
            t0, t1, v0, v1 = self.t[i - 1], self.t[i], self.v[i - 1], self.v[i]
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def delta(self, t0: float, t1: float) -> int:
        return int(round(self.at(t1) - self.at(t0)))

    def busy_span(self, t0: float, t1: float, min_step: int = 16384) -> tuple[float, int] | None:
        """(seconds, bytes) from the first to the last sample interval in [t0, t1] in which
        the counter grew by at least ``min_step`` bytes (idle polling excluded); None if none."""
        with self._lock:
            lo, hi = bisect.bisect_left(self.t, t0), bisect.bisect_right(self.t, t1)
            busy = [i for i in range(max(lo, 1), hi) if self.v[i] - self.v[i - 1] >= min_step]
            if not busy:
                return None
            a, b = busy[0] - 1, busy[-1]
            return self.t[b] - self.t[a], self.v[b] - self.v[a]


def file_counter(path: str):
    """A reader of the integer in ``path`` (a ``/sys/class/net/<if>/statistics`` counter)."""
    def read() -> int:
        with open(path) as f:
            return int(f.read())
    return read


class Sampler:
    """A thread reading named counters every ``period_s`` (``readers``: name -> a function
    returning the counter's value; a reading that raises is skipped), each kept in its own
    :class:`CounterLog` (``logs[name]``)."""

    def __init__(self, readers: dict, period_s: float) -> None:
        self.readers = dict(readers)
        self.period_s = period_s
        self.logs = {name: CounterLog() for name in self.readers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, read in self.readers.items():
                try:
                    self.logs[name].add(time.monotonic(), read())
                except Exception:  # noqa: BLE001 - a counter unreadable, a process gone: no sample
                    pass
            self._stop.wait(self.period_s)

    def start(self) -> None:
        """Start sampling; returns once every counter has been read at least once (or after
        ``3 x period_s``, whichever is later)."""
        self._thread.start()
        time.sleep(3 * self.period_s)
        deadline = time.monotonic() + 10
        while not all(log.t for log in self.logs.values()) and time.monotonic() < deadline:
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
