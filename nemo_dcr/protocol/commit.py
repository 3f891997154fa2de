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

What a failed version does to training is ``RefusalPolicy``: ``retry`` (default) keeps
training and publishes the next version against the same base, failing loudly only after
``max_consecutive_failures`` aborted versions in a row; ``fail`` raises at the first.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

from nemo_dcr.errors import DcrError, FormatError, ValidationError
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    DOC_LIMITS,
    HEAD_KEY,
    Ack,
    Committed,
    Decision,
    Head,
    Manifest,
    ack_key,
    decision_key,
    doc_digest,
    manifest_key,
)
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore

REFUSAL_POLICIES = ("retry", "fail")


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
                 evict_after: int = 3):
        self.store = store
        self.sealer = sealer
        self.run_id = run_id
        self.receivers = receivers
        self.ack_timeout_s = ack_timeout_s
        self.poll_s = poll_s
        self.membership = membership
        self.min_receivers = min_receivers
        self.evict_after = evict_after

    def publish(self, manifest: Manifest) -> str:
        """Write the sealed manifest, then point ``HEAD.json`` at it; returns its digest."""
        data = manifest.to_json(self.sealer)
        self.store.put(manifest_key(manifest.version), data)
        self.store.put(HEAD_KEY, Head(self.run_id, manifest.version, manifest.base_version).to_json(self.sealer))
        return doc_digest(data)

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
        deadline = time.monotonic() + self.ack_timeout_s
        valid: dict[str, Ack] = {}
        rejected: dict[str, str] = {}
        seen: dict[str, str] = {}  # receiver -> identity (stat tag) of the object last judged
        ignored: list[str] = []
        while True:
            for rid in self.receivers:
                if rid in valid:
                    continue
                key = ack_key(rid, version)
                try:
                    info = self.store.stat(key)
                    if info is None or seen.get(rid) == info.tag:
                        continue
                    data, info = self.store.get_with_info(key, max_bytes=DOC_LIMITS["ack"])
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
                except (DcrError, ValueError) as e:
                    rejected[rid] = f"ack rejected: {e}"
                    ignored.append(f"{rid}: {e}")
            if len(valid) == len(self.receivers) or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        reasons = [f"{a.receiver}: {a.error or 'not ok'}" for a in valid.values() if not a.ok]
        for rid in self.receivers:
            if rid not in valid:
                reasons.append(f"{rid}: {rejected.get(rid, 'no acknowledgement')} within {self.ack_timeout_s}s")
        return AckOutcome(ok=not reasons, reason="; ".join(reasons),
                          acks=[asdict(valid[r]) for r in self.receivers if r in valid],
                          ignored=ignored)

    def decide(self, version: int, base_version: int, commit: bool, reason: str, manifest_digest: str = ""
               ) -> str:
        """Write the decision record (and, on commit, ``COMMITTED.json``); returns the
        record's digest, which the next manifest names as its ``base_digest`` on commit."""
        d = Decision(run_id=self.run_id, version=version, base_version=base_version, commit=commit,
                     receivers=self.receivers, reason=reason[:4096], manifest_digest=manifest_digest)
        # A put that raised may still have landed (a lost response): receivers would then act
        # on a record the trainer believes unwritten.  So the put is retried (same bytes,
        # idempotent) until it succeeds or the record reads back; only then is it decided.
        data = d.to_json(self.sealer)
        self._put_confirmed(decision_key(version), data)
        if commit:
            try:  # a pointer for people and tools; the decision record above is authoritative
                self._put_confirmed(COMMITTED_KEY, Committed(self.run_id, version, self.receivers).to_json(self.sealer))
            except DcrError as e:
                print(f"nemo_dcr: version {version} committed, but {COMMITTED_KEY} was not updated: {e}",
                      file=sys.stderr, flush=True)
        return doc_digest(data)

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
