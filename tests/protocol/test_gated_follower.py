"""The background follower behind a write gate (``receiver/gated.py``), the core of vLLM's
weight-transfer backend, in one process: a trainer-side RefitSender (no process group) on a
thread, a receiver whose runtime is a stand-in (canonical numpy arrays), a real directory
store, signed.  Every end state is compared with integer views against the trainer's bits;
each case has a control (the versions differ; the bits move only inside a window)."""
import threading
import time

import numpy as np
import pytest
import torch
from protocol_helpers import ArrayRuntime, Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.protocol.history import init_digest
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.receiver.gated import BackgroundFollower, GatedModel, UpdateRefused, WriteGate


class Gated:
    """A gated receiver over an ArrayRuntime, following on its own thread."""

    def __init__(self, rid, store, key, run_id, w0, **runtime_kw):
        self.runtime = ArrayRuntime({"canon.w": w0.clone()}, **runtime_kw)
        self.gate = WriteGate()
        self.writes = []  # the bits after every write, and whether a window was open
        inner_apply = self.runtime.apply

        def apply(deltas):
            inner_apply(deltas)
            self.writes.append(self.w.copy())

        self.runtime.apply = apply
        rx = Receiver(GatedModel(self.runtime, self.gate), store,
                      ReceiverConfig(receiver_id=rid, model_id="m", poll_s=0.01))
        sealer = Sealer(load_key(key))
        self.lines = []
        self.bg = BackgroundFollower(rx, store, sealer, run_id, gate=self.gate, poll_s=0.01, log=self.lines.append,
                                     receiver_id=rid, committed_digest=init_digest(store, sealer, run_id)).start()

    @property
    def w(self):
        return self.runtime.bits["canon.w"]


def _refit_async(sender, version):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("stats", sender.refit(version)), daemon=True)
    t.start()
    return t, out


def _commit_and_check(sender, g, version, w):
    """Publish ``version`` and update to it; it commits and the engine holds the trainer's bits."""
    t, out = _refit_async(sender, version)
    g.bg.update(version, timeout_s=20)
    t.join(20)
    assert out["stats"].committed
    np.testing.assert_array_equal(g.w, bits_of(w))
    g.bg.stop()


@pytest.fixture
def run(tmp_path, key):
    w = torch.randn(64, 32).to(torch.bfloat16)
    made = []

    def make(receivers=("r0",), **sender_kw):
        sender, store = _sender(tmp_path, {"w": w}, key, receivers=receivers, **sender_kw)
        made.append(sender)
        return sender, store, w

    yield make


def test_a_version_is_staged_without_a_write_and_applied_in_the_window(run, key):
    sender, store, w = run()
    g = Gated("r0", store, key, sender.run_id, w)
    v0 = bits_of(w)
    _step(w, np.random.default_rng(0))
    t, out = _refit_async(sender, 1)
    assert g.bg.wait_staged(1, timeout_s=20)
    time.sleep(0.2)  # staged and waiting: nothing written, however long the owner waits
    assert g.writes == [] and np.array_equal(g.w, v0) and g.bg.status().staged == 1
    assert g.bg.latest() == 1  # "latest": the version the signed HEAD.json names
    event = g.bg.update(g.bg.latest(), timeout_s=20)
    t.join(20)
    assert out["stats"].committed and event["decision"] == "commit"
    np.testing.assert_array_equal(g.w, bits_of(w))
    assert not np.array_equal(v0, bits_of(w))  # control: the version changed bits
    assert g.bg.status().committed == 1 and g.bg.update(1, timeout_s=1)["event"] == "already held"
    with pytest.raises(UpdateRefused, match="older than v1"):
        g.bg.update(0, timeout_s=1)
    g.bg.stop()


def test_a_refused_version_raises_one_line_and_leaves_the_old_bits(run, key):
    sender, store, w = run()
    g = Gated("r0", store, key, sender.run_id, w, refuse={1})
    v0 = bits_of(w)
    rng = np.random.default_rng(1)
    _step(w, rng)
    t, out = _refit_async(sender, 1)
    with pytest.raises(UpdateRefused) as e:
        g.bg.update(1, timeout_s=20)
    t.join(20)
    assert not out["stats"].committed
    assert "v1 was not committed" in str(e.value) and "\n" not in str(e.value) and "holding v0" in str(e.value)
    np.testing.assert_array_equal(g.w, v0)
    assert g.writes == []  # refused before any write
    _step(w, rng)  # v2 on base v0: the engine still takes the next version
    _commit_and_check(sender, g, 2, w)


def test_an_aborted_version_is_rolled_back_inside_the_window(run, key):
    """r1 refuses v1, so the joint commit aborts it: the gated r0 wrote v1, acked, read the
    abort and rolled back, all inside the one update call."""
    sender, store, w = run(receivers=("r0", "r1"))
    g = Gated("r0", store, key, sender.run_id, w)
    other = Rx("r1", store, key, sender.run_id, w, refuse={1}).start(until=2)
    v0 = bits_of(w)
    rng = np.random.default_rng(2)
    _step(w, rng)
    v1 = bits_of(w)
    t, out = _refit_async(sender, 1)
    with pytest.raises(UpdateRefused, match="v1 was not committed"):
        g.bg.update(1, timeout_s=20)
    t.join(20)
    assert not out["stats"].committed
    assert len(g.writes) == 2  # the apply, then the rollback ...
    np.testing.assert_array_equal(g.writes[0], v1)  # ... of bits that were v1's
    np.testing.assert_array_equal(g.w, v0)
    _step(w, rng)
    t, out = _refit_async(sender, 2)
    g.bg.update(2, timeout_s=20)
    t.join(20)
    other.join()
    assert out["stats"].committed
    np.testing.assert_array_equal(g.w, bits_of(w))
    np.testing.assert_array_equal(other.w, bits_of(w))
    g.bg.stop()


def test_no_write_outside_a_window_and_a_version_never_asked_for_is_late(run, key):
    """The owner does not ask for v1: the trainer aborts it at its ack timeout and the
    weights never move; asking for v2 then applies v1 late, rolls it back on its abort, and
    commits v2."""
    sender, store, w = run(ack_timeout_s=2.0)
    g = Gated("r0", store, key, sender.run_id, w)
    v0 = bits_of(w)
    rng = np.random.default_rng(3)
    _step(w, rng)
    assert not sender.refit(1).committed  # nobody opened a window
    assert g.writes == [] and np.array_equal(g.w, v0)
    _step(w, rng)
    _commit_and_check(sender, g, 2, w)


def test_update_times_out_in_one_line_and_stop_ends_a_waiting_write(run, key):
    sender, store, w = run(ack_timeout_s=1.0)
    g = Gated("r0", store, key, sender.run_id, w)
    with pytest.raises(UpdateRefused, match=r"v3 not decided within 0.3s \(not staged; holding v0\)"):
        g.bg.update(3, timeout_s=0.3)
    _step(w, np.random.default_rng(4))
    t, _ = _refit_async(sender, 1)
    assert g.bg.wait_staged(1, timeout_s=20)
    g.bg.stop()  # the write waiting at the gate ends; nothing was written
    assert not g.bg._thread.is_alive() and g.writes == []
    t.join(20)


def test_leaving_a_window_waits_for_the_write_in_progress_and_later_writes_wait():
    gate = WriteGate()
    inside, release, ended = threading.Event(), threading.Event(), []

    def writer(entered):
        with gate.write():
            entered.set()
            release.wait(5)
            ended.append(time.monotonic())

    threading.Thread(target=writer, args=(inside,), daemon=True).start()
    assert gate.waiting or not inside.wait(0.2)  # no window: the write waits
    with gate.window():
        assert inside.wait(5)
        threading.Timer(0.2, release.set).start()
    closed = time.monotonic()
    assert ended and ended[0] <= closed  # the window closed only once the write had ended
    later = threading.Event()
    release.clear()
    threading.Thread(target=writer, args=(later,), daemon=True).start()
    assert not later.wait(0.2)  # control: after the window, a write does not start
    with gate.window():
        assert later.wait(5)
        release.set()
    gate.close()
