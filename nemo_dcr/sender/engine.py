"""The trainer side of a refit, on every rank: :class:`RefitSender`.

One version at a time: :meth:`RefitSender.submit` (collective) settles the version in flight,
diffs this one against the committed baseline (``chunker.py``) and returns; its chunks'
encode and upload, the manifest, the acks and the decision (``decision.py``, rank 0) run in
the background (``inflight.py``), and the decision is applied at the next call.  Only chunk
descriptors (a few hundred bytes per chunk) travel to rank 0; the baselines advance only when
every receiver acknowledged the version.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_dcr.baseline.pinned import Baseline
from nemo_dcr.codec.types import BITS_DTYPE, shape_numel
from nemo_dcr.errors import PlacementError, ProtocolError, ValidationError
from nemo_dcr.layout.mapping import CanonicalProjector, CanonicalSpec
from nemo_dcr.layout.shards import ParamView
from nemo_dcr.protocol.commit import CommitCoordinator, FailureBudget
from nemo_dcr.protocol.manifest import ChunkRef, Manifest, check_version
from nemo_dcr.protocol.history import RunState, resume_position
from nemo_dcr.protocol.run import claim_store
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.sender.chunker import Chunker
from nemo_dcr.sender.collectives import all_gather, from_rank0, gather_to0, log, rank, world
from nemo_dcr.sender.decision import Decider
from nemo_dcr.sender.feedback import CodingFeedback, measures
from nemo_dcr.sender.inflight import InFlight, settle_on_exit, watch_exit
from nemo_dcr.sender.options import RefitOptions
from nemo_dcr.sender.snapshots import CommittedBits, Snapshots
from nemo_dcr.sender.stats import Claim, PublishStats, RankReport, Verdict
from nemo_dcr.transport.store import ObjectStore
from nemo_dcr.transport.store.meter import combined, diff, snapshot_of


class ReceiverRefused(ProtocolError):
    """Training must stop: versions were aborted (refused, unacknowledged, or failed on a
    trainer rank) more often in a row than ``RefitOptions.on_refusal`` allows.  ``str(e)`` is
    one line naming each receiver and its reason (:meth:`of`)."""

    @classmethod
    def of(cls, version: int, in_a_row: int, on_refusal: str, reason: str) -> ReceiverRefused:
        """The error for ``version``'s abort: ``reason`` is the decision's ``"; "``-joined
        ``"<receiver>: <why>"`` list (``CommitCoordinator.collect_acks``), each part named
        ``receiver <id>: ...`` on one line."""
        import re

        parts = [" ".join(p.split()) for p in reason.split("; ") if p.strip()]
        named = [f"receiver {p}" if re.match(r"^[A-Za-z0-9_\-]{1,64}: ", p) else p for p in parts]
        return cls(f"refit stopped: version {version} not committed ({in_a_row} in a row, on_refusal={on_refusal}): "
                   + ("; ".join(named) or "no reason given"))


class RefitSender:
    """One per trainer rank; all ranks call :meth:`submit` / :meth:`refit` together."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        views: dict[str, list[ParamView]],
        projector: CanonicalProjector,
        store: ObjectStore,
        cfg: RefitOptions,
        *,
        committed_version: int = 0,
        snapshot_state: Callable[[], Mapping[str, torch.Tensor] | None] | None = None,
    ):
        """``snapshot_state``: collective, the canonical dense state of the committed
        baseline (:meth:`committed_bits`) on rank 0, None on the other ranks; called after a
        settle that committed a multiple of ``cfg.snapshot_interval``.  None: no snapshots."""
        self.params, self.views, self.projector, self.store, self.cfg = params, views, projector, store, cfg
        self.baseline = Baseline(params, version=committed_version)
        self.sealer = Sealer(load_key(cfg.key_file or None, log=log if rank() == 0 else None))
        self.chunker = Chunker(params, views, projector, self.baseline, store)
        self.snapshots = Snapshots(store, self.sealer, cfg.snapshot_interval, snapshot_state)
        self.coding = CodingFeedback(cfg.coding, cfg.upload_workers)
        self.decider: Decider | None = None  # rank 0, from claim() on
        self.run_id: str | None = None
        self.committed_digest = ""  # the committed version's decision digest (INIT.json's for v0)
        self._floor = 0  # the highest version number in use (by this or an earlier incarnation)
        self._failures = FailureBudget(cfg.on_refusal, cfg.max_consecutive_failures)
        self._inflight: InFlight | None = None
        # the background refit's collectives (chunk refs to rank 0, the decision back) run on a
        # group of their own, never interleaved with the training loop's on the default group;
        # its timeout covers a whole ack wait
        self._group = None
        if world() > 1:
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=max(1800.0, 2 * cfg.ack_timeout_s + 600.0)))
        # canonical inventory (union over ranks): what a dense refit would send
        mine = {c.name: c for vs in views.values() for v in vs if v.spec.is_main_replica
                for c in projector.canonical_specs(v.spec)}
        self.canonical: dict[str, CanonicalSpec] = {}
        for d in all_gather(mine):
            for name, c in d.items():
                prev = self.canonical.setdefault(name, c)
                if prev != c:
                    raise PlacementError(f"ranks disagree on canonical tensor {name}: {prev} vs {c}")
        self.canonical_numel = sum(shape_numel(c.shape) for c in self.canonical.values())
        self.dense_bytes = sum(shape_numel(c.shape) * BITS_DTYPE[c.dtype].itemsize for c in self.canonical.values())

    @property
    def snapshot_state(self) -> Callable[[], Mapping[str, torch.Tensor] | None] | None:
        return self.snapshots.state

    @snapshot_state.setter
    def snapshot_state(self, state: Callable[[], Mapping[str, torch.Tensor] | None] | None) -> None:
        self.snapshots.state = state

    # ------------------------------------------------------------------ run
    def set_coding(self, setting: str) -> None:
        """Switch ``refit.coding`` between versions (a benchmark's fixed codings against
        ``auto``; see ``CodingFeedback.switch``).  Refused while a version is in flight: its
        coding was chosen when it started."""
        if self._inflight is not None:
            raise ValidationError(f"refit.coding cannot change while v{self._inflight.version} is in flight")
        self.coding.switch(setting)
        self.cfg = dataclasses.replace(self.cfg, coding=setting)

    def claim(self, *, resume: RunState | None = None) -> str:
        """Collective: rank 0 claims the store for a new run, or checks the run ``resume``
        (the trainer checkpoint's run state) against the store's signed history; every rank
        learns the run id and position, and a refusal (another run's prefix, a checkpoint the
        history does not confirm, an unreachable store) raises the same error on every rank.

        Resuming, the baseline is the checkpoint's committed version -- the parameters hold
        exactly its bits, since they come from the same checkpoint -- and version numbers
        continue above every one in use, so a receiver never sees one number with two
        contents.  A new run's chain starts at version 0 once :meth:`set_root` names it."""
        claim = Claim()
        if rank() == 0:
            try:
                run_id = claim_store(self.store, self.sealer, self.cfg.model_id,
                                     resume_run_id=resume.run_id if resume else None).run_id
                claim = Claim(run_id=run_id)
                if resume is not None:
                    digest, floor = resume_position(self.store, self.sealer, resume)
                    claim = Claim(run_id=run_id, committed_version=resume.committed_version,
                                  committed_digest=digest, floor=floor)
            except Exception as e:  # noqa: BLE001 - every rank must learn the outcome
                claim = Claim(error=f"{type(e).__name__}: {e}")
        claim = from_rank0(claim)
        if claim.error is not None:
            raise ProtocolError(f"cannot start the run: {claim.error}")
        self.run_id = claim.run_id
        # the committed bits are what the parameters hold now: a new run's version 0 is
        # exported from them, a resumed run's weights were restored into them (possibly after
        # this sender was built, e.g. a framework loading its checkpoint after the callback
        # attached): a baseline kept from construction would diff against the wrong bits
        self.baseline.reset(self.params, version=claim.committed_version)
        self.committed_digest = claim.committed_digest
        self._floor = claim.floor
        if rank() == 0:
            coordinator = CommitCoordinator(self.store, self.sealer, claim.run_id, self.cfg.receivers,
                                            ack_timeout_s=self.cfg.ack_timeout_s, poll_s=self.cfg.ack_poll_s,
                                            membership=self.cfg.membership, min_receivers=self.cfg.min_receivers,
                                            evict_after=self.cfg.evict_after)
            self.decider = Decider(coordinator, self._failures, run_id=claim.run_id, model_id=self.cfg.model_id)
        return claim.run_id

    @property
    def coordinator(self) -> CommitCoordinator:
        """Rank 0: the run's joint commit."""
        if self.decider is None:
            raise ProtocolError("no commit coordinator on this rank (rank 0 only, after claim())")
        return self.decider.coordinator

    def set_root(self, init_digest: str) -> None:
        """Collective: version 0 is published; ``init_digest`` (rank 0's ``init/INIT.json``
        digest) is the root every version-1 manifest names as its base."""
        self.committed_digest = from_rank0(init_digest)

    def run_state(self) -> RunState:
        """What the trainer's checkpoint must carry to resume this run (see ``claim``)."""
        if self.run_id is None:
            raise ProtocolError("run_state before claim(): the sender has no run id")
        if self._inflight is not None:  # a checkpoint holds this version's bits: learn its decision first
            self._join(self._inflight)
        return RunState(run_id=self.run_id, committed_version=self.baseline.version,
                        committed_digest=self.committed_digest, published_version=self.published_version)

    @property
    def published_version(self) -> int:
        """The highest version number in use (published by this or an earlier incarnation);
        unlike :meth:`run_state`, it does not wait for the version in flight.  The one count
        of versions: a hook numbering versions itself continues from it."""
        return max(self._floor, self.baseline.version)

    @property
    def in_flight(self) -> int | None:
        """The version whose decision this rank has not applied yet (None: nothing pending)."""
        flight = self._inflight
        return None if flight is None or flight.applied else flight.version

    # ------------------------------------------------------------------ publish
    def _start(self, version: int, pool: ThreadPoolExecutor) -> tuple[list[Future], PublishStats]:
        """Diff every local parameter against the committed baseline (this thread) and submit
        its chunks to ``pool`` for encoding and upload.  Records submitted but not yet encoded
        are capped at ``pipeline_max_staged_bytes``: past it this waits for the encoder."""
        base = self.baseline.version
        check_version(version)
        if version <= self.published_version:
            raise ProtocolError(f"version {version} must be newer than the committed {base} and the last "
                                f"published {self._floor} (a version number is never reused)")
        self._floor = version  # used from here on, whatever happens to this version (its abort is recorded)
        if self.run_id is None:
            raise ProtocolError("publish before claim(): the sender has no run id")
        if not self.committed_digest:
            raise ProtocolError("publish before the chain's root is known (version 0 not exported)")
        stats = PublishStats(version=version, base_version=base, coding=self.coding.current)
        meta = {"run_id": self.run_id, "model_id": self.cfg.model_id, "version": str(version),
                "base_version": str(base), "rank": str(rank())}
        keep_sample = self.coding.wants_sample()
        futures, sample = self.chunker.start(stats, meta, chunk_bytes=self.cfg.chunk_bytes,
                                             max_staged_bytes=self.cfg.pipeline_max_staged_bytes, pool=pool,
                                             keep_sample=keep_sample)
        if keep_sample and sample:
            self.coding.probe_sample = sample  # the probe runs once, at the next choice
        return futures, stats

    def publish(self, version: int) -> tuple[list[ChunkRef], PublishStats]:
        """Diff every local parameter against the committed baseline and upload the chunks
        of ``version`` (not yet the manifest).  Returns this rank's chunk refs."""
        t_start = time.perf_counter()
        with ThreadPoolExecutor(self.cfg.upload_workers, thread_name_prefix="dcr-upload") as pool:
            futures, stats = self._start(version, pool)
            refs = Chunker.finish_uploads(futures, stats)
        stats.publish_s = time.perf_counter() - t_start
        return refs, stats

    # ------------------------------------------------------------------ commit
    def refit(self, version: int, *, before_manifest: Callable[[Manifest], None] | None = None) -> PublishStats:
        """Collective: publish ``version`` and run the joint commit (``protocol/commit.py``);
        returns once it is decided (the synchronous refit).

        ``before_manifest(manifest)`` runs on rank 0 just before the manifest is written,
        i.e. before any receiver can see the version (the demo writes its dense reference
        there).  Every rank ends with the same decision: on commit the baselines advance;
        otherwise they stay at the committed version (the next delta still applies) and
        ``stats.committed`` is False -- unless the refusal policy says to stop, in which
        case every rank raises ``ReceiverRefused``.  A failure on any rank (a store error
        while uploading, a crash in encoding) aborts the version on every rank instead of
        leaving peers in a collective.  The returned stats are totals on rank 0.
        """
        t0 = time.perf_counter()
        self.submit(version, before_manifest=before_manifest)
        stats = self.settle()
        if stats is None:
            raise ProtocolError(f"version {version}: nothing in flight after its submit")
        # the loop was held until the decision (every rank waits for the same broadcast)
        stats.pause_s = time.perf_counter() - t0
        return stats

    def submit(self, version: int, *, before_manifest: Callable[[Manifest], None] | None = None) -> PublishStats | None:
        """Collective, the pipelined refit: settle the version in flight (waiting only if its
        decision is not there yet), diff ``version`` against the committed baseline, hand its
        chunks to the encoder and return; encode, upload, manifest, acks and the decision run
        in the background.  Returns the stats of the version settled here (None if there was
        none); it raises what :meth:`refit` raises, one call later."""
        t_enter = time.perf_counter()
        settled = self.settle()
        t_start = time.perf_counter()
        mark = snapshot_of(self.store)
        pool = ThreadPoolExecutor(self.cfg.upload_workers, thread_name_prefix="dcr-upload")
        try:
            futures, stats = self._start(version, pool)
            error = None
        except Exception as e:  # noqa: BLE001 - reported to rank 0, decided for all ranks
            futures, error = [], f"rank {rank()}: {type(e).__name__}: {e}"
            stats = PublishStats(version=version, base_version=self.baseline.version)
        stats.pause_s = time.perf_counter() - t_enter
        flight = InFlight(version=version, stats=stats, t_start=t_start, store_mark=mark)
        flight.thread = threading.Thread(target=self._background, args=(flight, pool, futures, error, before_manifest),
                                         name=f"dcr-refit-v{version}", daemon=True)
        self._inflight = flight
        watch_exit(self)
        flight.thread.start()
        return settled

    def settle(self) -> PublishStats | None:
        """Every rank calls it at the same point: wait for the version in flight (if any),
        apply its decision on this rank and check that every rank reached the same one;
        returns its stats (None if no version was in flight).  A failure of the background
        work on any rank, or a decision the refusal policy stops on, raises the same error on
        every rank.  It holds no collective of its own (the ranks' outcomes were gathered by
        the background work), so a rank never waits here for a slower one to arrive; the one
        collective is the snapshot gather every ``snapshot_interval`` committed versions."""
        flight = self._inflight
        if flight is None:
            return None
        self._join(flight)
        self._inflight = None
        outcomes = flight.outcomes
        if outcomes is None:  # the outcome gather itself failed here: the group is broken
            raise ProtocolError(f"version {flight.version}: the background refit failed on rank {rank()}: "
                                f"{flight.failure}")
        failed = [(r, o.failure) for r, o in enumerate(outcomes) if o.failure]
        if failed:
            r, why = failed[0]
            raise ProtocolError(f"version {flight.version}: the background refit failed on rank {r}: {why}")
        if len({o.decision() for o in outcomes}) != 1:
            raise ProtocolError(f"version {flight.version}: ranks applied different decisions "
                                f"{[o.decision() for o in outcomes]}")
        verdict = flight.verdict
        stats = flight.stats
        stats.next_coding = verdict.next_coding or stats.coding
        stats.committed, stats.reason = verdict.commit, verdict.reason
        if verdict.stop:
            raise ReceiverRefused.of(flight.version, self._failures.consecutive, self.cfg.on_refusal, verdict.reason)
        if not verdict.commit and rank() == 0:
            log(f"nemo_dcr: version {flight.version} aborted, training continues and the next version is diffed "
                f"against version {self.baseline.version}: {verdict.reason}")
        if verdict.commit:
            stats.snapshot_s = self.snapshots.after_commit(self.run_id, flight.version, self.committed_digest)
        return stats

    def finish(self) -> PublishStats | None:
        """Collective: drain the pipeline at the end of training (the last version is decided
        and reported, and a snapshot upload still running is waited for); the callbacks call
        it at train end.  Otherwise the same as :meth:`settle`.  A process that ends without
        it settles the version in flight anyway (:meth:`settle_on_exit`)."""
        try:
            return self.settle()
        finally:
            self.wait_snapshot()

    def settle_on_exit(self, why: str = "interpreter exit") -> str | None:
        """This rank alone, bounded: the version in flight reaches its decision before the
        process ends (``inflight.settle_on_exit``); a one-line report on rank 0."""
        return settle_on_exit(self._inflight, ack_timeout_s=self.cfg.ack_timeout_s,
                              committed_version=self.baseline.version, why=why)

    # ------------------------------------------------------------------ snapshots
    def committed_bits(self) -> CommittedBits:
        """The committed baseline as this rank's parameters (dtype, shape), copied per lookup."""
        return CommittedBits(self.params, self.baseline)

    def wait_snapshot(self) -> bool | None:
        """This rank: wait for the snapshot upload in progress, if any; True/False: whether it
        was written, None: none was pending."""
        return self.snapshots.wait()

    # ------------------------------------------------------------------ the background work
    def _join(self, flight: InFlight) -> None:
        """This rank alone (no collective): wait for the background work of ``flight`` and
        apply its decision to the baseline, once."""
        flight.thread.join()
        if flight.applied:
            return
        flight.applied = True
        verdict = flight.verdict
        if verdict is not None and verdict.next_coding:
            self.coding.current = verdict.next_coding
        if flight.commit:
            self.baseline.commit(flight.version)
            self.committed_digest = verdict.digest
        else:
            self.baseline.discard()

    def _background(self, flight: InFlight, pool: ThreadPoolExecutor, futures: list[Future], error: str | None,
                    before_manifest: Callable[[Manifest], None] | None) -> None:
        """One version after the hook returned, on every rank: finish the uploads, send the
        chunk refs to rank 0, which writes the manifest and runs the joint commit, and learn
        the decision.  Its collectives use the refit's own process group (``self._group``), so
        they never interleave with the training loop's.  Never raises: a failure is kept in
        ``flight.failure`` and surfaces at the next :meth:`settle`, on every rank."""
        stats = flight.stats
        try:
            refs: list[ChunkRef] = []
            try:
                if error is None:
                    refs = Chunker.finish_uploads(futures, stats)
            except Exception as e:  # noqa: BLE001 - reported to rank 0, decided for all ranks
                refs, error = [], f"rank {rank()}: {type(e).__name__}: {e}"
            finally:
                pool.shutdown(wait=True)
            stats.publish_s = time.perf_counter() - flight.t_start
            stats.requests = diff(snapshot_of(self.store), flight.store_mark)  # this rank's uploads
            reports = gather_to0(RankReport(refs=tuple(refs), stats=stats, error=error), self._group)
            decision: Verdict | str | None = None
            if rank() == 0 and not flight.may_publish():
                decision = f"rank 0: the trainer process exited before version {flight.version} was published"
            elif rank() == 0:
                decision = self._decide_on_rank0(flight, stats, reports, before_manifest)
                stats.requests = combined([diff(snapshot_of(self.store), flight.store_mark),
                                           *(rep.stats.requests for rep in reports[1:])])
            flight.mark_recorded(decision)
            decision = from_rank0(decision, self._group)
            if isinstance(decision, str):
                raise ProtocolError(decision)
            flight.verdict = decision
            stats.refit_s = time.perf_counter() - flight.t_start
        except BaseException as e:  # noqa: BLE001 - kept for settle(), which raises it on every rank
            flight.failure = f"{type(e).__name__}: {e}"
            flight.verdict = None
        flight.mark_recorded()
        # every rank learns every rank's outcome here, off the training loop, so that settle()
        # needs no collective: the hook never waits for a slower rank to reach it
        try:
            flight.outcomes = all_gather(flight.outcome_here(), self._group)
        except BaseException as e:  # noqa: BLE001 - settle() raises it on this rank
            flight.failure = flight.failure or f"{type(e).__name__}: {e}"
            flight.outcomes = None

    def _decide_on_rank0(self, flight: InFlight, stats: PublishStats, reports: list[RankReport],
                         before_manifest: Callable[[Manifest], None] | None) -> Verdict | str:
        """Rank 0: the decision and the next version's coding; a failure here is the
        version's reason (every rank waits for rank 0's word: it is always sent)."""
        try:
            per_rank = measures(reports)  # before the decision turns rank 0's stats into totals
            verdict = self.decider.decide(flight.version, stats, reports, base_digest=self.committed_digest,
                                          dense_bytes=self.dense_bytes, before_manifest=before_manifest)
            next_coding = self.coding.next_coding(stats, per_rank, errors=any(rep.error for rep in reports),
                                                  t_start=flight.t_start, context_bases=self.chunker.context_bases)
            return Verdict(commit=verdict.commit, reason=verdict.reason, stop=verdict.stop, digest=verdict.digest,
                           next_coding=next_coding)
        except BaseException as e:  # noqa: BLE001 - every rank waits for rank 0's word: send it
            return f"rank 0: {type(e).__name__}: {e}"
