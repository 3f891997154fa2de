"""The demo stops every process it started when one of them fails.

A real demo run (megatron-core trainer ranks under torchrun, two receiver processes)
where receiver r1 is replaced by a process that fails one second after it starts.  A
watcher thread records every process below this one while the demo runs; when the demo
returns, none of them may still be running.  Control: the watcher did see the trainer
ranks and the healthy receiver alive (so the check is not vacuous).
"""
import os
import sys
import threading
import time

import psutil
import pytest

from nemo_dcr_testbed import demo

SMALL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.ffn_hidden_size=256", "model.vocab_size=1003",
         "model.seq_length=32"]
FAIL_R1 = ("import sys, time; time.sleep(1); "
           "print('RuntimeError: injected receiver failure', flush=True); sys.exit(3)")


class _Watcher(threading.Thread):
    """Samples this process's descendants (that were not there before) every 50 ms, each
    with its latest command line.  Every live descendant is read again on each sample: one
    caught between fork and exec still shows its parent's command line (this process's, or
    torchrun's for a trainer rank), and under load that window is wide enough to be
    sampled."""

    def __init__(self):
        super().__init__(daemon=True)
        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children(recursive=True)}
        self.seen: dict[int, tuple[float, str]] = {}
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set():
            for p in self.me.children(recursive=True):
                if p.pid in self.before:
                    continue
                try:
                    cmd = " ".join(p.cmdline())
                    if cmd:  # a zombie's reads empty: keep what it showed while running
                        self.seen[p.pid] = (p.create_time(), cmd)
                except psutil.Error:
                    pass
            time.sleep(0.05)

    def alive(self, pid: int) -> bool:
        """``pid`` is still the process seen (not a reused pid) and not a zombie."""
        try:
            p = psutil.Process(pid)
            return p.create_time() == self.seen[pid][0] and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def survivors(self) -> list[str]:
        out = []
        for pid, (created, cmd) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid}: {cmd}")
            except psutil.Error:
                pass
        return out


@pytest.mark.slow
def test_a_failing_receiver_stops_every_process_the_demo_started(tmp_path, monkeypatch, capsys):
    real_start = demo._Children.start

    def start(self, cmd, log, env):
        if "--receiver-id" in cmd and cmd[cmd.index("--receiver-id") + 1] == "r1":
            cmd = [sys.executable, "-c", FAIL_R1]
        return real_start(self, cmd, log, env)

    stops: list[tuple[float, int]] = []
    real_stop = demo._Children.stop

    def timed_stop(self, grace_s: float = 10.0) -> int:
        t0 = time.monotonic()
        n = real_stop(self, grace_s)
        stops.append((time.monotonic() - t0, n))
        return n

    monkeypatch.setattr(demo._Children, "start", start)
    monkeypatch.setattr(demo._Children, "stop", timed_stop)
    watcher = _Watcher()
    watcher.start()
    try:
        code = demo.main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", "steps=3", "refit.receivers=[r0,r1]",
                          *SMALL])
    finally:
        watcher.halt.set()
        watcher.join()
        survivors = watcher.survivors()
        for line in survivors:  # so that a failing test leaves nothing behind either
            try:
                psutil.Process(int(line.split(":")[0])).kill()
            except psutil.Error:
                pass
    err = capsys.readouterr().err.strip().splitlines()
    print("\n" + "\n".join(err[-3:]))
    if stops:
        print(f"cleanup: stop() took {stops[0][0]:.2f} s and stopped {stops[0][1]} processes")

    assert survivors == []
    assert code == 1
    assert "receiver r1 failed (exit 3): RuntimeError: injected receiver failure -- log: " in err[-1], err
    assert "stopped" in err[-1] and "\n" not in err[-1]
    cmds = [cmd for _, cmd in watcher.seen.values()]
    # control: the trainer ranks and the healthy receiver r0 were running while the demo ran
    assert sum("nemo_dcr_testbed.run_trainer" in c and "torch.distributed.run" not in c for c in cmds) == 2, cmds
    assert any("nemo_dcr.receiver.cli" in c and "--receiver-id r0" in c for c in cmds), cmds
    assert stops and stops[0][1] >= 3  # torchrun + 2 ranks at least were still running
    assert os.path.exists(tmp_path / "run" / "receiver-r1.log")
