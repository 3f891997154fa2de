"""A process that ends with a pipelined version in flight settles it first: at interpreter
exit (a loop that never calls ``finish()``) and on SIGTERM, after which SIGTERM does what it
did before (the default action, or the loop's own Python handler).

``exit_loop_worker.py`` runs the real sender in one process (no torch.distributed); this
test acknowledges versions as receiver r0 (signed acks of the published manifests).  The
last version is acknowledged only once the worker said it is ending (after SIGTERM was sent,
for the SIGTERM cases), so a commit decision on it proves the process waited for the ack.
Controls: the same runs with the exit settle switched off (``sender._SETTLE_ON_EXIT``,
private) end with no decision on the last version -- what every process did before, and
the reason a receiver then waited until its own timeout.  Bounds are bounded waits (the
worker's ack timeout plus the exit settle's graces), never timed assertions.
"""
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nemo_dcr.sender import exit_settle_bound_s
from nemo_dcr.protocol.manifest import HEAD_KEY, Ack, Decision, Head, ack_key, decision_key, doc_digest, manifest_key
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
from nemo_dcr.transport.store import LocalDirStore

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_ACK_TIMEOUT_S = 120.0  # exit_loop_worker.ACK_TIMEOUT_S
STARTUP_S = 120.0  # bounded wait for the worker to reach its last version (imports, three versions)


class Acker:
    """Receiver r0's acknowledgements: versions below ``last`` as soon as they are published,
    ``last`` when :meth:`release` is called."""

    def __init__(self, store, sealer, last: int):
        self.store, self.sealer, self.last = store, sealer, last
        self.released = threading.Event()
        self.stop = threading.Event()
        self.acked: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def release(self) -> None:
        self.released.set()

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            try:
                head = Head.from_json(self.store.get(HEAD_KEY), self.sealer)
            except Exception:  # noqa: BLE001 - not written yet
                continue
            v = head.version
            if v in self.acked or (v >= self.last and not self.released.is_set()):
                continue
            digest = doc_digest(self.store.get(manifest_key(v)))
            self.store.put(ack_key("r0", v), Ack(run_id=head.run_id, receiver="r0", version=v, ok=True,
                                                 held_version=v, manifest_digest=digest).to_json(self.sealer))
            self.acked.append(v)


def _start(tmp_path, end: str, settle: bool):
    key = new_key_file(str(tmp_path / "key"))
    store = LocalDirStore(str(tmp_path / "store"))
    cmd = [sys.executable, os.path.join(HERE, "exit_loop_worker.py"), str(tmp_path / "store"), key, end]
    if not settle:
        cmd.append("--no-exit-settle")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    acker = Acker(store, Sealer(load_key(key)), last=3)
    lines: list[str] = []
    timer = threading.Timer(STARTUP_S, proc.kill)  # a bounded wait for the line below
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("worker: v3 in flight"):
                break
    finally:
        timer.cancel()
    assert lines and lines[-1].startswith("worker: v3 in flight (committed v2)"), "".join(lines)[-4000:]
    return proc, store, acker, lines


def _finish(proc, acker, lines, *, ack_last_before_exit: bool) -> str:
    if ack_last_before_exit:
        acker.release()
    try:
        out, _ = proc.communicate(timeout=exit_settle_bound_s(WORKER_ACK_TIMEOUT_S) + 30)
    except subprocess.TimeoutExpired:
        masks = _signal_masks(proc.pid)
        proc.send_signal(signal.SIGUSR1)  # every thread's stack (faulthandler), then kill
        time.sleep(2)
        proc.kill()
        out = proc.communicate()[0]  # all of it, what the timed-out call read included
        raise AssertionError("the worker did not exit within the exit settle's bound; its threads' signal "
                             f"masks: {masks}; its output and stacks:\n" + ("".join(lines) + (out or ""))[-8000:]) from None
    acker.release()  # the control: acknowledged only once the process is gone
    acker.stop.set()
    acker.thread.join(5)
    return "".join(lines) + out


def _signal_masks(pid: int) -> dict[str, str]:
    """Each thread's blocked / pending / caught signal sets (``/proc``), for a worker that overran."""
    masks = {}
    for status in sorted(glob.glob(f"/proc/{pid}/task/*/status")):
        try:
            with open(status) as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        tid = status.split("/")[-2]
        masks[f"{tid} {fields.get('Name', '?')}"] = " ".join(
            f"{k}={fields.get(k, '?')}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
    return masks


def _decision(store, v: int) -> Decision | None:
    return Decision.from_json(store.get(decision_key(v))) if store.exists(decision_key(v)) else None


@pytest.mark.parametrize("settle", [True, False], ids=["settled", "control-no-exit-settle"])
def test_a_loop_that_never_calls_finish_settles_its_last_version_at_exit(tmp_path, settle):
    proc, store, acker, lines = _start(tmp_path, "return", settle)
    out = _finish(proc, acker, lines, ack_last_before_exit=settle)
    assert proc.returncode == 0, out[-4000:]
    assert _decision(store, 2).commit  # the versions the loop settled itself
    last = _decision(store, 3)
    if settle:
        assert last is not None and last.commit, out[-4000:]
        assert "nemo_dcr: at interpreter exit, after" in out and "version 3 committed" in out, out[-4000:]
    else:  # the old behaviour: the process ended, its last version undecided
        assert last is None and store.exists(manifest_key(3)), out[-4000:]
        assert "at interpreter exit" not in out


@pytest.mark.parametrize("end,settle,status", [
    ("sigterm", True, -signal.SIGTERM),
    ("sigterm_chained", True, 7),
    ("sigterm", False, -signal.SIGTERM),
], ids=["default-action", "own-handler-chained", "control-no-exit-settle"])
def test_sigterm_settles_the_version_in_flight_then_acts_as_before(tmp_path, end, settle, status):
    proc, store, acker, lines = _start(tmp_path, end, settle)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, acker, lines, ack_last_before_exit=settle)  # acked after SIGTERM was sent
    assert proc.returncode == status, (proc.returncode, out[-4000:])  # the signal is not swallowed
    assert ("worker: own SIGTERM handler" in out) == (end == "sigterm_chained")
    last = _decision(store, 3)
    if settle:
        assert last is not None and last.commit, out[-4000:]
        assert "nemo_dcr: at SIGTERM, after" in out and "version 3 committed" in out, out[-4000:]
    else:
        assert last is None and store.exists(manifest_key(3)), out[-4000:]
