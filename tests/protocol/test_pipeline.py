"""The pipelined refit (``refit.pipeline``, ``RefitSender.submit`` / ``settle`` / ``finish``)
in one process: the call returns once the version is diffed, the joint commit runs in the
background, its decision is applied at the next call, every version is diffed against the
committed baseline, staged records are capped, and a failure of the background work
surfaces at the next call.  End states are checked with integer views against the
trainer's bits (a flipped bit is a control that must be seen)."""
import threading
import time

import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.errors import ProtocolError
from nemo_dcr.sender import chunker as chunker_mod
from nemo_dcr.sender import ReceiverRefused
from nemo_dcr.protocol.manifest import Decision, decision_key


def _bit_exact(rx_bits: np.ndarray, w: torch.Tensor) -> bool:
    return bool(np.array_equal(rx_bits, bits_of(w)))


def test_the_call_returns_before_the_decision_and_the_next_call_applies_it(tmp_path, key):
    rng = np.random.default_rng(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512, pipeline=True)
    rx = Rx("r0", store, key, sender.run_id, w)  # holds version 0; started later
    _step(w, rng)
    t0 = time.perf_counter()
    assert sender.submit(1) is None  # nothing was in flight
    returned_s = time.perf_counter() - t0
    # no receiver runs yet: the version waits for its ack in the background, the loop goes on
    assert sender.in_flight == 1 and sender.baseline.version == 0
    assert not store.exists(decision_key(1)) and returned_s < 5
    rx.start(until=3)
    _step(w, rng)
    settled = sender.submit(2)  # waits for v1's decision, applies it, then diffs v2 against it
    assert settled.version == 1 and settled.committed and settled.pause_s > 0
    assert sender.baseline.version == 1 and sender.in_flight == 2
    _step(w, rng)
    assert sender.submit(3).version == 2
    last = sender.finish()
    assert last.version == 3 and last.committed and last.base_version == 2
    assert sender.finish() is None  # drained
    rx.join()
    assert _bit_exact(rx.runtime.bits["canon.w"], w)
    flipped = rx.runtime.bits["canon.w"].copy()
    flipped[5] ^= 1  # control: one bit off is seen
    assert not _bit_exact(flipped, w)
    assert Decision.from_json(store.get(decision_key(3))).commit


def test_an_aborted_version_is_followed_by_one_diffed_against_the_committed_base(tmp_path, key):
    rng = np.random.default_rng(1)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512, pipeline=True)
    rx = Rx("r0", store, key, sender.run_id, w, refuse={2}).start(until=3)
    for v in (1, 2, 3):
        _step(w, rng)
        settled = sender.submit(v)
        if v == 3:
            assert settled.version == 2 and not settled.committed and "refusing apply call 2" in settled.reason
            assert sender.in_flight == 3
    last = sender.finish()
    assert last.committed and last.base_version == 1  # v3 against v1 (v2 was aborted)
    rx.join()
    assert _bit_exact(rx.runtime.bits["canon.w"], w)


def test_the_refusal_policy_stops_training_one_call_later(tmp_path, key):
    rng = np.random.default_rng(2)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, pipeline=True, ack_timeout_s=0.3, on_refusal="fail")
    _step(w, rng)
    sender.submit(1)  # nobody acknowledges it
    _step(w, rng)
    with pytest.raises(ReceiverRefused, match="version 1 not committed"):
        sender.submit(2)
    assert not Decision.from_json(store.get(decision_key(1))).commit


def test_a_failure_of_the_background_work_surfaces_at_the_next_call(tmp_path, key, monkeypatch):
    rng = np.random.default_rng(3)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, pipeline=True)

    def broken(*a, **kw):
        raise RuntimeError("injected: rank 0 lost its coordinator")

    monkeypatch.setattr(sender.decider, "decide", broken)
    _step(w, rng)
    sender.submit(1)  # returns: the failure happens in the background
    _step(w, rng)
    with pytest.raises(ProtocolError, match="version 1: the background refit failed on rank 0: .*injected"):
        sender.submit(2)
    assert sender.baseline.version == 0 and sender.in_flight is None


def test_staged_records_are_capped_and_the_call_waits_for_the_encoder(tmp_path, key, monkeypatch):
    waits = []
    real_wait = chunker_mod.wait

    def counting_wait(fs, **kw):
        waits.append(len(fs))
        return real_wait(fs, **kw)

    monkeypatch.setattr(chunker_mod, "wait", counting_wait)
    for cap, name in ((1 << 30, "big"), (1024, "tiny")):
        rng = np.random.default_rng(4)
        w = torch.randn(128, 64).to(torch.bfloat16)
        sender, store = _sender(tmp_path / name, {"w": w}, key, chunk_bytes=512, pipeline=True,
                                pipeline_max_staged_bytes=cap, upload_workers=1)
        rx = Rx("r0", store, key, sender.run_id, w).start(until=1)
        real_encode = sender.chunker.encode_upload

        def slow_encode(*a, real_encode=real_encode):
            time.sleep(0.005)
            return real_encode(*a)

        monkeypatch.setattr(sender.chunker, "encode_upload", slow_encode)
        waits.clear()
        _step(w, rng)
        sender.submit(1)
        stats = sender.finish()
        rx.join()
        assert stats.committed and stats.chunks > 4 and _bit_exact(rx.runtime.bits["canon.w"], w)
        if cap == 1024:
            assert waits, "the cap never made the diff wait for the encoder"
        else:
            assert not waits  # control: nothing near the cap, no wait


def test_run_state_for_a_checkpoint_waits_for_the_version_in_flight(tmp_path, key):
    rng = np.random.default_rng(5)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, pipeline=True)
    rx = Rx("r0", store, key, sender.run_id, w).start(until=1)
    _step(w, rng)
    sender.submit(1)
    state = sender.run_state()  # the weights hold v1's bits: the state must say whether v1 committed
    assert state.committed_version == 1 and state.published_version == 1 and sender.in_flight is None
    assert sender.finish().committed  # the next collective call still settles it, on every rank alike
    rx.join()


def test_the_background_work_runs_while_the_loop_goes_on(tmp_path, key):
    """The receiver acks only after the loop's next 'training step' started: the pipelined
    call does not hold the loop for the ack (a synchronous one would deadlock here)."""
    rng = np.random.default_rng(6)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, pipeline=True)
    step_started = threading.Event()
    rx = Rx("r0", store, key, sender.run_id, w)
    gate = threading.Thread(target=lambda: (step_started.wait(10), rx.start(until=1)))
    gate.start()
    _step(w, rng)
    sender.submit(1)
    step_started.set()  # the next step runs; only now may the receiver start
    gate.join()
    assert sender.finish().committed
    rx.join()
    assert _bit_exact(rx.runtime.bits["canon.w"], w)


def test_a_synchronous_refit_reports_the_whole_refit_as_its_pause(tmp_path, key):
    rng = np.random.default_rng(7)
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key)
    rx = Rx("r0", store, key, sender.run_id, w)
    gate = threading.Timer(0.5, lambda: rx.start(until=1))  # the ack cannot come before 0.5 s
    gate.start()
    _step(w, rng)
    stats = sender.refit(1)
    gate.join()
    rx.join()
    assert stats.committed and stats.pause_s >= 0.5 and stats.pause_s >= stats.commit_wait_s
