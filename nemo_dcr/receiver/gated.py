"""A receiver that follows its run in the background and writes only when asked.

A serving engine cannot take writes to its weights at any moment: a forward pass running
while an XOR lands reads torn bits.  ``nemo-dcr receive`` owns its runtime and applies as
soon as a version is fetched; an engine serving requests (vLLM's weight-transfer backend,
``runtimes/vllm/backend.py``) has an owner that decides when generation pauses.  So the
follower runs on a thread of its own and does everything that does not write served weights
-- read and verify documents, download, verify and decode chunks (streaming receive
included), validate the records against the runtime, and, for a model of two phases
(``DeltaApplier.stage``), write what no forward pass reads and build kernels from it --
while the engine serves.  Every served write (an apply, a rollback, a catch-up) waits at a
:class:`WriteGate` until the owner opens a window with
:meth:`BackgroundFollower.update`, which returns once the version asked for is decided (its
acknowledgement written, the joint commit's decision read, an aborted version rolled back in
place) or raises with the reason in one line, the weights at the version held before.

What the owner may rely on: between two calls of ``update`` nothing writes to the weights
the engine serves from;
within one, the writes are the follower's own (a version, its rollback, catch-up through
versions others committed).  The protocol is ``Follower``'s unchanged (acks, decisions,
catch-up, elastic join): a version the owner never asks for is acknowledged late or not at
all, and the trainer aborts it at its ack timeout like any slow receiver's.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.errors import ProtocolError
from nemo_dcr.events import event_line
from nemo_dcr.protocol.follower import Follower
from nemo_dcr.protocol.manifest import HEAD_KEY, Head, Manifest
from nemo_dcr.protocol.reader import DocReader
from nemo_dcr.receiver.runtime import TensorSpec


class GateClosed(ProtocolError):
    """The background follower was stopped while it waited to write."""


class UpdateRefused(ProtocolError):
    """The version asked for was refused, aborted or not decided in time; the weights are at
    the version held before the update (rolled back in place where they had been written)."""


class WriteGate:
    """Writes wait here until a window is open (:meth:`window`); :meth:`close` ends every
    wait with ``GateClosed``.  ``write_context()``: entered around every write (e.g. the
    engine's current-config context), ``None`` for none."""

    def __init__(self, write_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self._cond = threading.Condition()
        self.on_waiting: Callable[[], None] = lambda: None
        """Called (outside the gate's lock) each time a write starts waiting."""
        self._open = 0
        self._writing = 0
        self._closed = False
        self.waiting = False
        """A write is waiting for a window (the version it belongs to is staged)."""
        self.write_s = 0.0
        """Seconds spent writing (inside windows), all writes together."""
        self.stage_s = 0.0
        """Seconds the last phase one of a two-phase apply took (before its window)."""
        self._write_context = write_context or contextlib.nullcontext

    @property
    def is_open(self) -> bool:
        return self._open > 0

    @contextlib.contextmanager
    def window(self):
        """Writes may run while this is entered; leaving waits for a write in progress to
        end (so none runs on after the owner resumes serving)."""
        with self._cond:
            self._open += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                while not self._open and self._writing:
                    self._cond.wait()

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            self.waiting = True
            self._cond.notify_all()
        self.on_waiting()
        with self._cond:
            try:
                while not self._open and not self._closed:
                    self._cond.wait()
            finally:
                self.waiting = False
            if self._closed:
                raise GateClosed("the background follower was stopped")
            self._writing += 1
        t0 = time.perf_counter()
        try:
            with self._write_context():
                yield
        finally:
            self.write_s += time.perf_counter() - t0
            with self._cond:
                self._writing -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class GatedModel:
    """A ``ServedModel`` (``receiver/served.py``) whose writes pass a :class:`WriteGate`;
    reads and validation do not wait."""

    def __init__(self, inner, gate: WriteGate) -> None:
        self.inner = inner
        self.gate = gate

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.inner.tensor_specs()

    def canonical_bits(self, name: str) -> np.ndarray:
        return self.inner.canonical_bits(name)

    def canonical_bits_at_many(self, requests) -> list[np.ndarray]:
        many = getattr(self.inner, "canonical_bits_at_many", None)
        return many(requests) if many else [self.canonical_bits_at(n, p) for n, p in requests]

    def canonical_bits_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        read_at = getattr(self.inner, "canonical_bits_at", None)
        return read_at(name, positions) if read_at else np.asarray(self.inner.canonical_bits(name))[positions]

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        self.inner.validate(deltas)

    def apply(self, deltas: Sequence[TensorDelta]) -> object:
        """Where the model has two phases (``stage`` / ``apply(deltas, staged)`` /
        ``unstage``, e.g. ``InProcessModel``), phase one runs before the window: it writes
        only what no forward pass reads, so the window holds just the served writes."""
        stage = getattr(self.inner, "stage", None)
        if stage is None:
            with self.gate.write():
                return self.inner.apply(deltas)
        t0 = time.perf_counter()
        staged = stage(deltas)
        self.gate.stage_s = time.perf_counter() - t0
        entered = False
        try:
            with self.gate.write():
                entered = True
                return self.inner.apply(deltas, staged)  # (a refusal there undoes phase one itself)
        finally:
            if not entered:  # never applied (the gate closed): phase one's writes are undone
                self.inner.unstage(staged)

    def verify_dense(self, dense):
        return self.inner.verify_dense(dense)

    def sample(self):
        return self.inner.sample()


@dataclass
class FollowStatus:
    """What the background follower has reached (``status()``; written as JSON to
    ``status_path`` on every change)."""

    run_id: str
    receiver_id: str
    committed: int
    """The version held and committed."""
    fetching: int | None = None
    """The version whose chunks are being fetched and decoded."""
    staged: int | None = None
    """The version fetched, verified, decoded and validated, waiting for an update window."""
    tentative: int | None = None
    """A version applied and acknowledged whose decision is not read yet (after an update
    that timed out: the engine holds its bits until the next update settles it)."""
    last: dict = field(default_factory=dict)
    """The last protocol event (acknowledged, refused, decided, rolled back), as logged."""
    error: str = ""
    """The last error of the follower thread itself (a store failure it retries after)."""
    write_s: float = 0.0
    """Seconds the last update spent writing (applies, rollbacks, catch-up), the rest of
    it being the protocol's round trips."""
    stage_s: float = 0.0
    """Seconds the staged version's phase one took: its writes to unserved weights and the
    kernels built from them, done while the engine served (``GatedModel.apply``)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class BackgroundFollower:
    """A ``Follower`` (``protocol/follower.py``) over ``receiver`` stepping on a thread, the
    receiver's writes behind ``gate`` (see the module docstring).  ``receiver.served`` must be
    a :class:`GatedModel` over ``gate``; the receiver's ``before_fetch`` hook is taken here
    (it marks the version being fetched).  ``follower_args``: ``Follower``'s keyword
    arguments (``receiver_id``, ``committed``, ``committed_digest``, ``join``, ...) but
    ``log``; ``log(line)`` gets each protocol event as a JSON line."""

    RETRY_S = 1.0
    """Rest after an unexpected error of a follower step before the next one."""
    WINDOW_POLL_S = 0.005
    """Poll interval while a window is open: the owner's generation is paused, and each poll
    of the decision it waits for is time the engine does not serve."""

    def __init__(self, receiver, store, sealer, run_id: str, *, gate: WriteGate, poll_s: float = 0.05,
                 status_path: str | None = None, log: Callable[[str], None] | None = None,
                 **follower_args) -> None:
        if not isinstance(receiver.served, GatedModel) or receiver.served.gate is not gate:
            raise ProtocolError("BackgroundFollower: the receiver's model must be a GatedModel over its gate")
        follower = Follower(receiver, store, sealer, run_id, log=self._event, **follower_args)
        self.follower = follower
        self.gate = gate
        self.poll_s = poll_s
        self.status_path = status_path
        self._log_line = log or (lambda line: None)
        self._cond = threading.Condition()
        st = follower.state
        self._status = FollowStatus(run_id=st.run_id, receiver_id=follower.receiver_id, committed=st.committed)
        self._outcomes: dict[int, dict] = {}  # version -> its last decision / refusal event
        self._stop = False
        receiver.before_fetch = self._fetching
        gate.on_waiting = self._staged
        self._thread = threading.Thread(target=self._loop, name=f"dcr-follow-{follower.receiver_id}", daemon=True)

    # ------------------------------------------------------------ the thread
    def start(self) -> BackgroundFollower:
        self._write_status()
        self._thread.start()
        return self

    def _fetching(self, manifest: Manifest) -> None:
        with self._cond:
            self._status.fetching = manifest.version
            self._cond.notify_all()
        self._write_status()

    def _staged(self) -> None:
        with self._cond:
            self._status.stage_s = round(self.gate.stage_s, 6)
            self._cond.notify_all()
        self._write_status()

    def _event(self, event: dict) -> None:
        self._log_line(event_line(event))
        version = event.get("version")
        with self._cond:
            if isinstance(version, int) and ("decision" in event or event.get("ok") is False):
                self._outcomes[version] = event
                for old in sorted(self._outcomes)[:-64]:  # bounded: the last 64 versions
                    del self._outcomes[old]
            self._status.last = event
            self._status.committed = self.follower.state.committed
            self._status.fetching = None
            self._cond.notify_all()
        self._write_status()

    def _loop(self) -> None:
        f = self.follower
        while not self._stop:
            try:
                busy = f.step()
            except GateClosed:
                return
            except Exception as e:  # noqa: BLE001 - a failed step is retried; the engine keeps serving
                with self._cond:
                    self._status.error = _one_line(f"{type(e).__name__}: {e}")
                    self._cond.notify_all()
                self._log_line(event_line({"receiver": f.receiver_id, "event": "step failed",
                                           "error": self._status.error}))
                self._write_status()
                time.sleep(self.RETRY_S)
                continue
            with self._cond:
                self._status.committed = f.state.committed
                staged = self._status.fetching if self.gate.waiting else None
                changed = staged != self._status.staged
                self._status.staged = staged
                self._cond.notify_all()
            if changed:
                self._write_status()
            if not busy:
                time.sleep(min(self.poll_s, self.WINDOW_POLL_S) if self.gate.is_open else self.poll_s)

    # ------------------------------------------------------------ the owner
    def status(self) -> FollowStatus:
        with self._cond:
            st = self._status
            return FollowStatus(run_id=st.run_id, receiver_id=st.receiver_id, committed=self.follower.state.committed,
                                fetching=st.fetching, staged=self._status_staged(),
                                tentative=self.follower.state.tentative, last=dict(st.last), error=st.error,
                                write_s=st.write_s, stage_s=st.stage_s)

    def _status_staged(self) -> int | None:
        return self._status.fetching if self.gate.waiting else self._status.staged

    def latest(self) -> int:
        """The version the run's signed ``HEAD.json`` names now (0 when none is published)."""
        f = self.follower
        reader = DocReader(f.store, f.sealer, f.state.run_id, log=lambda event: None)
        head = reader.read(HEAD_KEY, Head)
        return 0 if head is None else head.doc.version

    def wait_staged(self, version: int, timeout_s: float) -> bool:
        """Wait until ``version`` is staged (or already held); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self.follower.state.committed >= version or self._status_staged() == version:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))

    def update(self, version: int, *, timeout_s: float) -> dict:
        """Open a write window until ``version`` is decided; returns its commit event.
        Raises :class:`UpdateRefused` (one line) when it was refused or aborted (the weights
        then hold the version committed before, rolled back where written), when the engine
        already committed a newer one, or when it is not decided within ``timeout_s``.  After
        a timeout past the write the version is held tentatively (``status().tentative``):
        its decision, and a rollback on abort, wait for the next update's window."""
        st = self.follower.state
        if st.committed == version:
            return {"version": version, "event": "already held", "held": version}
        if st.committed > version:
            raise UpdateRefused(f"v{version} is older than v{st.committed}, which this engine holds")
        deadline = time.monotonic() + timeout_s
        written = self.gate.write_s
        try:
            return self._update(version, deadline, timeout_s)
        finally:
            with self._cond:
                self._status.write_s = round(self.gate.write_s - written, 6)
            self._write_status()

    def _update(self, version: int, deadline: float, timeout_s: float) -> dict:
        st = self.follower.state
        with self.gate.window():
            with self._cond:
                while True:
                    if st.committed >= version and st.awaiting is None:  # (awaiting: its event is logged)
                        event = self._outcomes.get(version) or {"version": version, "event": "caught up"}
                        if st.committed > version:
                            event = {**event, "event": f"caught up to v{st.committed}"}
                        return event
                    outcome = self._outcomes.get(version)
                    if outcome is not None and st.awaiting is None and st.tentative is None and (
                            outcome.get("decision") == "abort" or st.decided >= version):
                        why = outcome.get("reason") or outcome.get("error") or outcome.get("event")
                        raise UpdateRefused(f"v{version} was not committed ({_one_line(why)}); "
                                            f"holding v{st.committed}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        what = "staged" if self._status_staged() == version else "not staged"
                        raise UpdateRefused(f"v{version} not decided within {timeout_s:g}s ({what}; "
                                            f"holding v{st.committed})")
                    self._cond.wait(min(left, 0.5))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        self.gate.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ProtocolError(f"follower thread of {self.follower.receiver_id} did not stop within {timeout_s}s")

    # ------------------------------------------------------------ status file
    def _write_status(self) -> None:
        if not self.status_path:
            return
        st = self.status()
        doc = {"run_id": st.run_id, "receiver": st.receiver_id, "committed": st.committed, "fetching": st.fetching,
               "staged": st.staged, "tentative": st.tentative, "last": st.last, "error": st.error, "write_s": st.write_s, "stage_s": st.stage_s,
               "time": time.time()}
        tmp = f"{self.status_path}.tmp{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.status_path)
