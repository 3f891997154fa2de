"""Receiver side of the protocol: the version state machine (``protocol/commit.py`` is the
trainer's half).

A receiver holds a **committed** version ``c`` -- with ``D(c)``, the digest of the signed
commit decision it settled on (of ``init/INIT.json`` for version 0) -- and at most one
**tentative** version ``t`` (applied, acknowledged, waiting for the trainer's decision).
The signed documents form a chain: every manifest names its base version AND that base's
decision digest, every commit decision names its manifest's digest.  ``HEAD.json`` is only
a hint of which version to look at next; what the receiver does is settled by the chain.
One ``step``:

1. A version answered and not yet decided: read its ``DECISION.json``.  Commit: ``c = t``.
   Abort: roll ``t`` back in place (undo journal) to ``c``, bit-exact.  No decision (not
   yet written, or deleted): if a newer version's manifest and the decisions below it
   lead to a base older than ``t`` without passing through ``t``, ``t`` is not on the
   chain and never will be (versions are never reused): roll it back as aborted.
   Otherwise wait; the runtime keeps serving ``t``, never after learning it was aborted.
2. ``HEAD.json`` names a version not handled yet: open its manifest (base ``b``).
3. ``b > c`` (the receiver restarted or fell behind): walk the signed decisions back from
   ``b`` to ``c``, checking every digest link, and replay those committed versions
   (catch-up; the trainer does not wait for it).
4. ``b == c`` and the manifest's base digest is ``D(c)``: fetch, check and apply the
   version tentatively; write a sealed ack (``ok`` only if applied and, when verifying,
   bit-exact) or a refusal.
5. Anything else (``b < c``, a base digest that is not ``D(c)``, a chain that skips ``c``)
   does not extend what this receiver committed: it writes a refusal that names both
   versions and keeps serving ``c``.  A store document never makes a receiver exit; the
   run itself can: versions the trainer signed that this receiver cannot apply for the
   same reason (``receiver/engine.Misfit``: another model, records of tensors its runtime
   does not have, in chunks whose digests the signed manifest lists) end it after
   ``max_refusals`` in a row (:class:`RefusedTooOften`) -- what a store writer without the
   key cannot cause: a corrupt, missing or foreign chunk is never a misfit.
6. Idle (nothing awaiting a decision, no tentative version, ``HEAD.json`` naming nothing
   new): streaming receive (``receiver/stream.py``): the receiver lists the chunks that
   appeared for the next versions and fetches and decodes them, on top of ``c``, on its own
   threads, before their manifest; step 4 uses them only where the signed manifest lists
   the same bytes.

Elastic membership (``join``): a receiver that is not a member -- new, or evicted, as the
signed decisions it reads say -- writes a sealed join request naming the committed
version it holds and that version's decision digest, once per committed version while
it is current (``HEAD.json`` names nothing newer, or a manifest based on that version).
Member or not, it applies and acknowledges every version on its chain the same way; the
trainer counts its ack once it is admitted.

Every document is read through ``protocol/reader.py`` (bounded, cached by object
identity) and must open with the run's key and name the run this receiver follows;
anything else is logged once and ignored, so a store writer without the key can delay a
receiver but not make it apply, keep or roll back anything.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from nemo_dcr.errors import DcrError, ProtocolError, TransportError
from nemo_dcr.events import event_line, size_text
from nemo_dcr.protocol.manifest import (
    HEAD_KEY,
    Ack,
    Decision,
    Head,
    JoinRequest,
    Manifest,
    ack_key,
    decision_key,
    join_key,
    manifest_key,
)
from nemo_dcr.protocol.reader import DocReader
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.failover import answered_by
from nemo_dcr.transport.store import ObjectStore


@dataclass
class FollowerState:
    run_id: str
    committed: int = 0
    committed_digest: str = ""
    """Digest of the signed decision that committed ``committed`` (``init/INIT.json``'s for 0)."""
    tentative: int | None = None
    tentative_digest: str = ""
    """Digest of the manifest applied as ``tentative``."""
    awaiting: int | None = None
    """Version acknowledged or refused whose decision is not known yet."""
    handled: int = 0
    """Highest version this receiver answered (acked, refused) or replayed."""
    decided: int = 0
    """Highest version whose decision this receiver has seen."""




ACKS_EVERYWHERE_FOR = 16
"""After an ok ack this receiver wrote was lost (the trainer's abort names it), the acks of
this many later versions are written through every upstream of its list, not only the first
(``FailoverStore.put_everywhere``): the relay it wrote through may have been honest and
forwarded to a liar above it, and a demotion per relay on that path would cost a version
each.  What it costs: one small write per upstream per version in that window.  0: off."""


HEAD_PROBE_S = 10.0
"""How long ``HEAD.json`` may name nothing newer than what a receiver answered before it
asks the other upstreams of its list for a newer one (once; then again every this long
while it stays so).  What a relay that freezes or hides ``HEAD.json`` costs: at most this
long per version it hides (it is then demoted for the list's ``retry_after_s``); what the
probe costs a quiet run: one read of ``HEAD.json`` per upstream per this long."""


def _names(version: int):
    """A document's check: it names ``version`` (a genuine document of another version under
    this key is refused, and asked of the next upstream)."""
    return lambda doc: None if doc.version == version else f"names version {doc.version}, not {version}"


def _ack_missed(reason: str, receiver_id: str) -> bool:
    """Whether an abort's reason names ``receiver_id``'s ack as not read by the trainer.
    The reason is the trainer's ``; ``-joined ``"<receiver>: <why>"`` list
    (``CommitCoordinator.collect_acks``); a receiver that acked ``ok`` appears in it only
    when its ack was missing (``no acknowledgement``), unreadable (``ack rejected: ...``,
    e.g. flipped on the way) or not read (``store error reading its ack``): a valid ``ok``
    ack adds nothing.  The decision carries no per-receiver field, so this is its text."""
    return any(part.startswith(f"{receiver_id}: ") for part in reason.split("; "))


class _Broken(ProtocolError):
    """The chain from a manifest does not lead to what this receiver committed."""


class RefusedTooOften(ProtocolError):
    """This receiver refused ``max_refusals`` versions in a row for the same reason that
    says it does not fit the run (``receiver/engine.Misfit``): it ends rather than refuse
    every version of the run (the trainer aborts each) forever.  One line: the receiver, the
    versions, the last refusal and its fix."""


class Follower:
    """Drives a ``Receiver`` (``receiver/engine.py``: fetch, apply, rollback) through the
    protocol.  ``log(dict)`` gets one JSON-able event per acknowledged, refused, decided,
    rolled-back or replayed version, and per ignored object identity."""

    def __init__(self, receiver, store: ObjectStore, sealer: Sealer, run_id: str, *, receiver_id: str,
                 committed: int = 0, committed_digest: str, compose_after: int = 4, log=None, join: bool = False,
                 max_refusals: int = 0):
        """``committed_digest``: the chain's link for ``committed`` (``init/INIT.json``'s
        digest for version 0: ``protocol.version0.verify_init_dir`` returns it).
        ``compose_after``: catching up through more committed versions than this applies
        them as one composed delta (``receiver/catchup.py``) instead of one by one.
        ``join``: ask to become a member (elastic membership) whenever the signed decisions
        do not name this receiver as one (also settable later as ``follower.join``).
        ``max_refusals``: after this many versions in a row refused for the same misfit cause
        (the receiver's ``misfit``: another model, tensors its runtime does not have; never
        a store fault), :meth:`run` raises :class:`RefusedTooOften`; 0: never."""
        self.rx = receiver
        self.store = store
        self.sealer = sealer
        self.receiver_id = receiver_id
        self.compose_after = compose_after
        self.state = FollowerState(run_id=run_id, committed=committed, committed_digest=committed_digest,
                                   handled=committed, decided=committed)
        self.stride = 1
        """Gap between the last two versions this receiver answered (versions are step
        numbers; a trainer refitting every k steps publishes every k-th): streaming receive
        looks this far ahead."""
        self._chain_head: Decision | None = None  # the newest decision of the last catch-up's chain
        self._prefetch_error = ""
        self.prefetched = 0
        """Chunks streaming receive decoded so far (progress, for ``run``'s timeout)."""
        self.join = join
        self.member: bool | None = None
        """Whether the last signed decision this receiver read names it a member (None: none read yet)."""
        self._requested: tuple[int, str] | None = None  # (version, digest) of the last join request written
        self._log = log or (lambda event: print(event_line(event), flush=True))
        self.docs = DocReader(store, sealer, run_id, log=self._log, who={"receiver": receiver_id})
        self._head_moved = time.monotonic()  # when HEAD.json last named a version not answered yet
        self._acked: dict[int, str] = {}  # version -> uri of the upstream that took its ok ack (last 2)
        self._acks_everywhere_until = 0  # acks of versions up to this go through every upstream
        self.max_refusals = max_refusals
        self._misfits: list[int] = []  # versions refused in a row for self._misfit_cause
        self._misfit_cause: str | None = None
        self.applied = 0
        """Versions this receiver applied: acknowledged ``ok``, or replayed on catch-up."""
        self.refusals = 0
        """Versions this receiver refused."""
        self.refused: list[tuple[int, str]] = []
        """The last 8 versions this receiver refused, with the refusal."""
        self._answering: tuple[int, float, int] | None = None  # (version, perf_counter, wire bytes): _decided

    # ------------------------------------------------------------------ reads
    def _decision(self, version: int) -> tuple[Decision, str] | None:
        """(decision, digest of its bytes) of ``version``, if present and authentic.  Every
        decision this follower reads is one its signed evidence says exists or will (a
        version it answered, a base a signed manifest names): one that an upstream does
        not serve, or serves for another version, is asked of the next (``DocReader``)."""
        got = self.docs.read(decision_key(version), Decision, check=_names(version), expect=True)
        return None if got is None else (got.doc, got.digest)

    def _manifest(self, version: int) -> tuple[Manifest, str] | None:
        """(manifest, digest) of ``version``; named by a signed ``HEAD.json`` or decision, so
        expected like a decision."""
        got = self.docs.read(manifest_key(version), Manifest, check=_names(version), expect=True)
        return None if got is None else (got.doc, got.digest)

    def _head(self) -> Head | None:
        """``HEAD.json``; when it has named nothing newer than what this receiver answered
        for ``HEAD_PROBE_S``, the other upstreams are asked once for a newer one (a relay
        that serves a frozen or hidden ``HEAD.json`` is left), and again every
        ``HEAD_PROBE_S`` while it stays so."""
        got = self.docs.read(HEAD_KEY, Head)
        handled = self.state.handled
        if got is not None and got.doc.version > handled:
            self._head_moved = time.monotonic()
            return got.doc
        now = time.monotonic()
        if now - self._head_moved < HEAD_PROBE_S:
            return None if got is None else got.doc
        self._head_moved = now
        newer = self.docs.probe(HEAD_KEY, Head, check=lambda h: None if h.version > handled
                                else f"names v{h.version}, not newer than v{handled}")
        if newer is not None:
            return newer.doc
        return None if got is None else got.doc

    # ------------------------------------------------------------------ membership
    def _membership(self, d: Decision) -> None:
        """What a signed decision says about this receiver's membership (events on change)."""
        me = self.receiver_id
        if me in d.joined and me in d.receivers:
            self._log({"receiver": me, "event": "joined", "version": d.version, "commit": d.commit})
        if me in d.evicted:
            self._log({"receiver": me, "event": "evicted", "version": d.version, "commit": d.commit,
                       "members": list(d.receivers)})
        self.member = me in d.receivers

    def _request_join(self) -> None:
        """Write a join request for the committed version held (once per version) when
        joining is on and the decisions read so far do not name this receiver a member.
        Called only where the held version is the trainer's latest commit as far as this
        receiver can tell (nothing newer published, or a manifest based on it)."""
        st = self.state
        if not self.join or self.member or st.awaiting is not None or st.tentative is not None:
            return
        held = (st.committed, st.committed_digest)
        if held == self._requested:
            return
        req = JoinRequest(run_id=st.run_id, receiver=self.receiver_id, held_version=st.committed,
                          held_digest=st.committed_digest)
        try:
            self.store.put(join_key(self.receiver_id), req.to_json(self.sealer))
        except TransportError as e:  # asked again at the next step
            self._log({"receiver": self.receiver_id, "store_error": "join request put", "error": str(e)})
            return
        self._requested = held
        self._log({"receiver": self.receiver_id, "event": "join requested", "held": st.committed})

    # ------------------------------------------------------------------ steps
    def _decided(self, d: Decision) -> dict:
        """The decision line's summary for people (``nemo-dcr receive``'s log):
        ``"line": "v3 committed by r0,r1 in 1.2 s, 5.1 MB"``, with the seconds from this
        receiver starting on the version's manifest to reading its decision (absent for a
        version it did not answer) and the version's chunk bytes."""
        got = self._answering if self._answering and self._answering[0] == d.version else None
        took = f" in {time.perf_counter() - got[1]:.1f} s" if got else ""
        size = f", {size_text(got[2])}" if got else ""
        what = (f"committed by {','.join(d.receivers) or 'no receiver'}" if d.commit
                else f"aborted ({' '.join(d.reason.split()) or 'no reason recorded'})")
        return {"by": list(d.receivers), "line": f"v{d.version} {what}{took}{size}"}

    def _below(self, version: int, floor: int) -> bool | None:
        """Walking commit decisions down from ``version``: True when the chain passes below
        ``floor`` without touching it, False when it reaches ``floor``, None while a
        decision on the way cannot be read (missing, or not yet written)."""
        v = version
        while v > floor:
            got = self._decision(v)
            if got is None or not got[0].commit:
                return None
            v = got[0].base_version
        return v < floor

    def _settle(self) -> bool:
        """Step 1; True when the awaited version was decided."""
        st = self.state
        got = self._decision(st.awaiting)
        digest = ""
        if got is not None:
            d, digest = got
            self._membership(d)
        else:
            # No decision record (the trainer failed before writing it, or it was deleted).
            # A signed manifest of a later version whose chain passes below the awaited one
            # proves it was not committed and never will be (numbers are never reused).
            head = self.docs.read(HEAD_KEY, Head)
            if head is None or head.doc.version <= st.awaiting:
                return False
            newer = self._manifest(head.doc.version)
            if newer is None:
                return False
            m = newer[0]
            skipped = m.base_version < st.awaiting or (m.base_version > st.awaiting
                                                       and self._below(m.base_version, st.awaiting))
            if not skipped:
                return False
            d = Decision(run_id=st.run_id, version=st.awaiting, base_version=min(st.committed, st.awaiting - 1),
                         commit=False, receivers=(),
                         reason=f"no decision record; v{m.version}'s chain does not pass through v{st.awaiting}")
        if not d.commit and d.version in self._acked and _ack_missed(d.reason, self.receiver_id):
            self._ack_lost(d.version)
        if d.commit and st.tentative == d.version and d.manifest_digest != st.tentative_digest:
            # committed bytes other than the ones applied under this number: what this
            # receiver applied was not committed
            self.rx.rollback()
            self._log({"receiver": self.receiver_id, "version": d.version, "event": "rolled back",
                       "reason": "the committed manifest is not the one applied"})
            st.tentative, st.awaiting, st.handled = None, None, st.committed
            return True
        if d.commit:
            if st.tentative == d.version:
                self.rx.settle(digest)
                st.committed, st.committed_digest, st.tentative = d.version, digest, None
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
                   "event": event, "held": st.committed, "reason": d.reason, **self._decided(d)})
        st.decided = max(st.decided, d.version)
        st.awaiting = None
        return True

    def _chain(self, target: int, target_digest: str) -> list[Manifest] | None:
        """The committed manifests after ``committed`` up to ``target`` (whose decision must
        hash to ``target_digest``), oldest first, every link checked: each decision is a
        signed commit with the digest the next manifest names, each manifest the one its
        decision committed, and the walk ends exactly at the held version and digest.
        None while a link cannot be read yet; raises ``_Broken`` when the links disagree."""
        st = self.state
        out = []
        v, want = target, target_digest
        while v > st.committed:
            got = self._decision(v)
            if got is None:
                return None
            d, digest = got
            if digest != want:
                raise _Broken(f"v{v}'s decision is not the one the next version names")
            if v == target:
                self._chain_head = d
            if not d.commit:
                raise _Broken(f"v{v} was aborted, yet a later version is based on it")
            mgot = self._manifest(v)
            if mgot is None:
                return None
            m, mdigest = mgot
            if mdigest != d.manifest_digest:
                raise _Broken(f"v{v}'s manifest is not the one its decision committed")
            out.append(m)
            v, want = m.base_version, m.base_digest
        if v != st.committed or want != st.committed_digest:
            raise _Broken(f"the chain reaches v{v}, not the v{st.committed} this receiver committed"
                          if v != st.committed else f"its v{v} is not the v{v} this receiver committed")
        return out[::-1]

    def _catch_up(self, head: Manifest) -> bool:
        self._chain_head = None
        try:
            manifests = self._chain(head.base_version, head.base_digest)
        except _Broken as e:
            return self._refuse(head, str(e))
        if manifests is None:
            return False
        target = manifests[-1].version
        t0 = time.perf_counter()
        versions = [m.version for m in manifests]
        digest = head.base_digest
        try:
            if len(manifests) > self.compose_after:
                stats = self.rx.apply_chain(manifests, digest)
                mode = "composed"
            else:
                stats, mode = {}, "replayed"
                for m, next_base in zip(manifests, [*(n.base_digest for n in manifests[1:]), digest]):
                    self.rx.apply_committed(m, next_base)
                    self.state.committed, self.state.committed_digest = m.version, next_base
                    self.state.handled = max(self.state.handled, m.version)
                    self.state.decided = max(self.state.decided, m.version)
        except TransportError as e:
            # chunks are fetched before a version's writes: keep what was replayed, retry the rest
            self._log({"receiver": self.receiver_id, "event": "catch-up interrupted", "held": self.state.committed,
                       "store_error": str(e)})
            return False
        except DcrError as e:
            # committed versions that do not apply: this receiver cannot follow the run any
            # further from here (a store writer deleted or broke a committed chunk); it says
            # so and keeps serving what it holds
            return self._refuse(head, f"cannot catch up from v{self.state.committed} to v{target} "
                                      f"({type(e).__name__}: {e}); reload from a newer checkpoint")
        self.applied += len(manifests)
        st = self.state
        st.committed, st.committed_digest = target, digest
        st.handled = max(st.handled, target)
        st.decided = max(st.decided, target)
        if self._chain_head is not None:
            self._membership(self._chain_head)
        self._log({"receiver": self.receiver_id, "event": "caught up", "mode": mode, "versions": versions,
                   "seconds": round(time.perf_counter() - t0, 4),
                   **{k: v for k, v in stats.items() if k in ("composed_changed", "changed", "wire_bytes")}})
        return True

    def _ack_lost(self, version: int) -> None:
        """The trainer aborted ``version`` without this receiver's ``ok`` ack, which it wrote:
        the upstream that took it (a relay that dropped or altered it) is left for the next
        one, through which the next versions' acks go."""
        uri = self._acked.pop(version)
        demote = getattr(self.store, "demote", None)
        left = bool(uri) and demote is not None and demote(uri, f"the trainer did not read this receiver's "
                                                               f"ack of v{version} written through it")
        self._acks_everywhere_until = version + ACKS_EVERYWHERE_FOR
        self._log({"receiver": self.receiver_id, "version": version, "event": "ack lost",
                   "written_through": uri, "left": left})

    def _put_ack(self, ack: Ack) -> None:
        key, data = ack_key(self.receiver_id, ack.version), ack.to_json(self.sealer)
        everywhere = getattr(self.store, "put_everywhere", None)
        try:
            if everywhere is not None and ack.version <= self._acks_everywhere_until:
                everywhere(key, data)
            else:
                self.store.put(key, data)
            if ack.ok:
                self._acked[ack.version] = answered_by(self.store)
                while len(self._acked) > 2:
                    del self._acked[min(self._acked)]
        except TransportError as e:
            # the trainer misses this ack and aborts at its timeout; the decision settles us
            self._log({"receiver": self.receiver_id, "version": ack.version, "store_error": "ack put",
                       "error": str(e)})

    def _refuse(self, manifest: Manifest, why: str) -> bool:
        """Answer a version that does not extend what this receiver committed: a refusal
        naming both versions; the receiver keeps serving ``committed``."""
        st = self.state
        error = (f"v{manifest.version} (base v{manifest.base_version}) does not extend v{st.committed}, which "
                 f"this receiver committed: {why}")
        self._put_ack(Ack(run_id=st.run_id, receiver=self.receiver_id, version=manifest.version, ok=False,
                          held_version=st.committed, error=error))
        st.handled = max(st.handled, manifest.version)
        st.awaiting = manifest.version  # its decision (an abort) is logged like any other
        self._note_refusal(manifest.version, error)
        self._log({"receiver": self.receiver_id, "version": manifest.version, "ok": False, "held": st.committed,
                   "tentative": st.tentative, "error": error})
        return True

    def _note_refusal(self, version: int, error: str) -> None:
        self.refusals += 1
        self.refused = [*self.refused[-7:], (version, error)]

    def _count_misfit(self, version: int, ack: Ack) -> None:
        """Count a version refused for a misfit cause (``rx.misfit``), after its refusal was
        written and logged; :class:`RefusedTooOften` at the ``max_refusals``-th in a row of the
        same cause.  An ``ok`` ack resets the count; a refusal of another kind (a store fault)
        leaves it as it is."""
        if ack.ok:
            self._misfits, self._misfit_cause = [], None
            return
        misfit = getattr(self.rx, "misfit", None)
        cause = getattr(misfit, "cause", None)
        if cause is None:
            return
        if cause != self._misfit_cause:
            self._misfits, self._misfit_cause = [], cause
        self._misfits.append(version)
        if self.max_refusals and len(self._misfits) >= self.max_refusals:
            versions = ", ".join(f"v{v}" for v in self._misfits)
            raise RefusedTooOften(f"receiver {self.receiver_id} refused {len(self._misfits)} versions in a row for "
                                  f"the same reason ({versions}; max_refusals={self.max_refusals}): "
                                  f"{' '.join(str(misfit).split())}")

    def _prefetch(self) -> bool:
        """Step 6 (streaming receive): list and submit new chunks, count those decoded since.
        False even when some were: they download and decode on their own threads, so nothing
        is gained by listing again before the poll interval (``prefetched`` is the progress)."""
        st = self.state
        if st.tentative is not None:
            return False
        try:
            self.prefetched += self.rx.prefetch(st.run_id, handled=st.handled, stride=self.stride)
            return False
        except TransportError as e:  # the normal path fetches after the manifest; log a new error once
            if str(e) != self._prefetch_error:
                self._prefetch_error = str(e)
                self._log({"receiver": self.receiver_id, "event": "prefetch failed", "store_error": str(e)})
            return False

    def _answer(self, manifest: Manifest, digest: str) -> bool:
        st = self.state
        self._answering = (manifest.version, time.perf_counter(), manifest.wire_bytes)
        if manifest.version > st.handled:
            self.stride = manifest.version - st.handled
        try:
            ack = self.rx.apply_tentative(manifest, digest, run_id=st.run_id)
        except TransportError as e:  # the store failed while fetching: a refusal, not a crash
            if getattr(self.rx, "held_version", st.committed) == manifest.version:
                self.rx.rollback()  # failed after the writes (e.g. fetching the dense reference)
            ack = Ack(run_id=st.run_id, receiver=self.receiver_id, version=manifest.version, ok=False,
                      held_version=st.committed, error=f"store error: {e}")
        if ack.ok:
            st.tentative, st.tentative_digest = manifest.version, digest
            self.applied += 1
        else:
            self._note_refusal(manifest.version, ack.error)
        self._put_ack(ack)
        st.handled = manifest.version
        st.awaiting = manifest.version
        self._log({"receiver": self.receiver_id, "version": manifest.version, "ok": ack.ok,
                   "held": st.committed, "tentative": st.tentative, "error": ack.error, **ack.stats})
        self._count_misfit(manifest.version, ack)
        return True

    def step(self) -> bool:
        """One poll; True when something happened (so the caller need not sleep)."""
        st = self.state
        if st.awaiting is not None:
            self._head_moved = time.monotonic()  # not idle: HEAD_PROBE_S counts from the settling
            return self._settle()
        head = self._head()
        if head is None or head.version <= st.handled:
            self._request_join()  # nothing newer published: the held version is the latest commit
            return self._prefetch()
        got = self._manifest(head.version)
        if got is None:
            return False
        manifest, digest = got
        if manifest.base_version > st.committed:
            return self._catch_up(manifest)
        if manifest.base_version < st.committed:
            return self._refuse(manifest, f"its base v{manifest.base_version} is older")
        if manifest.base_digest != st.committed_digest:
            return self._refuse(manifest, f"its base v{manifest.base_version} is another v{st.committed} "
                                          f"({manifest.base_digest} is not {st.committed_digest})")
        self._request_join()  # the trainer's base is the held version
        return self._answer(manifest, digest)

    def run(self, *, until_version: int | None = None, timeout_s: float | None = None, poll_s: float = 0.05) -> int:
        """Follow the run until the decision on a version >= ``until_version`` is known.
        ``timeout_s`` bounds each wait for progress.  Returns the committed version."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while until_version is None or self.state.decided < until_version:
            prefetched = self.prefetched
            stepped = self.step()
            if stepped or self.prefetched != prefetched:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
            if stepped:
                continue
            if deadline is not None and time.monotonic() > deadline:
                what = (f"decision on v{self.state.awaiting}" if self.state.awaiting is not None
                        else f"version after v{self.state.handled}")
                raise TimeoutError(f"receiver {self.receiver_id}: no {what} within {timeout_s}s")
            time.sleep(poll_s)
        return self.state.committed
