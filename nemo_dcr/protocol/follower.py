"""Receiver side of the protocol: the version state machine (``protocol/commit.py`` is the
trainer's half).

A receiver holds a **committed** version ``c`` and at most one **tentative** version ``t``
(applied, acknowledged, waiting for the trainer's decision).  One ``step``:

1. A version acknowledged (or refused) and not yet decided: read its ``DECISION.json``.
   Commit: ``c = t``.  Abort: roll ``t`` back in place (undo journal) to ``c``, bit-exact.
   No decision yet: wait (the runtime keeps serving ``t``; it never serves a version after
   learning it was aborted).
2. Read ``HEAD.json``.  Nothing newer than what was handled: wait.
3. ``HEAD.base > c`` (the receiver restarted or fell behind): catch up by replaying the
   committed versions ``c -> ... -> HEAD.base``, found by walking the decision chain back
   from ``HEAD.base`` (each decision names its base).  Catch-up versions are committed
   already; the trainer does not wait for them.
4. ``HEAD.base == c``: fetch, check and apply ``HEAD.version`` tentatively; write a sealed
   ack (``ok`` only if applied and, when verifying, bit-exact) or a refusal.

Every document is opened with the run's key and must name the run this receiver
follows; anything else is logged and ignored (it may be a forgery; the real object may
still arrive), so a store writer without the key can delay a receiver but not make it
apply or roll back anything.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from nemo_dcr.errors import DcrError, ProtocolError, TransportError
from nemo_dcr.protocol.manifest import (
    HEAD_KEY,
    Ack,
    Decision,
    Head,
    Manifest,
    ack_key,
    decision_key,
    doc_digest,
    manifest_key,
)
from nemo_dcr.protocol.run import read_run
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore


@dataclass
class FollowerState:
    run_id: str
    committed: int = 0
    tentative: int | None = None
    tentative_digest: str = ""
    """Digest of the manifest applied as ``tentative``."""
    awaiting: int | None = None
    """Version acknowledged or refused whose decision is not known yet."""
    handled: int = 0
    """Highest version this receiver answered (acked, refused) or replayed."""
    decided: int = 0
    """Highest version whose decision this receiver has seen."""


def wait_for_run(store: ObjectStore, sealer: Sealer, *, run_id: str | None, timeout_s: float | None,
                 poll_s: float = 0.1) -> str:
    """The run id of the store's ``RUN.json`` (waiting for it to appear); refuses a run other
    than ``run_id`` when one is given."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        rec = read_run(store, sealer)
        if rec is not None:
            if run_id and rec.run_id != run_id:
                raise ProtocolError(f"store {store.uri} holds run {rec.run_id}, this receiver follows run {run_id}")
            return rec.run_id
        if deadline is not None and time.monotonic() > deadline:
            raise ProtocolError(f"store {store.uri}: no run record (RUN.json) within {timeout_s}s")
        time.sleep(poll_s)


class Follower:
    """Drives a ``Receiver`` (``receiver/worker.py``: fetch, apply, rollback) through the
    protocol.  ``log(dict)`` gets one JSON-able event per acknowledged, refused, decided,
    rolled-back or replayed version."""

    def __init__(self, receiver, store: ObjectStore, sealer: Sealer, run_id: str, *, receiver_id: str,
                 committed: int = 0, compose_after: int = 4, log=None):
        """``compose_after``: catching up through more committed versions than this applies
        them as one composed delta (``receiver/catchup.py``) instead of one by one."""
        self.rx = receiver
        self.store = store
        self.sealer = sealer
        self.receiver_id = receiver_id
        self.compose_after = compose_after
        self.state = FollowerState(run_id=run_id, committed=committed, handled=committed, decided=committed)
        self._log = log or (lambda event: print(json.dumps(event), flush=True))
        self._ignored: set[tuple[str, bytes]] = set()

    # ------------------------------------------------------------------ reads
    def _open(self, key: str, cls, what: str):
        """The sealed document at ``key`` if present, authentic and of this run; else None
        (a forged or foreign one is logged once and ignored)."""
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            return None
        except TransportError as e:  # a failing or stalled store: look again at the next poll
            self._log({"receiver": self.receiver_id, "store_error": key, "error": str(e)})
            return None
        try:
            doc = cls.from_json(data, self.sealer)
            if doc.run_id != self.state.run_id:
                raise ProtocolError(f"{what} of run {doc.run_id}, not {self.state.run_id}")
        except DcrError as e:
            if (key, data) not in self._ignored:
                self._ignored.add((key, data))
                self._log({"receiver": self.receiver_id, "ignored": key, "error": str(e)})
            return None
        return doc, data

    def _decision(self, version: int) -> Decision | None:
        got = self._open(decision_key(version), Decision, f"decision v{version}")
        if got is None:
            return None
        d = got[0]
        if d.version != version:
            self._log({"receiver": self.receiver_id, "ignored": decision_key(version),
                       "error": f"names version {d.version}"})
            return None
        return d

    def _manifest(self, version: int) -> tuple[Manifest, str] | None:
        got = self._open(manifest_key(version), Manifest, f"manifest v{version}")
        if got is None:
            return None
        m, data = got
        if m.version != version:
            self._log({"receiver": self.receiver_id, "ignored": manifest_key(version),
                       "error": f"names version {m.version}"})
            return None
        return m, doc_digest(data)

    # ------------------------------------------------------------------ steps
    def _settle(self) -> bool:
        """Step 1; True when the awaited decision arrived."""
        st = self.state
        d = self._decision(st.awaiting)
        if d is None:
            # No decision record (the trainer may have failed before writing it).  A newer HEAD
            # whose base is older than the awaited version proves it was not committed
            # (versions are never reused): roll it back rather than wait forever.
            got = self._open(HEAD_KEY, Head, "head")
            if got is None or got[0].version <= st.awaiting or got[0].base_version >= st.awaiting:
                return False
            d = Decision(run_id=st.run_id, version=st.awaiting, base_version=got[0].base_version, commit=False,
                         receivers=(), reason=f"no decision record; HEAD v{got[0].version} has base "
                                              f"v{got[0].base_version}")
        if d.commit and st.tentative == d.version and d.manifest_digest != st.tentative_digest:
            # committed bytes other than the ones applied under this number (a restarted
            # trainer reused it): what this receiver applied was not committed
            self.rx.rollback()
            self._log({"receiver": self.receiver_id, "version": d.version, "event": "rolled back",
                       "reason": "the committed manifest is not the one applied"})
            st.tentative, st.awaiting, st.handled = None, None, st.committed
            return True
        if d.commit:
            if st.tentative == d.version:
                self.rx.settle()
                st.committed, st.tentative = d.version, None
            event = "committed"
        else:
            if st.tentative == d.version:
                t0 = time.perf_counter()
                self.rx.rollback()
                st.tentative = None
                event = f"rolled back in {time.perf_counter() - t0:.3f}s"
            else:
                event = "aborted"
        self._log({"receiver": self.receiver_id, "version": d.version, "decision": "commit" if d.commit else "abort",
                   "event": event, "held": st.committed, "reason": d.reason})
        st.decided = max(st.decided, d.version)
        st.awaiting = None
        return True

    def _chain(self, target: int) -> list[Decision] | None:
        """Commit decisions after ``committed`` up to ``target``, oldest first (None while
        the chain is not complete or not this run's)."""
        out = []
        v = target
        while v > self.state.committed:
            d = self._decision(v)
            if d is None or not d.commit:
                return None
            out.append(d)
            v = d.base_version
        return out[::-1] if v == self.state.committed else None

    def _catch_up(self, target: int) -> bool:
        chain = self._chain(target)
        if chain is None:
            return False
        manifests = []
        for d in chain:
            got = self._manifest(d.version)
            if got is None:
                return False
            if got[1] != d.manifest_digest:
                self._log({"receiver": self.receiver_id, "ignored": manifest_key(d.version),
                           "error": "not the manifest the trainer committed (digest differs)"})
                return False
            manifests.append(got[0])
        t0 = time.perf_counter()
        try:
            if len(manifests) > self.compose_after:
                stats = self.rx.apply_chain(manifests)
                mode = "composed"
            else:
                for m in manifests:
                    self.rx.apply_committed(m)
                stats, mode = {}, "replayed"
        except TransportError as e:
            # chunks are fetched before a version's writes: keep what was replayed, retry the rest
            held = getattr(self.rx, "held_version", None)
            if held in chain:
                self.state.committed = self.state.handled = held
                self.state.decided = max(self.state.decided, held)
            self._log({"receiver": self.receiver_id, "event": "catch-up interrupted", "held": self.state.committed,
                       "store_error": str(e)})
            return False
        except DcrError as e:
            raise ProtocolError(f"receiver {self.receiver_id}: cannot catch up from v{self.state.committed} to "
                                f"v{target} ({type(e).__name__}: {e}); reload from a newer checkpoint") from None
        st = self.state
        st.committed = st.handled = target
        st.decided = max(st.decided, target)
        self._log({"receiver": self.receiver_id, "event": "caught up", "mode": mode,
                   "versions": [d.version for d in chain],
                   "seconds": round(time.perf_counter() - t0, 4),
                   **{k: v for k, v in stats.items() if k in ("composed_changed", "changed", "wire_bytes")}})
        return True

    def _answer(self, head: Head) -> bool:
        st = self.state
        got = self._manifest(head.version)
        if got is None:
            return False
        manifest, digest = got
        if manifest.base_version != st.committed:
            ack = Ack(run_id=st.run_id, receiver=self.receiver_id, version=manifest.version, ok=False,
                      held_version=st.committed,
                      error=f"manifest v{manifest.version} has base version {manifest.base_version}, "
                            f"this receiver holds version {st.committed}")
        else:
            try:
                ack = self.rx.apply_tentative(manifest, digest, run_id=st.run_id)
            except TransportError as e:  # the store failed while fetching: a refusal, not a crash
                if getattr(self.rx, "held_version", st.committed) == manifest.version:
                    self.rx.rollback()  # failed after the writes (e.g. fetching the dense reference)
                ack = Ack(run_id=st.run_id, receiver=self.receiver_id, version=manifest.version, ok=False,
                          held_version=st.committed, error=f"store error: {e}")
            if ack.ok:
                st.tentative, st.tentative_digest = manifest.version, digest
        try:
            self.store.put(ack_key(self.receiver_id, manifest.version), ack.to_json(self.sealer))
        except TransportError as e:
            # the trainer misses this ack and aborts at its timeout; the decision settles us
            self._log({"receiver": self.receiver_id, "version": manifest.version, "store_error": "ack put",
                       "error": str(e)})
        st.handled = manifest.version
        st.awaiting = manifest.version
        self._log({"receiver": self.receiver_id, "version": manifest.version, "ok": ack.ok,
                   "held": st.committed, "tentative": st.tentative, "error": ack.error, **ack.stats})
        return True

    def step(self) -> bool:
        """One poll; True when something happened (so the caller need not sleep)."""
        st = self.state
        if st.awaiting is not None:
            return self._settle()
        got = self._open(HEAD_KEY, Head, "head")
        if got is None:
            return False
        head = got[0]
        if head.version <= st.handled:
            return False
        if head.base_version > st.committed:
            return self._catch_up(head.base_version)
        if head.base_version < st.committed:
            # the trainer's base is older than what we committed: impossible unless the
            # store was rewritten; refuse this version loudly rather than apply it
            raise ProtocolError(f"HEAD v{head.version} has base {head.base_version}, older than the version "
                                f"{st.committed} this receiver committed")
        return self._answer(head)

    def run(self, *, until_version: int | None = None, timeout_s: float | None = None, poll_s: float = 0.05) -> int:
        """Follow the run until the decision on a version >= ``until_version`` is known.
        ``timeout_s`` bounds each wait for progress.  Returns the committed version."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while until_version is None or self.state.decided < until_version:
            if self.step():
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                continue
            if deadline is not None and time.monotonic() > deadline:
                what = (f"decision on v{self.state.awaiting}" if self.state.awaiting is not None
                        else f"a version after v{self.state.handled}")
                raise TimeoutError(f"receiver {self.receiver_id}: no {what} within {timeout_s}s")
            time.sleep(poll_s)
        return self.state.committed
