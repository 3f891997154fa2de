"""Version 0 of a run: the initial canonical checkpoint's files and ``init/INIT.json``.

``init/INIT.json`` lists the sha256 (and size) of each version-0 file.  A receiver checks
the files it loads (downloaded or a local copy) against it, so its version 0 is provably
this run's, and a download is bounded by what the run wrote.
"""
from __future__ import annotations

import hashlib
import os

from nemo_dcr.errors import DcrError, ProtocolError
from nemo_dcr.protocol.manifest import (
    DOC_LIMITS,
    INIT_PREFIX,
    INIT_RECORD_KEY,
    InitRecord,
    doc_digest,
)
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.failover import VerificationFailed, fetch_verified, second_opinion
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore


class InitNotPublished(ProtocolError):
    """No upstream serves the run's ``init/INIT.json``: version 0 is not published yet."""


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
    check_files(directory, record.files, label="initial checkpoint",
                what=f"this run's version 0 (digest differs from {INIT_RECORD_KEY})")
    return root


def check_files(directory: str, files: dict[str, str], *, label: str, what: str) -> None:
    """Every file ``files`` names (name -> ``sha256:<hex>``) is in ``directory`` with that
    digest; else ``ProtocolError``: "<label> <dir>: missing <name>" or "<label> <path> is not
    <what>"."""
    for name, digest in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ProtocolError(f"{label} {directory}: missing {name}")
        if sha256_file(path) != digest:
            raise ProtocolError(f"{label} {path} is not {what}")
