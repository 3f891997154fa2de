"""Run identity: which training run owns a store prefix, and version 0 of that run.

A run id (128 random bits, hex) is created when version 0 is written.  Every manifest,
chunk header, ack and decision carries it, and both sides check it: a run never adopts
another run's objects.  The trainer claims a prefix by creating ``RUN.json`` before
anything else, only if absent (``ObjectStore.put_if_absent``: ``link(2)`` on a directory,
``If-None-Match: *`` on S3), so of N trainers started on one prefix exactly one owns it;
it refuses a prefix that already holds another run's record, or objects
of a run that has none (written by an older nemo_dcr or by someone else).

Resuming a run starts from the trainer's checkpoint, which carries the run's
:class:`RunState` (the framework callback saves it with the model): ``resume_position``
checks it against the store's signed history and never trusts the pointer files, so a
replayed or deleted ``HEAD.json`` / ``COMMITTED.json`` cannot relabel the trainer's bits or
make it reuse a version number.

With elastic membership the member set is recovered from the same signed history: the
committed version's decision names the receivers it covered (``committed_members``).

``init/INIT.json`` lists the sha256 of each version-0 file.  A receiver checks the files
it loads (downloaded or a local copy) against it, so its version 0 is provably this run's.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from nemo_dcr.errors import DcrError, FormatError, ProtocolError, ValidationError
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    DOC_LIMITS,
    HEAD_KEY,
    INIT_PREFIX,
    INIT_RECORD_KEY,
    RUN_KEY,
    SNAPSHOT_PREFIX,
    Decision,
    Head,
    InitRecord,
    Manifest,
    RunRecord,
    check_digest,
    check_run_id,
    decision_key,
    doc_digest,
    manifest_key,
)
from nemo_dcr.protocol.signing import UNSIGNED, Sealer, SignatureError, signature_of
from nemo_dcr.transport.failover import VerificationFailed, fetch_verified, second_opinion
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore, ObjectTooLarge, put_if_absent


class ForeignRunError(ProtocolError):
    """The store prefix belongs to another run (or holds objects of an unknown one)."""


class InitNotPublished(ProtocolError):
    """No upstream serves the run's ``init/INIT.json``: version 0 is not published yet."""


_warn = logging.getLogger(__name__).warning
_VERSION_DIR = re.compile(r"^v/([0-9]{8})/")


def new_run_id() -> str:
    return secrets.token_hex(16)


# objects whose presence means "some run already wrote here"
_RUN_OBJECTS = (f"{INIT_PREFIX}/config.json", f"{INIT_PREFIX}/model.safetensors", INIT_RECORD_KEY,
                COMMITTED_KEY, HEAD_KEY)


def _other_objects(store: ObjectStore) -> list[str]:
    found = [k for k in _RUN_OBJECTS if store.exists(k)]
    for prefix in ("v/", "acks/", SNAPSHOT_PREFIX):  # snapshots/: a new run would prune another run's
        keys = store.list(prefix, limit=1)
        if keys:
            found.append(keys[0])
    return found


def _peek(data: bytes) -> dict:
    """Fields of a run record WITHOUT trusting them (to say what a record we cannot open
    claims to be); {} when it does not even parse."""
    try:
        return RunRecord.from_json(data, None).__dict__
    except DcrError:
        return {}


def _claimed(rec: dict) -> str:
    if not rec:
        return "unreadable"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(rec["created_unix"])) if rec.get("created_unix") else "?"
    return f"run {rec['run_id']}, model {rec['model_id']!r}, created {when} UTC"


def read_run(store: ObjectStore, sealer: Sealer, *, allow_unverified: bool = False,
             run_id: str | None = None) -> RunRecord | None:
    """The run record of ``store`` (``open_run``), or ``None`` when there is none."""
    try:
        data = store.get(RUN_KEY, max_bytes=DOC_LIMITS["run"])
    except ObjectNotFound:
        return None
    return open_run(data, sealer, store.uri, allow_unverified=allow_unverified, run_id=run_id)


def open_run(data: bytes, sealer: Sealer, uri: str, *, allow_unverified: bool = False,
             run_id: str | None = None) -> RunRecord:
    """``RUN.json``'s bytes as read from the store at ``uri``, opened.

    With a key, a record that does not open with it is refused naming what it claims to
    be (another run on this prefix, or tampering).  Without a key, a record that IS signed
    is refused too -- following a signed run unchecked would accept any forgery --
    unless ``allow_unverified`` (the caller says so loudly).  With ``run_id``, a record of
    another run is refused."""
    try:
        rec = RunRecord.from_json(data, sealer)
    except SignatureError as e:
        claimed = _peek(data)
        raise ForeignRunError(
            f"store {uri}: {RUN_KEY} is not signed with this key ({_claimed(claimed)}): another run holds "
            f"this prefix, or the record was tampered with; check the key file and the store URI ({e})") from None
    if not sealer.signed and not allow_unverified and signature_of(data) != UNSIGNED:
        raise ProtocolError(
            f"store {uri}: run {rec.run_id} is signed, and no key was given: give the run's key "
            "(--key-file / $NEMO_DCR_KEY_FILE), or follow it unverified with --insecure-no-key")
    if run_id and rec.run_id != run_id:
        raise ProtocolError(f"store {uri} holds run {rec.run_id}, this receiver follows run {run_id}")
    return rec


def claim_store(store: ObjectStore, sealer: Sealer, model_id: str, *, resume_run_id: str | None = None) -> RunRecord:
    """Trainer rank 0: make this prefix ours (a new run) or check it is ours (resume).

    Refuses (``ForeignRunError``, nothing written) a prefix with another run's record or,
    for a new run, with any run objects at all."""
    # (no key and a signed record: another run's, refused below as one; resuming a signed
    # run without its key is refused by its first document)
    existing = read_run(store, sealer, allow_unverified=True)
    if resume_run_id is not None:
        check_run_id(resume_run_id)
        if existing is None or existing.run_id != resume_run_id:
            found = "no run record" if existing is None else f"run {existing.run_id}"
            raise ForeignRunError(f"store {store.uri}: cannot resume run {resume_run_id}: the prefix holds {found}")
        if existing.model_id != model_id:
            raise ForeignRunError(f"store {store.uri}: run {resume_run_id} is for model {existing.model_id!r}, "
                                  f"not {model_id!r}")
        return existing
    if existing is not None:
        raise ForeignRunError(
            f"store {store.uri} belongs to run {existing.run_id} (model {existing.model_id!r}, created "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(existing.created_unix))} UTC); "
            "use a fresh prefix per run (or resume that run)")
    others = _other_objects(store)
    if others:
        raise ForeignRunError(f"store {store.uri} already holds objects of another run (e.g. {others[0]!r}) "
                              "and no run record; use a fresh prefix per run")
    record = RunRecord(run_id=new_run_id(), model_id=model_id, created_unix=time.time())
    # the claim itself: created only if absent (link(2) / If-None-Match), so of N trainers
    # started on one fresh prefix exactly one wins; the read-back covers a retried create
    # that found its own first attempt, and a back end without a conditional create
    put_if_absent(store, RUN_KEY, record.to_json(sealer))
    try:
        back = read_run(store, sealer, allow_unverified=True)
    except ForeignRunError:
        back = None
    if back is None or back.run_id != record.run_id:
        who = "" if back is None else f" (run {back.run_id}, model {back.model_id!r})"
        raise ForeignRunError(f"store {store.uri}: another run claimed the prefix at the same time{who}; "
                              "use a fresh prefix per run")
    return record


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
    c, uri = state.committed_version, store.uri
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


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def write_init_record(store: ObjectStore, sealer: Sealer, run_id: str, blobs: dict[str, bytes]) -> str:
    """Trainer rank 0, after the version-0 files: their digests, sealed; returns the
    record's own digest (the root of the run's chain)."""
    files = {name: doc_digest(b) for name, b in blobs.items()}
    sizes = {name: len(b) for name, b in blobs.items()}
    data = InitRecord(run_id=run_id, files=files, sizes=sizes).to_json(sealer)
    store.put(INIT_RECORD_KEY, data)
    return doc_digest(data)


def read_init_record(store: ObjectStore, sealer: Sealer, run_id: str) -> tuple[InitRecord, str]:
    """Receiver: the run's signed ``init/INIT.json`` (the version-0 files' digests) and its
    own digest (the chain's root); ``InitNotPublished`` when absent, ``ProtocolError`` when
    another run's.

    Through an upstream list, a copy that does not open, is another run's or is missing is
    asked of the other upstreams (``transport/failover.second_opinion``): a relay that
    flipped or hid it is left, and the genuine copy is used."""
    def opened(data: bytes) -> InitRecord:
        record = InitRecord.from_json(data, sealer)
        if record.run_id != run_id:
            raise ProtocolError(f"{INIT_RECORD_KEY} is for run {record.run_id}, the store's run is {run_id}")
        return record

    def bad(data: bytes) -> str | None:
        try:
            opened(data)
        except DcrError as e:
            return str(e)
        return None

    try:
        data = store.get(INIT_RECORD_KEY, max_bytes=DOC_LIMITS["init"])
        return opened(data), doc_digest(data)
    except (ObjectNotFound, DcrError) as e:
        other = second_opinion(store, INIT_RECORD_KEY, max_bytes=DOC_LIMITS["init"], check=bad)
        if other is not None:
            return opened(other), doc_digest(other)
        if isinstance(e, ObjectNotFound):
            raise InitNotPublished(f"store {store.uri}: no {INIT_RECORD_KEY} (version 0 not published yet)") from None
        raise


MAX_INIT_BYTES = 1 << 42
"""Largest version-0 file a receiver downloads when the run's ``init/INIT.json`` names no
sizes (records written before they did): 4 TiB, a 1T-parameter BF16 checkpoint is 2 TB."""


def fetch_init_file(store: ObjectStore, record: InitRecord, name: str) -> bytes:
    """The version-0 file ``name`` as ``record`` lists it: at most its recorded size (an
    upstream that claims more is refused before the body, so a stalling one is bounded by
    the store policy's ``timeout_s + size / min_bytes_per_s``) and with its digest; through
    an upstream list, an upstream that serves other bytes, none or too many is left and the
    next one asked (``fetch_verified``)."""
    digest = record.files[name]
    key = f"{INIT_PREFIX}/{name}"
    try:
        return fetch_verified(store, key, max_bytes=record.sizes.get(name, MAX_INIT_BYTES),
                              check=lambda b: None if doc_digest(b) == digest else f"not the file {INIT_RECORD_KEY} lists")
    except VerificationFailed as e:
        raise ProtocolError(f"{key} is not this run's version 0: {e}") from None


def verify_init_dir(store: ObjectStore, sealer: Sealer, run_id: str, directory: str) -> str:
    """Receiver: the version-0 files in ``directory`` are the ones this run published;
    returns the digest of the record they were checked against (the chain's root)."""
    record, root = read_init_record(store, sealer, run_id)
    for name, digest in sorted(record.files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ProtocolError(f"initial checkpoint {directory}: missing {name}")
        if sha256_file(path) != digest:
            raise ProtocolError(f"initial checkpoint {path} is not this run's version 0 (digest differs from "
                                f"{INIT_RECORD_KEY})")
    return root
