"""Run identity: which training run owns a store prefix.

A run id (128 random bits, hex) is created when version 0 is written.  Every manifest,
chunk header, ack and decision carries it, and both sides check it: a run never adopts
another run's objects.  The trainer claims a prefix by creating ``RUN.json`` before
anything else, only if absent (``ObjectStore.put_if_absent``: ``link(2)`` on a directory,
``If-None-Match: *`` on S3), so of N trainers started on one prefix exactly one owns it;
it refuses a prefix that already holds another run's record, or objects
of a run that has none (written by an older nemo_dcr or by someone else).  A receiver waits
for the record (``wait_for_run``), asking the other upstreams of a list about a refused one.

Resuming a run against the signed history is ``history.py``; version 0's files and their
record are ``version0.py``.
"""
from __future__ import annotations

import logging
import secrets
import time

from nemo_dcr.errors import DcrError, FormatError, ProtocolError
from nemo_dcr.protocol.manifest import (
    COMMITTED_KEY,
    DOC_LIMITS,
    HEAD_KEY,
    INIT_PREFIX,
    INIT_RECORD_KEY,
    RUN_KEY,
    SNAPSHOT_PREFIX,
    RunRecord,
    check_run_id,
)
from nemo_dcr.protocol.signing import UNSIGNED, Sealer, SignatureError, signature_of
from nemo_dcr.transport.failover import second_opinion
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore, put_if_absent


class ForeignRunError(ProtocolError):
    """The store prefix belongs to another run (or holds objects of an unknown one)."""


_warn = logging.getLogger(__name__).warning


def new_run_id() -> str:
    return secrets.token_hex(16)


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


def wait_for_run(store: ObjectStore, sealer: Sealer, *, run_id: str | None, timeout_s: float | None,
                 poll_s: float = 0.1, allow_unverified: bool = False) -> str:
    """The run id of the store's ``RUN.json`` (waiting for it to appear); refuses a run other
    than ``run_id`` when one is given, and a record that does not open with the key (or a
    signed one, without a key unless ``allow_unverified``) naming what it claims to be.

    Through an upstream list, a refused record (flipped, another run's) and, every
    ``RUN_PROBE_S`` while there is none, a missing one are asked of the other upstreams
    (``transport/failover.second_opinion``): the genuine copy is used and a relay that lied
    is left.  Only when no upstream serves one is the refusal raised."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    probe = time.monotonic() + RUN_PROBE_S

    def opened(data: bytes) -> RunRecord:
        return open_run(data, sealer, store.uri, allow_unverified=allow_unverified, run_id=run_id)

    def genuine(data: bytes) -> str | None:
        try:
            opened(data)
        except DcrError as e:
            return str(e)
        return None

    def elsewhere() -> RunRecord | None:
        data = second_opinion(store, RUN_KEY, max_bytes=DOC_LIMITS["run"], check=genuine)
        return None if data is None else opened(data)

    while True:
        try:
            rec = read_run(store, sealer, allow_unverified=allow_unverified, run_id=run_id)
        except (ProtocolError, FormatError):  # refused here: flipped, malformed, another run's
            rec = elsewhere()
            if rec is None:
                raise
        if rec is None and time.monotonic() >= probe:
            probe = time.monotonic() + RUN_PROBE_S
            rec = elsewhere()
        if rec is not None:
            return rec.run_id
        if deadline is not None and time.monotonic() > deadline:
            raise ProtocolError(f"store {store.uri}: no run record (RUN.json) within {timeout_s}s")
        time.sleep(poll_s)


RUN_PROBE_S = 2.0
"""While a receiver's upstream has no ``RUN.json``, how often the others are asked for one
(what a relay that hides it costs)."""
