"""Run identity: which training run owns a store prefix, and version 0 of that run.

A run id (128 random bits, hex) is created when version 0 is written.  Every manifest,
chunk header, ack and decision carries it, and both sides check it: a run never adopts
another run's objects.  The trainer claims a prefix by writing ``RUN.json`` before
anything else, and refuses a prefix that already holds another run's record, or objects
of a run that has none (written by an older nemo_dcr or by someone else).  Resuming the
same run (``resume_run_id``) is allowed explicitly.

``init/INIT.json`` lists the sha256 of each version-0 file.  A receiver checks the files
it loads (downloaded or a local copy) against it, so its version 0 is provably this run's.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import time

from nemo_dcr.errors import ProtocolError
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    HEAD_KEY,
    INIT_PREFIX,
    INIT_RECORD_KEY,
    RUN_KEY,
    Committed,
    Decision,
    Head,
    InitRecord,
    RunRecord,
    check_run_id,
    decision_key,
)
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore


class ForeignRunError(ProtocolError):
    """The store prefix belongs to another run (or holds objects of an unknown one)."""


def new_run_id() -> str:
    return secrets.token_hex(16)


# objects whose presence means "some run already wrote here"
_RUN_OBJECTS = (f"{INIT_PREFIX}/config.json", f"{INIT_PREFIX}/model.safetensors", INIT_RECORD_KEY,
                COMMITTED_KEY, HEAD_KEY)


def _other_objects(store: ObjectStore) -> list[str]:
    found = [k for k in _RUN_OBJECTS if store.exists(k)]
    for prefix in ("v/", "acks/"):
        keys = store.list(prefix)
        if keys:
            found.append(keys[0])
    return found


def read_run(store: ObjectStore, sealer: Sealer) -> RunRecord | None:
    """The run record of ``store`` (signature checked), or ``None`` when there is none."""
    try:
        data = store.get(RUN_KEY)
    except ObjectNotFound:
        return None
    return RunRecord.from_json(data, sealer)


def claim_store(store: ObjectStore, sealer: Sealer, model_id: str, *, resume_run_id: str | None = None) -> RunRecord:
    """Trainer rank 0: make this prefix ours (a new run) or check it is ours (resume).

    Refuses (``ForeignRunError``, nothing written) a prefix with another run's record or,
    for a new run, with any run objects at all."""
    existing = read_run(store, sealer)
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
    store.put(RUN_KEY, record.to_json(sealer))
    # a concurrent claimant would have overwritten it: read back before going on
    back = read_run(store, sealer)
    if back is None or back.run_id != record.run_id:
        raise ForeignRunError(f"store {store.uri}: another run claimed the prefix at the same time")
    return record


def run_position(store: ObjectStore, sealer: Sealer, run_id: str) -> tuple[int, int]:
    """(committed version, last published version) of run ``run_id`` on ``store``: where a
    resumed trainer continues (its baseline must be the committed version; its next
    version number must exceed every one published before)."""
    committed = published = 0
    for key, cls in ((COMMITTED_KEY, Committed), (HEAD_KEY, Head)):
        try:
            doc = cls.from_json(store.get(key), sealer)
        except ObjectNotFound:
            continue
        if doc.run_id != run_id:
            raise ForeignRunError(f"store {store.uri}: {key} is of run {doc.run_id}, not {run_id}")
        if cls is Committed:
            committed = doc.version
        else:
            published = doc.version
    if published > committed:  # COMMITTED.json is a pointer; the decision record is authoritative
        try:
            d = Decision.from_json(store.get(decision_key(published)), sealer)
        except ObjectNotFound:
            d = None
        if d is not None and d.run_id == run_id and d.commit:
            committed = published
    return committed, max(committed, published)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def write_init_record(store: ObjectStore, sealer: Sealer, run_id: str, blobs: dict[str, bytes]) -> None:
    """Trainer rank 0, after the version-0 files: their digests, sealed."""
    files = {name: "sha256:" + hashlib.sha256(b).hexdigest() for name, b in blobs.items()}
    store.put(INIT_RECORD_KEY, InitRecord(run_id=run_id, files=files).to_json(sealer))


def verify_init_dir(store: ObjectStore, sealer: Sealer, run_id: str, directory: str) -> None:
    """Receiver: the version-0 files in ``directory`` are the ones this run published."""
    try:
        record = InitRecord.from_json(store.get(INIT_RECORD_KEY), sealer)
    except ObjectNotFound:
        raise ProtocolError(f"store {store.uri}: no {INIT_RECORD_KEY} (version 0 not published yet)") from None
    if record.run_id != run_id:
        raise ProtocolError(f"{INIT_RECORD_KEY} is for run {record.run_id}, the store's run is {run_id}")
    for name, digest in sorted(record.files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ProtocolError(f"initial checkpoint {directory}: missing {name}")
        if sha256_file(path) != digest:
            raise ProtocolError(f"initial checkpoint {path} is not this run's version 0 (digest differs from "
                                f"{INIT_RECORD_KEY})")
