"""A run's signed history: the run state a trainer checkpoint carries, and its check.

Resuming a run starts from the trainer's checkpoint, which carries the run's
:class:`RunState` (the framework callback saves it with the model): ``resume_position``
checks it against the store's signed history and never trusts the pointer files, so a
replayed or deleted ``HEAD.json`` / ``COMMITTED.json`` cannot relabel the trainer's bits or
make it reuse a version number.

With elastic membership the member set is recovered from the same signed history: the
committed version's decision names the receivers it covered (``committed_members``).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from nemo_dcr.errors import FormatError, ProtocolError, ValidationError
from nemo_dcr.protocol.manifest import (
    DOC_LIMITS,
    HEAD_KEY,
    INIT_RECORD_KEY,
    Decision,
    Head,
    InitRecord,
    Manifest,
    check_digest,
    check_run_id,
    decision_key,
    doc_digest,
    manifest_key,
)
from nemo_dcr.protocol.signing import Sealer, SignatureError
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore, ObjectTooLarge


_warn = logging.getLogger(__name__).warning


_VERSION_DIR = re.compile(r"^v/([0-9]{8})/")


@dataclass(frozen=True, kw_only=True)
class RunState:
    """Where a refit run stands, as the trainer's checkpoint carries it (the framework
    saves and restores it with the model): the run, the version the trainer's weights are
    committed at, that version's decision digest (the head of the signed chain), and the
    highest version number ever published (numbers are never reused).  The store's
    ``HEAD.json`` / ``COMMITTED.json`` are hints; this and the signed history are the truth."""

    run_id: str
    committed_version: int
    committed_digest: str
    """Digest of the committed version's ``DECISION.json`` (``init/INIT.json`` for 0);
    '' when not known (a hand-typed resume): then the store's signed decision gives it."""
    published_version: int
    weights_version: int = -1
    """The step whose bits the trainer's weights held when the state was taken (-1: the
    committed version).  A checkpoint taken after a step that was not committed (aborted,
    or skipped by ``every_n_steps``) holds bits no receiver has: resuming from it is
    refused, since the trainer cannot diff against the committed bits it no longer has."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.weights_version == -1:
            object.__setattr__(self, "weights_version", self.committed_version)
        for name in ("committed_version", "published_version", "weights_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValidationError(f"refit run state: {name} must be an int >= 0, got {v!r}")
        if self.committed_digest:
            check_digest(self.committed_digest, "refit run state committed_digest")
        if self.published_version < self.committed_version:
            raise ValidationError(f"refit run state: published_version {self.published_version} < committed "
                                  f"{self.committed_version}")

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "committed_version": self.committed_version,
                "committed_digest": self.committed_digest, "published_version": self.published_version,
                "weights_version": self.weights_version}

    @classmethod
    def from_dict(cls, d) -> "RunState":
        keys = {"run_id", "committed_version", "committed_digest", "published_version", "weights_version"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ValidationError(f"refit run state: expected {sorted(keys)}; "
                                  f"got {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        try:
            return cls(**d)
        except FormatError as e:
            raise ValidationError(str(e)) from None


FLOOR_MISSES = 64


"""Listed version numbers in a row above the committed one that hold no signed manifest or
decision of this run before a resuming trainer stops looking higher.  Genuine numbers
above a checkpoint are the ones its trainer went on to publish, close together (a gap is
an upload killed before its manifest); a writer without the key can plant any number."""
MISS_BYTES = 256 << 20


"""Most bytes of documents that fail to open the scan reads before it stops (a planted
64 MiB "manifest" per number would otherwise cost a resume FLOOR_MISSES x 64 MiB)."""
FLOOR_SLACK = 1024


"""A listed number without a signed document counts as used (never reused: an upload
killed before its manifest, or documents deleted) when it is at most this far above the
highest number the signed history, the checkpoint or a signed ``HEAD.json`` names;
beyond, it is ignored (planted: ``v/99999995/x`` would otherwise push the next version to
the end of the key space).  The worst a planter can do is waste this many numbers."""


def _listed_versions(store: ObjectStore) -> list[int]:
    """Version numbers with any object under ``v/<v>/`` (candidates only: anyone who can
    write to the store can list a number here)."""
    out = set()
    for key in store.list("v/"):
        m = _VERSION_DIR.match(key)
        if m:
            out.add(int(m.group(1)))
    return sorted(out)


def signed_versions(store: ObjectStore, sealer: Sealer, run_id: str, above: int, *, known: int = 0,
                    log: Callable[[str], None] | None = None) -> tuple[int, int | None]:
    """The version numbers in use above ``above`` (the committed version) as this run's
    signed history tells them: (the highest number in use, the highest committed, or None).

    Listed numbers are read in ascending order.  One with a signed decision or manifest of
    ``run_id`` is in use; one without is in use only within ``FLOOR_SLACK`` of the highest
    number known so far (``known``, the signed ones, ...), and otherwise ignored.  The scan
    stops after ``FLOOR_MISSES`` numbers in a row without a signed document, or
    ``MISS_BYTES`` read of documents that failed to open; what it ignored or left unread is
    reported once through ``log``.  (Receivers use chunks only where a signed manifest lists
    their digest, and a decision names the manifest it decides, so a number reused after
    all is refused by them, not applied: this floor is the trainer's own guard.)"""
    used, committed = max(above, known), None
    misses, spent, ignored, stopped = 0, 0, [], ""
    for n in (x for x in _listed_versions(store) if x > above):
        dec, read = _open_signed(store, sealer, decision_key(n), Decision, run_id)
        dec = dec[0] if dec is not None and dec[0].version == n else None
        signed = dec is not None
        if not signed:
            man, more = _open_signed(store, sealer, manifest_key(n), Manifest, run_id)
            signed, read = man is not None and man[0].version == n, read + more
        if signed:
            used, misses = max(used, n), 0
            committed = n if dec is not None and dec.commit else committed
            continue
        misses += 1
        spent += read
        if n <= used + FLOOR_SLACK:
            used = n
        else:
            ignored.append(n)
        if misses >= FLOOR_MISSES or spent >= MISS_BYTES:
            stopped = f"; stopped at v{n} after {misses} in a row without one ({spent} bytes of unopenable documents)"
            break
    if (ignored or stopped) and log is not None:
        shown = ", ".join(map(str, ignored[:4])) + (", ..." if len(ignored) > 4 else "")
        log(f"store {store.uri}: {len(ignored)} version number(s) under v/ hold no signed manifest or decision of "
            f"run {run_id} and lie over {FLOOR_SLACK} above v{used}: ignored ({shown or 'none'}){stopped}")
    return used, committed


def _open_signed(store: ObjectStore, sealer: Sealer, key: str, cls, run_id: str) -> tuple[tuple | None, int]:
    """((document, digest) at ``key`` if present, opening with the key and of ``run_id``, else
    None; the bytes read).  One over ``DOC_LIMITS`` is refused before its body (at most
    limit + 1 bytes read), as one that does not open."""
    try:
        data = store.get(key, max_bytes=DOC_LIMITS[cls.KIND])
    except ObjectNotFound:
        return None, 0
    except ObjectTooLarge as e:
        return None, min(e.size, e.limit + 1)
    try:
        doc = cls.from_json(data, sealer)
    except (FormatError, SignatureError):
        return None, len(data)
    return ((doc, doc_digest(data)) if doc.run_id == run_id else None), len(data)


def _signed(store: ObjectStore, sealer: Sealer, key: str, cls, run_id: str) -> tuple | None:
    """(document, digest) at ``key`` if present, opening with the key and of ``run_id``; else None."""
    return _open_signed(store, sealer, key, cls, run_id)[0]


def init_digest(store: ObjectStore, sealer: Sealer, run_id: str) -> str:
    """Digest of the run's signed ``init/INIT.json``: the root of the chain (version 0)."""
    got = _signed(store, sealer, INIT_RECORD_KEY, InitRecord, run_id)
    if got is None:
        raise ProtocolError(f"store {store.uri}: no readable {INIT_RECORD_KEY} of run {run_id} signed with this key")
    return got[1]


def resume_position(store: ObjectStore, sealer: Sealer, state: RunState) -> tuple[str, int]:
    """Trainer rank 0, resuming: check the checkpoint's run state against the store's signed
    history; returns (committed digest, the highest version number in use).

    Refused, with both versions named: the checkpoint's committed version has no commit
    decision signed with the key (deleted or tampered) or one with another digest; or a
    LATER version was committed (the store moved past this checkpoint: resume from a
    newer one).  Every version number with a signed manifest or decision of this run, one
    listed near them (``signed_versions``: an upload killed before its manifest), the
    checkpoint's and a signed ``HEAD.json``'s count as used, so none is reused; a bare key
    planted far above them by a writer without the key does not (it would push the next
    number to the end of the key space)."""
    c = state.committed_version
    if state.weights_version != c:
        raise ProtocolError(
            f"cannot resume run {state.run_id}: the checkpoint's weights are step {state.weights_version}, the run's "
            f"committed version is v{c} (step {state.weights_version} was aborted or not published), and receivers "
            f"hold v{c}'s bits, which this trainer no longer has; resume from a checkpoint taken at a committed "
            f"step (with every_n_steps=N, checkpoint at multiples of N), or start a new run")
    if c == 0:
        digest = init_digest(store, sealer, state.run_id)
    else:
        got = _signed(store, sealer, decision_key(c), Decision, state.run_id)
        if got is None or not got[0].commit or got[0].version != c:
            raise ProtocolError(f"cannot resume run {state.run_id}: the checkpoint holds committed v{c}, and the "
                                f"store has no commit decision for v{c} signed with this key (deleted or tampered)")
        digest = got[1]
    if state.committed_digest and digest != state.committed_digest:
        raise ProtocolError(f"cannot resume run {state.run_id}: the checkpoint's v{c} is {state.committed_digest}, "
                            f"the store's signed v{c} is {digest} (another branch of the history)")
    head = _signed(store, sealer, HEAD_KEY, Head, state.run_id)
    known = max([state.published_version, *([head[0].version] if head else [])])
    used, later = signed_versions(store, sealer, state.run_id, c, known=known, log=_warn)
    if later is not None:
        raise ProtocolError(f"cannot resume run {state.run_id} from committed v{c}: the store's run committed "
                            f"v{later} after it; restart from the checkpoint of v{later} (or later), or start a new run")
    return digest, max(used, known)


def committed_members(store: ObjectStore, sealer: Sealer, run_id: str, version: int, digest: str
                      ) -> tuple[str, ...] | None:
    """Elastic membership, a trainer resuming (or starting) at committed ``version``: the
    members its signed commit decision covers (``receivers``), the member set the run
    continues with.  ``digest`` is that decision's digest as the trainer knows it (its
    checkpoint's, checked by ``resume_position``): a decision with other bytes is not the
    one the trainer's chain is on, and is refused.  None for version 0 (no decision: the
    configured receivers are the members)."""
    if version == 0:
        return None
    got = _signed(store, sealer, decision_key(version), Decision, run_id)
    if got is None or not got[0].commit or got[0].version != version or got[1] != digest:
        raise ProtocolError(f"run {run_id}: no commit decision for v{version} signed with this key and with digest "
                            f"{digest} (deleted or tampered): the member set cannot be recovered")
    return got[0].receivers
