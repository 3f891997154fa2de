"""Receiver bootstrap: from a store to a receiver following its run.

:func:`build_receiver` is the one way a receiver is assembled (``nemo-dcr receive``, the
test bed's fault and link receivers, benchmarks that follow a store):

1. the runtime options are checked against the registry (``receiver/registry.py``) before
   anything is waited for, downloaded or loaded;
2. the run: the store's signed ``RUN.json`` (waiting for it), checked against this receiver's
   configuration before anything is downloaded: a record that does not open with its key
   (or is signed while it has none), of another run than ``run_id``, or of another model than
   ``cfg.model_id`` is a :class:`RunMismatch` (one line naming the fix; the CLI's exit 2);
3. the starting point: a receiver starting fresh (no ``init_dir`` given, weights that die
   with the process) loads the newest committed-version snapshot that checks out
   (``protocol/snapshot.py``: signed record of this run, the signed commit decision it
   names, file digests) with ``init/config.json``; otherwise, or when none does, version 0:
   a given checkpoint directory, or a download of the store's ``init/``, either way checked
   against the run's signed ``init/INIT.json`` (:func:`fetch_version_zero`);
4. the runtime, by name, through its registry factory;
5. the engine (``receiver/engine.py``) and the protocol's ``Follower``; over weights that
   outlive the process (``persistent``) the committed-version record
   (``journal.read_committed``) and a repair of a half-applied version from the journal.

The result, :class:`ReceiverSession`, holds the pieces; ``run`` follows the run,
``close`` releases the runtime.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nemo_dcr.errors import DcrError, ProtocolError, ValidationError
from nemo_dcr.protocol.follower import Follower
from nemo_dcr.protocol.run import read_run, wait_for_run
from nemo_dcr.protocol.manifest import DOC_LIMITS, INIT_RECORD_KEY, RUN_KEY, InitRecord, Manifest, RunRecord
from nemo_dcr.protocol.version0 import (
    InitNotPublished, check_files, fetch_init_file, read_init_record, verify_init_dir,
)
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.protocol.snapshot import Snapshot, SnapshotError, find_snapshot, read_record
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.receiver.journal import read_committed
from nemo_dcr.receiver.registry import RuntimeOptions, RuntimeRequest, ServedRuntime, check_options, start_runtime
from nemo_dcr.transport.store import ObjectStore


class RunMismatch(ValidationError):
    """The store's run is not the one this receiver was configured for (another model,
    another run id, another key): refused at start, before anything is downloaded or
    written; the message names the fix."""


def _claimed(store: ObjectStore) -> dict:
    """What the store's ``RUN.json`` claims, NOT trusted (to name it in a refusal); {} when
    there is none or it does not parse."""
    try:
        return RunRecord.from_json(store.get(RUN_KEY, max_bytes=DOC_LIMITS["run"]), None).__dict__
    except (DcrError, OSError):
        return {}


def open_run_for(store: ObjectStore, sealer: Sealer, cfg: ReceiverConfig, *, run_id: str | None,
                 timeout_s: float | None, allow_unverified: bool = False) -> str:
    """The run id of the store's ``RUN.json`` once it is there (``wait_for_run``), checked
    against this receiver's configuration: ``RunMismatch`` (one line naming the fix) when it
    does not open with the key (or is signed and no key was given), is another run than
    ``run_id`` or serves another model than ``cfg.model_id``.  A store with no record within
    ``timeout_s`` is the ``ProtocolError`` of ``wait_for_run`` (a failed run, not bad input)."""
    try:
        run_id = wait_for_run(store, sealer, run_id=run_id, timeout_s=timeout_s, allow_unverified=allow_unverified)
    except ProtocolError as e:
        claimed = _claimed(store)
        if not claimed:  # no record at all (the wait timed out): not a mismatch
            raise
        if run_id and claimed.get("run_id") != run_id:
            raise RunMismatch(f"the store {store.uri} holds run {claimed.get('run_id')} (model "
                              f"{claimed.get('model_id')!r}), this receiver was given --run-id {run_id}: pass "
                              f"--run-id {claimed.get('run_id')}, or leave --run-id out to follow the store's run"
                              ) from None
        raise RunMismatch(" ".join(str(e).split())) from None
    try:
        rec = read_run(store, sealer, allow_unverified=allow_unverified, run_id=run_id)
    except DcrError:  # refused by the upstream read now (a lying relay): the manifests' check still holds
        rec = None
    if rec is not None and rec.model_id != cfg.model_id:
        raise RunMismatch(f"the run at {store.uri} serves model {rec.model_id!r} (this receiver was given "
                          f"--model-id {cfg.model_id!r}): pass --model-id {rec.model_id}")
    return run_id


def fetch_version_zero(store: ObjectStore, sealer: Sealer, run_id: str, *, state_dir: str,
                       init_dir: str | None = None, timeout_s: float | None = None) -> tuple[str, str]:
    """The version-0 checkpoint to load: ``init_dir`` if given, else a download of the
    store's ``init/`` into ``state_dir/init``; either way checked against the run's signed
    ``init/INIT.json`` (waiting up to ``timeout_s`` for it to be published).  Returns the
    directory and the record's digest (the root of the run's chain).  A download through
    an upstream list leaves an upstream that serves a file other than the record lists
    (``protocol/version0.fetch_init_file``)."""
    from nemo_dcr.integrations.hf_export import download_checkpoint

    record, root = _wait_for_init(store, sealer, run_id, timeout_s)
    if init_dir is None:
        return download_checkpoint(store, os.path.join(state_dir, "init"), record), root
    return init_dir, verify_init_dir(store, sealer, run_id, init_dir)


def verify_start_dir(store: ObjectStore, sealer: Sealer, run_id: str, directory: str, version: int) -> str:
    """The files in ``directory`` are the run's committed ``version``: its version 0 (0), or
    its snapshot of ``version`` completed with version 0's other files (as
    :func:`fetch_snapshot_dir` writes them), each file's digest checked against the run's
    signed records.  Returns the digest the chain continues from: version 0's record, or the
    signed commit decision the snapshot names.  ``ProtocolError`` (one line) otherwise."""
    if version == 0:
        return verify_init_dir(store, sealer, run_id, directory)
    try:
        record, digest = read_record(store, sealer, run_id, version)
    except SnapshotError as e:
        raise ProtocolError(f"checkpoint {directory}: no usable snapshot of v{version} in this run ({e})") from None
    init, _ = read_init_record(store, sealer, run_id)
    check_files(directory, {**init.files, **record.files}, label="snapshot checkpoint",
                what=f"this run's snapshot of v{version} (digest differs)")
    return digest


INIT_PROBE_S = 2.0
"""While version 0 is not published, how often the other upstreams of a receiver's list
are asked for ``init/INIT.json`` (a relay that hides it costs at most this long)."""


def _wait_for_init(store: ObjectStore, sealer: Sealer, run_id: str, timeout_s: float | None
                   ) -> tuple[InitRecord, str]:
    """The run's signed ``init/INIT.json`` and its digest, once it is published."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    probe = time.monotonic() + INIT_PROBE_S
    while True:
        if store.exists(INIT_RECORD_KEY):
            return read_init_record(store, sealer, run_id)
        if time.monotonic() >= probe:  # hidden by the upstream read from? (read_init_record asks the others)
            probe = time.monotonic() + INIT_PROBE_S
            try:
                return read_init_record(store, sealer, run_id)
            except InitNotPublished:
                pass
        if deadline is not None and time.monotonic() > deadline:
            raise ProtocolError(f"store {store.uri}: version 0 ({INIT_RECORD_KEY}) not published within {timeout_s}s")
        time.sleep(0.1)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_snapshot_dir(store: ObjectStore, sealer: Sealer, run_id: str, *, state_dir: str,
                       timeout_s: float | None = None, log: Callable[[str], None] = _stderr) -> Snapshot | None:
    """The newest usable committed-version snapshot (``protocol/snapshot.find_snapshot``)
    under ``state_dir/snapshots``, completed with version 0's other files (``config.json``:
    a snapshot holds only the weights), each checked against the run's signed
    ``init/INIT.json``; None (one line in ``log``) when there is none or any check fails:
    the caller then starts from version 0."""
    record, _ = _wait_for_init(store, sealer, run_id, timeout_s)
    snap = find_snapshot(store, sealer, run_id, os.path.join(state_dir, "snapshots"), log=log)
    if snap is None:
        return None
    try:
        for name in sorted(record.files):
            if name in snap.files:
                continue
            blob = fetch_init_file(store, record, name)
            with open(os.path.join(snap.directory, name), "wb") as f:
                f.write(blob)
    except (DcrError, OSError) as e:
        log(f"nemo_dcr: snapshot v{snap.version} not used (version 0's files: {type(e).__name__}: {e}); "
            "starting from version 0")
        return None
    return snap


@dataclass(kw_only=True)
class ReceiverSession:
    """A receiver ready to follow its run (see :func:`build_receiver`)."""

    receiver: Receiver
    follower: Follower
    runtime: ServedRuntime
    run_id: str
    init_dir: str
    """The checkpoint directory the runtime was built from: version 0's, or a committed-version
    snapshot's (``bootstrap["from"] == "snapshot"``: it holds version ``committed``)."""
    committed: int
    """The version held when the session starts (non-zero over persistent weights or when
    started from a snapshot)."""
    recovered: dict | None = None
    """What the restart repair did (``Receiver.recover``), or None."""
    bootstrap: dict = field(default_factory=lambda: {"from": "init"})
    """Where the weights came from: ``{"from": "init"}`` (version 0, or persistent weights
    over it) or ``{"from": "snapshot", "version": N}``."""

    def run(self, *, until_version: int | None = None, timeout_s: float | None = None) -> None:
        """Follow the run (``Follower.run``) at the receiver's poll interval."""
        self.follower.run(until_version=until_version, timeout_s=timeout_s, poll_s=self.receiver.cfg.poll_s)

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> ReceiverSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_receiver(store: ObjectStore, sealer: Sealer, cfg: ReceiverConfig, *, state_dir: str,
                   runtime: str = "hf", options: RuntimeOptions | None = None, run_id: str | None = None,
                   init_dir: str | None = None, timeout_s: float | None = None, allow_unverified: bool = False,
                   durable_journal: bool = False, dump_dir: str | None = None,
                   wrap_served: Callable[[object], object] | None = None,
                   before_fetch: Callable[[Manifest], None] | None = None, snapshot: bool = True,
                   log: Callable[[str], None] = _stderr) -> ReceiverSession:
    """Assemble a receiver of ``runtime`` (a registry name) following ``store``.

    ``state_dir``: this receiver's local directory (a downloaded version 0, and with
    ``options.persistent`` the weights, the journal and ``committed.json``).
    ``run_id``: follow only this run (default: the store's).  ``init_dir``: a local copy
    of version 0 (default: download it).  ``timeout_s``: how long to wait for the run
    record and version 0.  ``allow_unverified``: follow a signed run without its key
    (``wait_for_run``).  ``durable_journal``: write the apply journal to
    ``state_dir/journal`` even over weights that die with the process (implied by
    ``options.persistent``); a journal an earlier process left there is dropped when the
    weights were reloaded from version 0.  ``dump_dir``: after each applied version the
    runtime writes its state to ``dump_dir/v<version>.safetensors``.  ``snapshot``: a receiver
    starting fresh (no ``init_dir``, not ``options.persistent``) starts from the newest
    committed-version snapshot that checks out (:func:`fetch_snapshot_dir`) instead of
    version 0; ``False``: always version 0.  ``log``: one line per snapshot refused.

    Injection points (the test bed's faults use them; nothing else needs patching):
    ``wrap_served(served) -> served``, a ``ServedModel`` wrapping the runtime's, and
    ``before_fetch(manifest)``, the engine's hook (``Receiver``).
    """
    options = options or RuntimeOptions()
    if cfg.verify_dense and not options.reference:
        options = dataclasses.replace(options, reference=True)
    check_options(runtime, options)
    if options.persistent and not state_dir:
        raise ValidationError("persistent weights need a state directory")
    run_id = open_run_for(store, sealer, cfg, run_id=run_id, timeout_s=timeout_s, allow_unverified=allow_unverified)
    snap = None
    if snapshot and init_dir is None and not options.persistent:
        snap = fetch_snapshot_dir(store, sealer, run_id, state_dir=state_dir, timeout_s=timeout_s, log=log)
    if snap is None:
        init_dir, root = fetch_version_zero(store, sealer, run_id, state_dir=state_dir, init_dir=init_dir,
                                            timeout_s=timeout_s)
        start, boot = (0, root), {"from": "init"}
    else:  # the chain continues from the snapshot's commit decision
        init_dir, root = snap.directory, snap.decision_digest
        start, boot = (snap.version, snap.decision_digest), {"from": "snapshot", "version": snap.version}
    built = start_runtime(runtime, RuntimeRequest(init_dir=init_dir, run_id=run_id, state_dir=state_dir,
                                                  options=options))
    try:
        if dump_dir and built.dump is None:
            raise ValidationError(f"runtime {runtime!r} cannot dump its state (dump_dir)")
        journal_dir = committed_file = None
        if options.persistent or durable_journal:
            journal_dir = os.path.join(state_dir, "journal")
        if options.persistent:
            committed_file = os.path.join(state_dir, "committed.json")
        served = built.served if wrap_served is None else wrap_served(built.served)
        rx = Receiver(served, store, cfg, journal_dir=journal_dir, committed_file=committed_file,
                      before_fetch=before_fetch, held_version=start[0])
        if dump_dir:
            rx.on_applied = lambda version: built.dump(os.path.join(dump_dir, f"v{version}.safetensors"))
        (committed, digest), recovered = start, None
        if built.restored:  # weights of an earlier process: committed + maybe a half-applied version
            committed, digest = read_committed(committed_file)
            digest = digest or root
            recovered = rx.recover(committed)
        else:  # weights loaded from version 0: a journal on disk belongs to weights that are gone
            rx.journal.clear_stale()
        follower = Follower(rx, store, sealer, run_id, receiver_id=cfg.receiver_id, committed=committed,
                            committed_digest=digest, max_refusals=cfg.max_refusals)
    except BaseException:
        built.close()
        raise
    return ReceiverSession(receiver=rx, follower=follower, runtime=built, run_id=run_id, init_dir=init_dir,
                           committed=committed, recovered=recovered, bootstrap=boot)
