"""Receiver engine: check a version, apply it in place, journal it, roll it back on abort.

Which version to apply, acks and decisions are the protocol's (``protocol/follower.py``);
this module does one version.  Order of checks for version ``v`` (nothing is written
until all of them passed):

1. the manifest (sealed, opened by the follower) names this model;
2. its ``base_version`` is the version this receiver holds (else: refusal, no download);
3. every chunk downloads with the listed size and sha256 digest;
4. every chunk decodes (strict decoder) and its own header agrees with the manifest
   (run id, model, version, base);
5. the apply engine validates every delta against the runtime's tensor specs.

Then the journal records old and new bits of every changed element, the deltas are
applied through the runtime's loader and the version is held tentatively.  A failure at
steps 1-5 is a refusal with the weights untouched; a failure during the writes is
repaired from the journal (overwrite with the old bits) before the refusal.

With streaming receive on (``ReceiverConfig.stream``, the default), steps 3-4 may have run
for some chunks before the manifest existed (``receiver/stream.py``, driven by the
follower's idle steps through :meth:`Receiver.prefetch`); such a chunk is used only if the
manifest lists it with the same size and digest and its header agrees, and its records are
charged to the version's budget like any other; everything else is fetched as above.

How a receiver is assembled (runtime, version 0, restart) is ``receiver/bootstrap.py``;
the command line is ``receiver/cli.py``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nemo_dcr.codec import DecodeBudget
from nemo_dcr.codec.types import BITS_DTYPE
from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.configs.check import check_number
from nemo_dcr.configs.flags import flag
from nemo_dcr.errors import FormatError, ProtocolError, ValidationError
from nemo_dcr.protocol.manifest import Ack, Manifest, check_receiver_id, dense_key
from nemo_dcr.receiver.fetch import RefitRefused, admission_cap, fetch_chunks
from nemo_dcr.receiver.held import HeldBits
from nemo_dcr.receiver.journal import ApplyJournal, write_committed
from nemo_dcr.transport.store import ObjectStore
from nemo_dcr.transport.store.meter import diff, snapshot_of


DEFAULT_FETCH_THREADS = 8
"""Chunks a receiver fetches at once by default (``ReceiverConfig.fetch_threads``): measured on
the link benchmark (docs/benchmarks.md, issue 32), two fetches at a time (one per core of
its 2-core VM, the earlier default) kept the receiver one round trip per two chunks behind
the trainer's uploads."""


@dataclass(kw_only=True, frozen=True)
class ReceiverConfig:
    receiver_id: str = field(metadata=flag(
        "--receiver-id", "name of this receiver's acknowledgements (letters, digits, _ and -, at most 64)"))
    """Name under which acknowledgements are written (``acks/<id>/``)."""
    model_id: str = field(metadata=flag("--model-id", "manifests of any other model are refused"))
    """Manifests of any other model are refused."""
    poll_s: float = field(default=0.05, metadata=flag("--poll-s", "interval between checks for the next manifest"))
    """Interval between checks for the next manifest."""
    verify_dense: bool = field(default=False, metadata=flag(
        "--verify-dense", "after each apply compare every tensor with the version's dense export (doubles memory)"))
    """After each apply, compare every parameter and buffer with a dense refit of the same
    version (``v/<v>/dense.safetensors`` loaded through the same loader into a second
    model) and report ``bit_exact`` in the ack.  Verification only: doubles memory."""
    fetch_threads: int = field(default=0, metadata=flag(
        "--fetch-threads", f"chunks downloaded, verified and decoded at once (0: {DEFAULT_FETCH_THREADS})"))
    """Chunks downloaded, verified and decoded at once; 0: ``DEFAULT_FETCH_THREADS``.  A
    fetch mostly waits on the store (one request per chunk, a round trip each over a
    distant link) and the coders release the GIL, so this is not bounded by the cores:
    the ack reports the cores decoding used (``decode_cores``) beside it."""
    stream: bool = field(default=True, metadata=flag(
        "--no-stream", "fetch a version's chunks only once its signed manifest is there (default: fetch and decode "
        "them as they land, use them only if the manifest lists the same bytes)"))
    """Streaming receive (``receiver/stream.py``): while idle, fetch and decode the chunks
    of the next version as they land, before its manifest; they are used only if the
    signed manifest lists them with the same size and digest.  False: fetch a version's
    chunks only once its manifest is there."""

    max_refusals: int = field(default=3, metadata=flag(
        "--max-refusals", "exit (status 1) after refusing this many versions in a row for the same reason that "
        "says this receiver does not fit the run (another model, tensors its runtime does not have); 0: never"))
    """After this many versions in a row refused for the same :class:`Misfit` cause (the run's
    signed manifests name another model, or records its runtime has no tensor for), the
    receiver ends (``Follower.run`` raises ``ReceiverMisfit``; ``nemo-dcr receive`` exits 1
    with one line naming the fix) instead of refusing every version of the run forever.
    Refusals a store or a network causes (a missing or corrupt chunk, a timeout) never count.
    0: never end."""

    def __post_init__(self) -> None:
        check_receiver_id(self.receiver_id)
        check_number("poll_s", self.poll_s, kind=float, positive=True)
        check_number("fetch_threads", self.fetch_threads, min=0)
        check_number("max_refusals", self.max_refusals, min=0)

    @property
    def threads(self) -> int:
        return self.fetch_threads or DEFAULT_FETCH_THREADS

    @property
    def decode_cores(self) -> int:
        """Cores the decoding of ``threads`` fetches runs on at most."""
        return max(1, min(self.threads, os.cpu_count() or 1))


class Misfit(RefitRefused):
    """A refusal that says this receiver does not fit the run -- the signed manifest names
    another model, or its records (chunks that match the signed digests) change tensors this
    runtime does not have -- not that the store or the network failed.  ``cause`` groups
    repeats (``ReceiverConfig.max_refusals``); the message ends with the fix."""

    def __init__(self, message: str, *, cause: str):
        super().__init__(message)
        self.cause = cause


_TENSORS_FIX = ("this receiver's runtime does not hold the run's tensors: start it from the run's own checkpoint "
                "(no --init-dir, or the trainer's init/) with the runtime the run was made for")


def _misfit_of(refused: RefitRefused) -> RefitRefused:
    """A chunk refused for its records (a tensor name, dtype or shape this runtime does not
    have, more changes than its tensors hold: ``ChunkValidationError``) after its bytes
    matched the signed manifest's digest is the trainer's own content: a :class:`Misfit`.
    Anything else (missing, corrupt, a header that disagrees) is the store's, left as is."""
    from nemo_dcr.codec.format import ChunkValidationError

    if not isinstance(refused.__context__, ChunkValidationError):
        return refused
    return Misfit(f"{' '.join(str(refused).split())}: {_TENSORS_FIX}", cause="tensors")


@dataclass
class FetchedVersion:
    """One version's records, downloaded, verified and decoded; nothing written yet."""

    deltas: list[TensorDelta]
    held: Mapping
    """The canonical bits the records apply to (what they were decoded against)."""
    stats: dict = field(default_factory=dict)


class Receiver:
    """Applies versions to one ``ServedModel``.

    Supported hooks (attributes, settable after construction; the test bed's fault
    injection and the CLI's ``--dump-dir`` use them, nothing patches methods):

    * ``before_fetch(manifest)``: called before a version's chunks are fetched, on every
      apply path (a version, a replayed catch-up version, each link of a composed
      catch-up); an exception it raises propagates as the apply's failure.
    * ``on_applied(version)``: called after every write of a version landed (the version
      is then held tentatively, or committed on catch-up).
    """

    def __init__(self, applier, store: ObjectStore, cfg: ReceiverConfig, *, held_version: int = 0,
                 reference=None, journal_dir: str | None = None, committed_file: str | None = None,
                 before_fetch: Callable[[Manifest], None] | None = None,
                 on_applied: Callable[[int], None] | None = None):
        """``applier``: a ``ServedModel`` (``receiver/served.py``), or a prewarmed
        ``DeltaApplier`` with ``reference``, a second runtime adapter used by
        ``verify_dense`` (they are wrapped in an ``InProcessModel``).
        ``journal_dir``: the journal is written there (fsync'd) before the first write of
        a version, for a runtime whose weights outlive this process
        (``runtimes/persistent.py``); ``committed_file``: the committed version is
        recorded there after each commit (``journal.write_committed``)."""
        from nemo_dcr.receiver.apply import DeltaApplier
        from nemo_dcr.receiver.served import InProcessModel

        if isinstance(applier, DeltaApplier):
            if cfg.verify_dense and reference is None:
                raise ValidationError("verify_dense needs a reference runtime")
            self.served = InProcessModel(applier, reference)
        else:
            self.served = applier
        self.store = store
        self.cfg = cfg
        self.held_version = held_version
        self.journal = ApplyJournal(journal_dir)
        self.committed_file = committed_file
        self.before_fetch = before_fetch
        self.on_applied = on_applied
        self._writes = 0
        """Write generation: bumped before every write to the runtime (apply, undo), so a
        prefetch decoded against older bits is never used."""
        self._stream = None
        """``stream.StreamState`` of the held version, while idle (see :meth:`prefetch`)."""
        self._store_mark = snapshot_of(store)
        """The store's request counters at the previous answer (``meter.snapshot_of``)."""
        self.misfit: Misfit | None = None
        """Why the last version answered (:meth:`apply_tentative`) was refused, when the
        reason is a :class:`Misfit`; None otherwise (the follower counts repeats)."""

    # --------------------------------------------------------------- streaming receive
    def prefetch(self, run_id: str, *, handled: int, stride: int = 1) -> int:
        """Streaming receive, called by the follower while it is idle (held = committed, no
        tentative version, nothing newer published): fetch and decode a bounded batch of
        the chunks that appeared for the versions after ``handled`` (``stream.candidates``),
        on top of the version held now.  Returns how many were decoded; store errors while
        listing propagate (``TransportError``); never writes.  Off with ``cfg.stream``."""
        from nemo_dcr.receiver.stream import StreamState, candidates

        if not self.cfg.stream:
            return 0
        st = self._stream
        if st is None or not st.matches(run_id=run_id, base_version=self.held_version, generation=self._writes):
            self._drop_stream()
            st = self._stream = StreamState(self.served, run_id=run_id, model_id=self.cfg.model_id,
                                            base_version=self.held_version, generation=self._writes,
                                            threads=self.cfg.threads)
        return st.poll(self.store, candidates(handled, stride, st.top))

    def _drop_stream(self) -> None:
        """Forget what was prefetched (the held bits changed, or a manifest consumed it)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    # --------------------------------------------------------------- one version
    def fetch(self, manifest: Manifest, *, base: Mapping | None = None, base_version: int | None = None
              ) -> FetchedVersion:
        """Steps 1-4: check, download, verify and decode every chunk of ``manifest``;
        raises ``RefitRefused``, writes nothing.  ``base``: the canonical bits the records
        apply to (default: what the runtime holds) at ``base_version`` (default:
        ``held_version``); catch-up passes its mirror of a later version."""
        if self.before_fetch is not None:
            self.before_fetch(manifest)
        expect = self.held_version if base_version is None else base_version
        if manifest.model_id != self.cfg.model_id:
            raise Misfit(f"manifest v{manifest.version} is for model {manifest.model_id!r}, this receiver serves "
                         f"{self.cfg.model_id!r}: restart it with --model-id {manifest.model_id}",
                         cause=f"model {manifest.model_id!r}")
        if manifest.base_version != expect:
            raise RefitRefused(f"manifest v{manifest.version} has base version {manifest.base_version}, "
                               f"this receiver holds version {expect}")
        # a prefetch (streaming receive) is used by this manifest or not at all
        stream, self._stream = self._stream, None
        specs = self.served.tensor_specs()
        # untrusted sizes are bounded before anything is downloaded or decoded: the version's
        # wire bytes by twice the dense size of what it may change, duplicates refused, and
        # every record checked against the runtime's specs and a per-version budget from its
        # header alone (codec/admit.py)
        if manifest.wire_bytes > admission_cap(specs):
            dense = sum(s.numel * BITS_DTYPE[s.dtype].itemsize for s in specs.values())
            raise RefitRefused(f"manifest v{manifest.version} lists {manifest.wire_bytes} chunk bytes, more than "
                               f"twice the {dense} bytes of the tensors this receiver holds")
        digests = [ref.digest for ref in manifest.chunks]
        if len(set(digests)) != len(digests):
            raise RefitRefused(f"manifest v{manifest.version} lists the same chunk bytes twice")
        budget = DecodeBudget.for_tensors(specs)
        held = HeldBits(self.served) if base is None else base
        want = {"run_id": manifest.run_id, "model_id": manifest.model_id, "version": str(manifest.version),
                "base_version": str(manifest.base_version)}
        prefetched, stream_stats = {}, {}
        if base is None and stream is not None and stream.matches(run_id=manifest.run_id, base_version=expect,
                                                                  generation=self._writes):
            prefetched, stream_stats = stream.take(manifest, want)
            held = stream.held  # the same bits (nothing was written since), already read
        if stream is not None:
            stream.close()
        t0 = time.perf_counter()
        manifest_at = time.monotonic()
        try:
            got = fetch_chunks(self.store, manifest.chunks, held=held, specs=specs, budget=budget, want=want,
                               threads=self.cfg.threads, prefetched=prefetched)
        except RefitRefused as e:
            raise _misfit_of(e) from None
        deltas = [d for chunk in got.chunks for d in chunk.deltas]
        # download_s: the receiver's download stage, i.e. the time during which at least one
        # chunk of the version was downloading, before the manifest (streaming) or after it;
        # fetch_s: from the manifest to the last chunk's arrival; decode_s: the decode tail after it
        stats = {"download_s": got.download_busy_s, "fetch_s": max(0.0, got.downloaded_at - t0),
                 "decode_s": got.done_at - max(got.downloaded_at, t0),
                 "decode_cpu_s": got.decode_cpu_s, "decode_gbps": got.decode_gbps, "fetch_threads": self.cfg.threads,
                 "decode_cores": self.cfg.decode_cores,
                 "wire_bytes": manifest.wire_bytes, "changed": sum(d.nnz for d in deltas),
                 "stream": self.cfg.stream, "prefetch_used_chunks": got.prefetched_chunks,
                 "prefetch_used_bytes": got.prefetched_bytes, "manifest_read_at": manifest_at,
                 "last_chunk_arrived_at": manifest_at + (got.downloaded_at - t0), **stream_stats}
        return FetchedVersion(deltas, held, stats)

    def apply_version(self, manifest: Manifest) -> dict:
        """Fetch, journal and apply ``manifest`` in place.  A refusal before the first write
        leaves the weights untouched; a failure during the writes is repaired from the
        journal (undo by overwrite), so either way the runtime ends exactly at the base and
        ``RefitRefused`` says what happened.  On success the version is held tentatively
        until :meth:`settle` (committed) or :meth:`rollback` (aborted)."""
        got = self.fetch(manifest)
        got.stats["apply_s"] = self.apply_records(manifest.version, manifest.base_version, got.deltas, got.held)
        return got.stats

    def apply_records(self, version: int, base_version: int, deltas: list[TensorDelta], held: Mapping) -> float:
        """Validate, journal and apply decoded ``deltas`` taking ``base_version`` (held now,
        whose bits ``held`` maps) to ``version``; returns the seconds spent."""
        t0 = time.perf_counter()
        try:
            self.served.validate(deltas)
        except (FormatError, ValidationError) as e:  # DeltaValidationError and friends: nothing written
            # the records came in chunks that match the signed manifest's digests: the trainer's
            # model and this runtime's disagree (a misconfiguration), not a store fault
            raise Misfit(f"{' '.join(str(e).split())}: {_TENSORS_FIX}", cause="tensors") from None
        self.journal.begin(version, base_version, deltas, held)
        self._writes += 1
        self._drop_stream()
        try:
            self.served.apply(deltas)
        except Exception as e:  # noqa: BLE001 - any failure mid-write is repaired, then reported
            self._undo()
            raise RefitRefused(f"apply of v{version} failed ({type(e).__name__}: {e}); "
                               f"repaired from the journal, holding v{base_version}") from None
        self.journal.mark("applied")
        self.held_version = version
        if self.on_applied is not None:
            self.on_applied(version)
        return time.perf_counter() - t0

    def _undo(self) -> None:
        records = self.journal.undo_records()
        base = self.journal.base_version
        self._writes += 1
        self._drop_stream()
        self.served.apply(records)
        self.journal.clear()
        self.held_version = base

    def apply_tentative(self, manifest: Manifest, manifest_digest: str, *, run_id: str) -> Ack:
        """Apply ``manifest`` and answer it: ``ok`` only if applied and, when verifying,
        bit-exact (a version that is not is rolled back at once and refused)."""
        def refusal(error: str) -> Ack:
            return Ack(run_id=run_id, receiver=self.cfg.receiver_id, version=manifest.version, ok=False,
                       held_version=self.held_version, error=error)

        self.misfit = None
        try:
            stats = self.apply_version(manifest)
        except RefitRefused as e:
            self.misfit = e if isinstance(e, Misfit) else None
            return refusal(str(e))
        if self.cfg.verify_dense:
            try:
                stats.update(self.verify_against_dense(manifest.version))
            except (FormatError, ValidationError) as e:  # the unsigned reference is oversized or malformed
                self.rollback()
                return refusal(f"dense reference of v{manifest.version} unusable ({e}); rolled back")
            if not stats.get("bit_exact"):
                self.rollback()
                return refusal(f"not bit-exact against the dense reference of v{manifest.version} "
                               f"(mismatches: {stats.get('mismatches')}); rolled back")
        sample = self.served.sample()
        if sample is not None:
            stats["sample"] = sample
        mark, self._store_mark = self._store_mark, snapshot_of(self.store)
        stats["requests"] = diff(self._store_mark, mark)  # since the previous answer: polls, listings, fetches
        stats["answered_at"] = time.monotonic()
        return Ack(run_id=run_id, receiver=self.cfg.receiver_id, version=manifest.version, ok=True,
                   held_version=self.held_version, manifest_digest=manifest_digest, stats=stats)

    def apply_committed(self, manifest: Manifest, decision_digest: str) -> dict:
        """Catch-up: apply a version the trainer already committed (no ack is needed);
        ``decision_digest``: its commit decision's digest (see :meth:`settle`)."""
        stats = self.apply_version(manifest)
        self.settle(decision_digest)
        return stats

    def apply_chain(self, manifests: list[Manifest], decision_digest: str) -> dict:
        """Catch-up: apply committed versions (a chain starting at the held version) as one
        composed write (``receiver/catchup.py``); no ack is needed."""
        from nemo_dcr.receiver.catchup import compose

        try:
            deltas, held, stats = compose(self, manifests)
        except (FormatError, ValidationError) as e:  # a record against the runtime: nothing written
            raise RefitRefused(str(e)) from None
        stats["apply_s"] = self.apply_records(manifests[-1].version, self.held_version, deltas, held)
        self.settle(decision_digest)
        return stats

    def settle(self, decision_digest: str) -> None:
        """The tentative version was committed by the decision whose bytes hash to
        ``decision_digest``: record both (before the journal goes, so a crash in between
        leaves a journal older than the record, which :meth:`recover` drops), then drop
        its journal."""
        if self.committed_file:
            write_committed(self.committed_file, self.held_version, decision_digest)
        self.journal.clear()

    def recover(self, committed: int) -> dict | None:
        """After a restart over persistent weights holding ``committed`` plus possibly a
        half-applied version: undo it from the journal the previous process left (an
        overwrite with the old bits, correct whichever writes had landed).  Returns what
        was done, or None."""
        journal = ApplyJournal.load(self.journal.directory) if self.journal.directory else self.journal
        self.held_version = committed
        if not journal.active:
            return None
        if journal.version <= committed:  # committed, then killed before the journal was dropped
            journal.clear()
            return {"event": "dropped stale journal", "version": journal.version}
        if journal.base_version != committed:
            raise ProtocolError(f"journal of v{journal.version} has base v{journal.base_version}, "
                                f"the committed version is v{committed}")
        t0 = time.perf_counter()
        event = {"event": "repaired", "version": journal.version, "phase": journal.phase}
        self.journal = journal
        self._undo()
        return {**event, "repair_s": round(time.perf_counter() - t0, 4)}

    def rollback(self) -> None:
        """The tentative version was aborted: overwrite every element it changed with its
        base bits, in place, through the same apply path."""
        if not self.journal.active:
            raise ProtocolError("rollback without a tentative version")
        self._undo()

    def verify_against_dense(self, version: int) -> dict:
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        t0 = time.perf_counter()
        # unsigned test aid: bounded by the dense size of what this receiver holds (+ header)
        cap = sum(s.numel * BITS_DTYPE[s.dtype].itemsize for s in self.served.tensor_specs().values()) + (64 << 20)
        blob = self.store.get(dense_key(version), max_bytes=cap)
        try:
            dense = load_safetensors(blob)
        except SafetensorError as e:
            raise FormatError(f"{dense_key(version)}: not a safetensors file ({e})") from None
        report = self.served.verify_dense(dense)
        return {**report, "verify_s": time.perf_counter() - t0}
