"""Trainer side of the joint commit (rank 0): publish, collect acks, decide.

For version ``v`` (delta from the committed base ``b``)::

    MANIFEST.json (sealed)  ->  HEAD.json  ->  wait for every receiver's ack
      all ok   -> DECISION.json {commit}  -> COMMITTED.json -> baselines advance to v
      otherwise -> DECISION.json {abort, reason} -> baselines stay at b; receivers that
                   applied v roll it back; v+1 is diffed against b again

An ack counts only when it opens with the run's key and names this run, this receiver,
this version and the digest of the manifest we published.  Anything else under the ack's
key (unsigned, forged, malformed, another run's or version's) is ignored while waiting --
the receiver's own ack may still overwrite it -- and, if nothing valid arrives before the
deadline, reported as that receiver's refusal with the reason.  Never a crash.

**Membership** (``membership``).  ``static``: the members are ``receivers`` for the whole
run.  ``elastic`` (docs/protocol.md, "Elastic membership"): they start as ``receivers`` (or,
resuming, as the signed commit decision of the base names them); at each version the
coordinator reads the join requests (``acks/join.d/<receiver>.json``, bounded) and admits
each signed one of this run whose held version and digest are a commit it knows -- from
that version on its ack is required -- and evicts a member that had no valid ack
``evict_after`` versions in a row (a signed refusal is an answer, not a miss).  The version
commits when every member after these changes acked ``ok`` and there are at least
``min_receivers`` of them.  The decision names the members it covers, who joined and who
was evicted; only a signed decision changes the member set a receiver sees.

What a failed version does to training is ``RefusalPolicy``: ``retry`` (default) keeps
training and publishes the next version against the same base, failing loudly only after
``max_consecutive_failures`` aborted versions in a row; ``fail`` raises at the first.
"""
from __future__ import annotations

import json
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from nemo_dcr.errors import DcrError, FormatError, ValidationError
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    DOC_LIMITS,
    HEAD_KEY,
    JOIN_PREFIX,
    MAX_RECEIVERS,
    Ack,
    Committed,
    Decision,
    Head,
    JoinRequest,
    Manifest,
    ack_key,
    decision_key,
    doc_digest,
    join_key_receiver,
    manifest_key,
)
from nemo_dcr.protocol.reader import DocReader
from nemo_dcr.protocol.history import committed_members
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore

REFUSAL_POLICIES = ("retry", "fail")
MEMBERSHIPS = ("static", "elastic")
JOIN_SCAN_KEYS = 1024
"""Join-request keys looked at per version (of the sorted listing of ``acks/join.d/``)."""
KNOWN_COMMITS = 16
"""Recent committed versions (with their decision digests) a join request may name as held."""


@dataclass
class AckOutcome:
    ok: bool
    reason: str
    acks: list[dict] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    """One line per ack object that was read and not accepted (forged, foreign, ...)."""
    members: tuple[str, ...] = ()
    """The receivers this version's decision covers (elastic membership: after joins and
    evictions; static: ``receivers``)."""
    joined: tuple[str, ...] = ()
    """Receivers admitted at this version (elastic membership)."""
    evicted: tuple[str, ...] = ()
    """Receivers evicted at this version (elastic membership)."""


class CommitCoordinator:
    def __init__(self, store: ObjectStore, sealer: Sealer, run_id: str, receivers: tuple[str, ...], *,
                 ack_timeout_s: float, poll_s: float = 0.05, membership: str = "static", min_receivers: int = 1,
                 evict_after: int = 3, log=None):
        """``receivers``: the members (static), or the initial members of a new run (elastic;
        a resumed run takes them from the signed decision of its committed version at the
        first :meth:`publish`).  ``log(dict)``: membership events and ignored join requests
        (default: one JSON line on stderr)."""
        if membership not in MEMBERSHIPS:
            raise ValidationError(f"membership must be one of {MEMBERSHIPS}, got {membership!r}")
        if min_receivers < 1 or evict_after < 1:
            raise ValidationError(f"min_receivers and evict_after must be >= 1, got {min_receivers}, {evict_after}")
        self.store = store
        self.sealer = sealer
        self.run_id = run_id
        self.receivers = tuple(receivers)
        """The current members: whose acks a commit needs (elastic: changes with joins and evictions)."""
        self.ack_timeout_s = ack_timeout_s
        self.poll_s = poll_s
        self.membership = membership
        self.min_receivers = min_receivers
        self.evict_after = evict_after
        self._log = log or (lambda event: print("nemo_dcr: " + json.dumps(event), file=sys.stderr, flush=True))
        self._recovered = membership == "static"
        self._published: tuple[int, int, str] | None = None  # (version, base_version, base_digest)
        self._known: OrderedDict[int, str] = OrderedDict()  # committed version -> its decision's digest
        self._misses: dict[str, int] = {}  # member -> versions in a row without a valid ack
        self._evicted_at: dict[str, int] = {}  # receiver -> version it was last evicted at
        self._change: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None  # (version, joined, evicted)
        self._joins = DocReader(store, sealer, run_id, log=self._log, who={"trainer": "join requests"})
        self._list_error = ""

    @property
    def elastic(self) -> bool:
        return self.membership == "elastic"

    def _know(self, version: int, digest: str) -> None:
        self._known[version] = digest
        self._known.move_to_end(version)
        while len(self._known) > KNOWN_COMMITS:
            self._known.popitem(last=False)

    def publish(self, manifest: Manifest) -> str:
        """Write the sealed manifest, then point ``HEAD.json`` at it; returns its digest.

        Elastic, at the first version: the members are the ones the signed commit decision
        of the manifest's base names (the resumed run's member set; a new run's base is
        version 0, whose members are ``receivers``).  A decision that cannot be read raises
        before anything is written: the version aborts, the next one tries again."""
        if not self._recovered:
            members = committed_members(self.store, self.sealer, self.run_id, manifest.base_version,
                                        manifest.base_digest)
            if members is not None:
                self.receivers = members
                self._log({"event": "members recovered", "version": manifest.base_version,
                           "members": list(members)})
            self._recovered = True
        self._know(manifest.base_version, manifest.base_digest)
        self._published = (manifest.version, manifest.base_version, manifest.base_digest)
        data = manifest.to_json(self.sealer)
        self.store.put(manifest_key(manifest.version), data)
        self.store.put(HEAD_KEY, Head(self.run_id, manifest.version, manifest.base_version).to_json(self.sealer))
        return doc_digest(data)

    def _admit(self, version: int) -> tuple[str, ...]:
        """Elastic: the receivers whose join request is admitted at ``version``.

        Looked at: the first ``JOIN_SCAN_KEYS`` keys of the sorted listing of
        ``acks/join.d/`` (a bounded listing: the store is asked for no more), each read
        through a ``DocReader`` (size cap, bounded parser, the run's key, this run; cached by
        object identity, a rejected object logged once).
        Admitted: a request of a receiver that is not a member, naming itself, whose held
        version and digest are a commit this coordinator knows (the published version's
        base, or one of the last ``KNOWN_COMMITS`` it decided) and not older than the
        version it was last evicted at (a replayed earlier request is refused), while the
        members stay at most ``MAX_RECEIVERS``."""
        if self._published is None or self._published[0] != version:
            return ()
        try:
            keys = self.store.list(JOIN_PREFIX, limit=JOIN_SCAN_KEYS)  # however many were planted
        except DcrError as e:  # a failing store: nobody joins at this version
            if str(e) != self._list_error:
                self._list_error = str(e)
                self._log({"event": "join requests not listed", "version": version, "store_error": str(e)})
            return ()
        admitted: list[str] = []
        for key in keys:
            rid = join_key_receiver(key)
            if rid is None or rid in self.receivers:
                continue
            if len(self.receivers) + len(admitted) >= MAX_RECEIVERS:
                break
            got = self._joins.read(key, JoinRequest)
            if got is None:
                continue
            req = got.doc
            if req.receiver != rid:
                why = f"names receiver {req.receiver!r}"
            elif self._known.get(req.held_version) != req.held_digest:
                why = (f"holds v{req.held_version} ({req.held_digest[:19]}...), not a committed version this "
                       f"trainer knows (last {sorted(self._known)})")
            elif req.held_version < self._evicted_at.get(rid, -1):
                why = f"holds v{req.held_version}, older than its eviction at v{self._evicted_at[rid]} (written before it, or replayed)"
            else:
                admitted.append(rid)
                continue
            self._joins.reject(key, f"join request not admitted: {why}", version=version)
        if admitted:
            self._log({"event": "admitted", "version": version, "receivers": admitted})
        return tuple(sorted(admitted))

    def _check(self, rid: str, version: int, digest: str, data: bytes) -> Ack:
        ack = Ack.from_json(data, self.sealer)
        if ack.run_id != self.run_id:
            raise ValidationError(f"ack of run {ack.run_id}, not this run")
        if ack.receiver != rid or ack.version != version:
            raise ValidationError(f"ack names receiver {ack.receiver!r} version {ack.version}")
        if ack.ok and ack.manifest_digest != digest:
            raise ValidationError("ack is for a different manifest than the one published")
        return ack

    def collect_acks(self, version: int, manifest_digest: str) -> AckOutcome:
        """Wait for every member's ack of ``version`` (at most ``ack_timeout_s``); elastic,
        admit join requests first and evict members past ``evict_after`` misses after."""
        joined = self._admit(version) if self.elastic else ()
        members = (*self.receivers, *joined)
        deadline = time.monotonic() + self.ack_timeout_s
        valid: dict[str, Ack] = {}
        rejected: dict[str, str] = {}
        seen: dict[str, str] = {}  # receiver -> identity (stat tag) of the object last judged
        ignored: list[str] = []
        while True:
            for rid in members:
                if rid in valid:
                    continue
                key = ack_key(rid, version)
                try:
                    info = self.store.stat(key)
                    if info is None or seen.get(rid) == info.tag:
                        continue
                    data = self.store.get(key, max_bytes=DOC_LIMITS["ack"])  # under the stat's tag (reader.py)
                except ObjectNotFound:
                    continue
                except FormatError as e:  # over the cap: judged by its size, never read
                    seen[rid] = info.tag
                    rejected[rid] = f"ack rejected: {e}"
                    ignored.append(f"{rid}: {e}")
                    continue
                except DcrError as e:  # a failing store: read again at the next poll, until the deadline
                    rejected.setdefault(rid, f"store error reading its ack: {e}")
                    continue
                seen[rid] = info.tag
                try:
                    valid[rid] = self._check(rid, version, manifest_digest, data)
                except DcrError as e:  # FormatError, SignatureError, ValidationError: the ack's fault
                    rejected[rid] = f"ack rejected: {e}"
                    ignored.append(f"{rid}: {e}")
            if len(valid) == len(members) or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        evicted: tuple[str, ...] = ()
        if self.elastic:
            for rid in members:  # a signed refusal is an answer: only no valid ack is a miss
                self._misses[rid] = 0 if rid in valid else self._misses.get(rid, 0) + 1
            evicted = tuple(r for r in members if self._misses[r] >= self.evict_after)
            for rid in evicted:
                del self._misses[rid]
                self._evicted_at[rid] = version
            if evicted:
                self._log({"event": "evicted", "version": version, "receivers": list(evicted),
                           "after_misses": self.evict_after})
            members = tuple(r for r in members if r not in evicted)
            self.receivers = members
            self._change = (version, joined, evicted)
        reasons = [f"{a.receiver}: {a.error or 'not ok'}" for a in valid.values() if not a.ok]
        for rid in members:
            if rid not in valid:
                reasons.append(f"{rid}: {rejected.get(rid, 'no acknowledgement')} within {self.ack_timeout_s}s")
        if self.elastic and len(members) < self.min_receivers:
            reasons.append(f"{len(members)} member(s) {list(members)}, fewer than min_receivers={self.min_receivers}"
                           + (f" (evicted {list(evicted)})" if evicted else ""))
        return AckOutcome(ok=not reasons, reason="; ".join(reasons),
                          acks=[asdict(valid[r]) for r in members if r in valid],
                          ignored=ignored, members=members, joined=joined, evicted=evicted)

    def decide(self, version: int, base_version: int, commit: bool, reason: str, manifest_digest: str = ""
               ) -> str:
        """Write the decision record (and, on commit, ``COMMITTED.json``); returns the
        record's digest, which the next manifest names as its ``base_digest`` on commit.
        The record names the current members and this version's joins and evictions."""
        joined = evicted = ()
        if self._change is not None and self._change[0] == version:
            _, joined, evicted = self._change
        # elastic, before the member set was recovered (the base's decision did not read): an
        # abort that names no members rather than ones this coordinator does not know to be
        members = self.receivers if self._recovered else ()
        d = Decision(run_id=self.run_id, version=version, base_version=base_version, commit=commit,
                     receivers=members, reason=reason[:4096], manifest_digest=manifest_digest,
                     joined=joined, evicted=evicted)
        # A put that raised may still have landed (a lost response): receivers would then act
        # on a record the trainer believes unwritten.  So the put is retried (same bytes,
        # idempotent) until it succeeds or the record reads back; only then is it decided.
        data = d.to_json(self.sealer)
        self._put_confirmed(decision_key(version), data)
        digest = doc_digest(data)
        if commit:
            self._know(version, digest)
            try:  # a pointer for people and tools; the decision record above is authoritative
                self._put_confirmed(COMMITTED_KEY, Committed(self.run_id, version, self.receivers).to_json(self.sealer))
            except DcrError as e:
                print(f"nemo_dcr: version {version} committed, but {COMMITTED_KEY} was not updated: {e}",
                      file=sys.stderr, flush=True)
        return digest

    def _put_confirmed(self, key: str, data: bytes, attempts: int = 4) -> None:
        for i in range(attempts):
            try:
                self.store.put(key, data)
                return
            except DcrError as e:
                error = e
            try:
                if self.store.get(key, max_bytes=len(data)) == data:
                    return
            except DcrError:
                pass
            time.sleep(min(0.1 * 2 ** i, 1.0))
        raise error


@dataclass
class FailureBudget:
    """``RefusalPolicy`` state: consecutive aborted versions."""

    policy: str = "retry"
    max_consecutive: int = 3
    consecutive: int = 0

    def __post_init__(self) -> None:
        if self.policy not in REFUSAL_POLICIES:
            raise ValidationError(f"on_refusal must be one of {REFUSAL_POLICIES}, got {self.policy!r}")
        if self.max_consecutive < 1:
            raise ValidationError(f"max_consecutive_failures must be >= 1, got {self.max_consecutive}")

    def record(self, committed: bool) -> bool:
        """Returns True when training must stop (policy ``fail``, or too many in a row)."""
        if committed:
            self.consecutive = 0
            return False
        self.consecutive += 1
        return self.policy == "fail" or self.consecutive >= self.max_consecutive
