"""The version in flight: between its hook call and the settling of its decision on a rank,
and what becomes of it when the process ends first.

A version's background work (``engine.RefitSender._background``) finishes its uploads, sends
the chunk refs to rank 0, which publishes the manifest and runs the joint commit, and learns
the decision; ``settle`` applies it at the next hook call.  A process can end before that:
a loop that never calls ``finish``, or Megatron-Bridge's ``sys.exit()`` before
``on_train_end``.  :func:`settle_on_exit` then lets the version reach its decision, bounded
(:func:`exit_settle_bound_s`), at interpreter exit (``atexit``) and on SIGTERM
(:func:`watch_exit`), so that receivers are not left waiting on a version whose trainer is gone.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nemo_dcr.sender.collectives import log, rank
from nemo_dcr.sender.stats import PublishStats, RankOutcome, Verdict, decided_line

if TYPE_CHECKING:
    from nemo_dcr.sender.engine import RefitSender

EXIT_PUBLISH_GRACE_S = 60.0
"""Settling on exit: how long rank 0 waits for the version in flight to reach its manifest
(its ranks' remaining uploads, their chunk refs gathered to rank 0).  Past it the version is
given up before anything names it: no manifest, no HEAD, so receivers stay on the committed
version."""
EXIT_DECIDE_GRACE_S = 10.0
"""Settling on exit: beyond ``ack_timeout_s`` from the manifest's publication, the time left
for the decision record's (retried) put; rank 0 then gives the other ranks this long again
to receive the decision."""
EXIT_QUIESCE_S = 0.2
"""Settling on exit, every rank, once its background work ended: a pause with the GIL free
before the interpreter finalizes.  The work's last collective returns as soon as gloo marks
it complete; gloo's worker thread drops its reference to the collective's tensors a moment
later, and doing so takes the GIL.  If the interpreter is finalizing by then, that thread is
unwound through a ``noexcept`` frame and the process aborts ("terminate called without an
active exception", SIGABRT: seen on 1 in 10 exits of a 2-rank job)."""
_SETTLE_ON_EXIT = True
"""Private switch for tests: False runs a process without the exit settle (the old
behaviour, a control), set before the first version is submitted."""


def exit_settle_bound_s(ack_timeout_s: float) -> float:
    """The longest :func:`settle_on_exit` holds a rank at interpreter exit or SIGTERM: the
    publish grace, the ack timeout and the decide grace."""
    return EXIT_PUBLISH_GRACE_S + ack_timeout_s + EXIT_DECIDE_GRACE_S + EXIT_QUIESCE_S


@dataclass(eq=False)
class InFlight:
    """A version between its hook call and the settling of its decision on this rank."""

    version: int
    stats: PublishStats
    t_start: float
    thread: threading.Thread | None = None
    verdict: Verdict | None = None
    """Rank 0's decision as this rank received it (None: none reached this rank)."""
    failure: str = ""
    """The background work itself failed on this rank (not an abort: a lost collective, a bug)."""
    outcomes: list[RankOutcome] | None = None
    """Every rank's outcome, gathered by the background work once the decision is known; None
    if that gather itself failed on this rank."""
    applied: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)
    """Guards the exit fields below (rank 0's background work and :func:`settle_on_exit`)."""
    publishing_at: float | None = None
    """Rank 0: ``time.monotonic()`` when the manifest's publication began (None: not yet)."""
    recorded: bool = False
    """Rank 0: the background work is past the decision (recorded, or failed before any)."""
    abandoned: bool = False
    """Rank 0: the process exits and gave up on this version before its manifest: never publish it."""
    exit_settled: bool = False
    """:func:`settle_on_exit` ran for this version (it reports once)."""
    outcome: Verdict | str | None = None
    """Rank 0: the decision as recorded (a verdict, or why there is none), for the exit report."""
    store_mark: dict = field(default_factory=dict)
    """The store's request counters when the version started (``meter.snapshot_of``)."""

    @property
    def commit(self) -> bool:
        return self.verdict is not None and self.verdict.commit

    def outcome_here(self) -> RankOutcome:
        v = self.verdict
        return RankOutcome(version=self.version, commit=self.commit, digest=v.digest if v else "",
                           failure=self.failure, next_coding=v.next_coding if v else "")

    def may_publish(self) -> bool:
        """Rank 0, the background work, before the manifest: False once the exit settle gave
        up on this version (the process is exiting: a manifest now would have no decision)."""
        with self.cond:
            if self.abandoned:
                return False
            self.publishing_at = time.monotonic()
            self.cond.notify_all()
            return True

    def mark_recorded(self, outcome: Verdict | str | None = None) -> None:
        """The background work is past the decision; rank 0 passes it (``outcome``) and logs
        the version's one line (:func:`~nemo_dcr.sender.stats.decided_line`)."""
        with self.cond:
            first = not self.recorded
            if first:
                self.recorded, self.outcome = True, outcome
            published = self.publishing_at
            self.cond.notify_all()
        if first and isinstance(outcome, Verdict):
            seconds = None if published is None else time.monotonic() - published
            log(decided_line(self.stats, outcome.commit, outcome.reason, seconds))


def settle_on_exit(flight: InFlight | None, *, ack_timeout_s: float, committed_version: int,
                   why: str = "interpreter exit") -> str | None:
    """This rank alone, no collective, bounded: let ``flight`` reach its decision before the
    process ends.  Returns a one-line report on rank 0 (also logged), None elsewhere or when
    nothing was in flight.

    The background work decides as always: rank 0 publishes the manifest once every rank's
    chunk refs are in, waits for the acks (``ack_timeout_s``) and records commit only if every
    member acknowledged these bytes -- the joint-commit invariant is the one of a normal
    settle.  What this adds is the bounded wait, and on rank 0 the refusal to publish late:
    if the manifest is not being published within ``EXIT_PUBLISH_GRACE_S`` (a peer rank
    gone, its collectives torn down), the version is given up before anything names it, so
    receivers stay on the committed version.  Once published, rank 0 waits for the decision
    record up to ``ack_timeout_s + EXIT_DECIDE_GRACE_S`` from the publication; the other
    ranks wait for their background work at most :func:`exit_settle_bound_s`.  The decision
    is not applied to the baseline (the process is ending; a Python SIGTERM handler chained
    after this that lets training go on leaves it to the next ``settle``)."""
    if flight is None or flight.applied or flight.thread is None or flight.thread.ident is None:
        return None
    with flight.cond:
        if flight.exit_settled:
            return None
        flight.exit_settled = True
    t0 = time.monotonic()
    if rank() != 0:
        flight.thread.join(EXIT_PUBLISH_GRACE_S + ack_timeout_s + EXIT_DECIDE_GRACE_S)
        _quiesce(flight)
        return None
    with flight.cond:
        while not flight.recorded and flight.thread.is_alive():
            if flight.publishing_at is None:
                left = t0 + EXIT_PUBLISH_GRACE_S - time.monotonic()
                if left <= 0:
                    flight.abandoned = True
                    break
            else:
                left = flight.publishing_at + ack_timeout_s + EXIT_DECIDE_GRACE_S - time.monotonic()
                if left <= 0:
                    break
            flight.cond.wait(min(left, 0.5))
        recorded, outcome, abandoned = flight.recorded, flight.outcome, flight.abandoned
    waited = time.monotonic() - t0
    if recorded:  # let the other ranks receive the decision (they are released by it)
        flight.thread.join(EXIT_DECIDE_GRACE_S)
    _quiesce(flight)
    v = flight.version
    if isinstance(outcome, Verdict):
        report = f"version {v} committed" if outcome.commit else f"version {v} aborted: {outcome.reason}"
    elif isinstance(outcome, str):
        report = f"version {v} not decided: {outcome}"
    elif recorded or not flight.thread.is_alive():
        report = f"version {v} not decided: {flight.failure or 'the background refit ended without a decision'}"
    elif abandoned:
        report = (f"version {v} given up, never published: its manifest was not reached within "
                  f"{EXIT_PUBLISH_GRACE_S:.0f} s (a trainer rank gone?); receivers stay on version "
                  f"{committed_version}")
    else:
        report = (f"version {v} published but not decided within {ack_timeout_s + EXIT_DECIDE_GRACE_S:.0f} s "
                  "of its publication; receivers wait for its decision until their timeout")
    report = f"at {why}, after {waited:.1f} s: {report}"
    log(f"nemo_dcr: {report}")
    return report


def _quiesce(flight: InFlight) -> None:
    if not flight.thread.is_alive():  # its collectives are done: let gloo's workers let go of them
        time.sleep(EXIT_QUIESCE_S)


# ---------------------------------------------------------------------- the exit hooks
_exit_senders: weakref.WeakSet = weakref.WeakSet()
_exit_hooks = {"installed": False, "settling": False}


def watch_exit(sender: RefitSender) -> None:
    """Settle ``sender``'s version in flight at interpreter exit and on SIGTERM (installed
    once per process, at the first submitted version, unless ``_SETTLE_ON_EXIT`` is off)."""
    if not _SETTLE_ON_EXIT:
        return
    _exit_senders.add(sender)
    if _exit_hooks["installed"]:
        return
    _exit_hooks["installed"] = True
    atexit.register(_settle_all, "interpreter exit")
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread: atexit still settles
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous is signal.SIG_IGN:
        # a handler installed outside Python cannot be chained; an ignored SIGTERM stays ignored
        if rank() == 0:
            log("nemo_dcr: SIGTERM has a handler this process cannot chain (or is ignored): the version in "
                "flight is settled at interpreter exit only")
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(previous, signum, frame))


def _settle_all(why: str) -> None:
    if _exit_hooks["settling"]:
        return
    _exit_hooks["settling"] = True

    def one(sender: RefitSender) -> None:
        try:
            sender.settle_on_exit(why)
        except Exception as e:  # noqa: BLE001 - exiting: report, never raise
            log(f"nemo_dcr: settling on {why} failed: {type(e).__name__}: {e}")

    try:
        senders = [s for s in list(_exit_senders) if s.in_flight is not None]
        if len(senders) == 1:  # the usual case: one refit per process, waited for on this thread
            one(senders[0])
            return
        # several (a test process): side by side, so the wait is the longest one's, not their sum
        # (at interpreter exit on Python >= 3.12 no thread can start: one after the other)
        threads = []
        for s in senders:
            t = threading.Thread(target=one, args=(s,), daemon=True)
            try:
                t.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                one(s)
                continue
            threads.append(t)
        for t in threads:
            t.join()
    finally:
        _exit_hooks["settling"] = False


def _on_sigterm(previous, signum, frame) -> None:
    """Settle (bounded; a second SIGTERM meanwhile skips straight to the next step), then
    do what SIGTERM did before: the previous Python handler, or the default (terminate
    by the signal)."""
    _settle_all("SIGTERM")
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
