"""Committed-version snapshots: a receiver joining at version N starts near N, not at 0.

Every ``refit.snapshot_every``-th committed version the trainer writes the canonical dense
state of that committed version (the same format and dtypes as ``init/model.safetensors``),
then, last, its sealed record::

    snapshots/v00000040/model.safetensors
    snapshots/v00000040/SNAPSHOT.json      run id, version, decision digest, file digests + sizes

The record's presence means "snapshot complete".  It names the digest of the signed commit
decision of its version, so a receiver that loads it continues the signed chain exactly as
one that replayed every version from 0 would: its committed version is N and its chain
link is that decision's digest (``Follower(committed=N, committed_digest=...)``).

A receiver trusts a snapshot only when all of these hold, else it logs one line and tries
the next older one, then version 0 (``init/``), never using unverified bits:

* ``SNAPSHOT.json`` opens with the run's key (bounded read, ``DOC_LIMITS["snapshot"]``),
  names this run, and the version its key says;
* the store's ``v/<N>/DECISION.json`` opens with the key, is a commit of version N of this
  run, and its digest is the one the record names (a record cannot vouch for bits of an
  aborted version, or of another version's decision);
* every file it lists downloads at exactly the recorded size and sha256.

Only the newest :data:`MAX_CANDIDATES` snapshot versions listed are considered (a store
writer without the key can add directories; it can make a joiner fall back to version 0,
which is slower, never wrong).  The trainer keeps the newest :data:`KEEP` snapshots.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from nemo_dcr.errors import DcrError, ProtocolError, ValidationError
from nemo_dcr.protocol.manifest import (
    DOC_LIMITS,
    SNAPSHOT_PREFIX,
    SNAPSHOT_RECORD,
    Decision,
    ManifestError,
    check_digest,
    check_run_id,
    decision_key,
    doc_digest,
    snapshot_key,
)
from nemo_dcr.protocol.doc import SignedDoc
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectStore

MAX_CANDIDATES = 4
"""Newest snapshot versions a receiver tries before falling back to version 0."""
KEEP = 2
"""Snapshots the trainer keeps; older ones are deleted after a new one is complete."""
MAX_SNAPSHOT_FILES = 16
_SNAPSHOT_DIR = re.compile(r"^snapshots/v([0-9]{8})/")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class SnapshotError(ProtocolError):
    """A snapshot that cannot be used (incomplete, forged, another run's, tampered)."""


@dataclass(frozen=True)
class SnapshotRecord(SignedDoc):
    """``snapshots/v<N>/SNAPSHOT.json``: committed version ``version`` of ``run_id`` is the
    listed files; ``decision_digest`` is the digest of that version's signed commit decision."""

    KIND: ClassVar[str] = "snapshot"
    WHAT: ClassVar[str] = "snapshot record"
    TAGS: ClassVar[dict] = {"format": "nemo-dcr-snapshot"}

    run_id: str
    version: int
    decision_digest: str
    files: dict[str, str]
    """File name -> ``sha256:<hex>``."""
    sizes: dict[str, int]
    """File name -> bytes (a receiver reads no more than this)."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ManifestError(f"snapshot record: version must be an int >= 1, got {self.version!r}")
        check_digest(self.decision_digest, "snapshot record decision_digest")
        if not self.files or len(self.files) > MAX_SNAPSHOT_FILES or set(self.files) != set(self.sizes):
            raise ManifestError("snapshot record: files and sizes must name the same 1..16 files")
        for name, digest in self.files.items():
            size = self.sizes[name]
            if (not isinstance(name, str) or not _FILE_NAME.match(name) or name == SNAPSHOT_RECORD
                    or isinstance(size, bool) or not isinstance(size, int) or size < 0):
                raise ManifestError(f"snapshot record: bad entry {str(name)[:80]!r}")
            check_digest(digest, f"snapshot record file {name}")



@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot, downloaded: ``directory`` holds its files."""

    version: int
    decision_digest: str
    directory: str
    files: tuple[str, ...]


# ---------------------------------------------------------------- trainer (rank 0)
def write_snapshot(store: ObjectStore, sealer: Sealer, run_id: str, version: int, decision_digest: str,
                   blobs: dict[str, bytes]) -> str:
    """Upload the files of committed ``version``, then its sealed record (last: its presence
    means complete); returns the record's key.  A failed upload raises before the record
    is written, so no record ever names files that did not all land."""
    record = SnapshotRecord(run_id=run_id, version=version, decision_digest=decision_digest,
                            files={n: doc_digest(b) for n, b in blobs.items()},
                            sizes={n: len(b) for n, b in blobs.items()})
    for name, blob in sorted(blobs.items()):
        store.put(snapshot_key(version, name), blob)
    key = snapshot_key(version, SNAPSHOT_RECORD)
    store.put(key, record.to_json(sealer))
    return key


def listed_versions(store: ObjectStore) -> list[int]:
    """Versions with any object under ``snapshots/v<N>/``, newest first (unchecked)."""
    found = set()
    for key in store.list(SNAPSHOT_PREFIX):
        m = _SNAPSHOT_DIR.match(key)
        if m:
            found.add(int(m.group(1)))
    return sorted(found, reverse=True)


def prune_snapshots(store: ObjectStore, sealer: Sealer, run_id: str, keep: int = KEEP) -> list[int]:
    """Delete every snapshot older than the ``keep`` newest complete ones (each record
    first, so a reader never takes a half-deleted one for complete); returns the versions
    deleted.  Incomplete directories older than those are deleted too.  Complete means a
    record that :func:`read_record` accepts (this run's key and run, its version's signed
    commit): a store writer without the key who plants records at higher versions must not
    make the trainer delete the genuine snapshots."""
    if keep < 1:
        raise ValidationError(f"keep must be >= 1, got {keep}")
    versions = listed_versions(store)
    complete = []
    for v in versions:  # newest first, until `keep` genuine ones are found
        if len(complete) == keep:
            break
        try:
            read_record(store, sealer, run_id, v)
        except SnapshotError:
            continue
        complete.append(v)
    if len(complete) < keep:
        return []
    gone = [v for v in versions if v < complete[-1]]
    for v in gone:
        prefix = snapshot_key(v, "")
        store.delete(snapshot_key(v, SNAPSHOT_RECORD))
        for key in store.list(prefix):
            store.delete(key)
    return gone


# ---------------------------------------------------------------- receiver
def read_record(store: ObjectStore, sealer: Sealer, run_id: str, version: int) -> tuple[SnapshotRecord, str]:
    """The snapshot record of ``version``, checked against the run and its signed commit
    decision; returns it and the decision digest.  ``SnapshotError`` otherwise."""
    try:
        data = store.get(snapshot_key(version, SNAPSHOT_RECORD), max_bytes=DOC_LIMITS["snapshot"])
        record = SnapshotRecord.from_json(data, sealer)
    except DcrError as e:  # absent, oversized, malformed, unsigned, badly signed
        raise SnapshotError(f"{SNAPSHOT_RECORD}: {type(e).__name__}: {e}") from None
    if record.run_id != run_id or record.version != version:
        raise SnapshotError(f"{SNAPSHOT_RECORD} is v{record.version} of run {record.run_id}, not v{version} of "
                            f"run {run_id}")
    try:
        ddata = store.get(decision_key(version), max_bytes=DOC_LIMITS["decision"])
        decision = Decision.from_json(ddata, sealer)
    except DcrError as e:
        raise SnapshotError(f"no readable signed decision for v{version}: {type(e).__name__}: {e}") from None
    if decision.run_id != run_id or decision.version != version or not decision.commit:
        raise SnapshotError(f"the decision at v{version} is not a commit of v{version} of this run")
    if doc_digest(ddata) != record.decision_digest:
        raise SnapshotError(f"{SNAPSHOT_RECORD} names decision {record.decision_digest}, the store's signed "
                            f"v{version} decision is {doc_digest(ddata)}")
    return record, record.decision_digest


def fetch_snapshot(store: ObjectStore, sealer: Sealer, run_id: str, version: int, directory: str) -> Snapshot:
    """Check the snapshot of ``version`` (:func:`read_record`), download its files into
    ``directory`` (each read bounded by its recorded size, checked against its digest
    before it is written) and return it.  ``SnapshotError`` on any failure."""
    record, digest = read_record(store, sealer, run_id, version)
    os.makedirs(directory, exist_ok=True)
    for name, want in sorted(record.files.items()):
        try:
            blob = store.get(snapshot_key(version, name), max_bytes=record.sizes[name])
        except DcrError as e:
            raise SnapshotError(f"{name}: {type(e).__name__}: {e}") from None
        if len(blob) != record.sizes[name] or doc_digest(blob) != want:
            raise SnapshotError(f"{name} is not the file {SNAPSHOT_RECORD} lists (digest or size differs)")
        with open(os.path.join(directory, name), "wb") as f:
            f.write(blob)
    return Snapshot(version=version, decision_digest=digest, directory=directory, files=tuple(sorted(record.files)))


def find_snapshot(store: ObjectStore, sealer: Sealer, run_id: str, directory: str, *,
                  log: Callable[[str], None]) -> Snapshot | None:
    """The newest usable snapshot (of the :data:`MAX_CANDIDATES` newest listed), downloaded
    into ``directory/v<N>``; None when there is none.  Each one refused costs one line in
    ``log`` and falls back to the next older."""
    try:
        versions = listed_versions(store)[:MAX_CANDIDATES]
    except DcrError as e:  # a store (or relay) that cannot list: version 0 it is
        log(f"nemo_dcr: snapshots not listed, starting from version 0: {type(e).__name__}: {e}")
        return None
    for version in versions:
        where = os.path.join(directory, f"v{version:08d}")
        try:
            return fetch_snapshot(store, sealer, run_id, version, where)
        except (SnapshotError, OSError) as e:
            shutil.rmtree(where, ignore_errors=True)
            log(f"nemo_dcr: snapshot v{version} not used, falling back to an older one or version 0: "
                f"{type(e).__name__}: {e}")
    return None
