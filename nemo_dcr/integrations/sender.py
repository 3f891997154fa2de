"""Trainer side of a refit: diff -> project -> encode -> upload, on every rank, streaming.

Hot path (``publish``), per local parameter in model order::

    xor_diff(param, baseline)      one read of param + baseline: 2 x numel x 2 B (BF16)
    project changed positions      O(changed): unravel, add shard offsets, fused-layout math
    encode + upload                on a thread pool, while the next parameters are diffed

Nothing is gathered across ranks: each rank emits only the canonical elements of its main
replicas (Megatron's ``replica_id``), so every canonical element is sent exactly once.
Only chunk descriptors (a few hundred bytes per chunk) travel to rank 0, which publishes
the manifest and runs the joint commit: the baselines advance only when every receiver
acknowledged the version.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nemo_dcr.baseline.pinned import Baseline
from nemo_dcr.codec import chunk_digest
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta, shape_numel
from nemo_dcr.errors import PlacementError, ProtocolError
from nemo_dcr.integrations.coding_choice import (
    AUTO,
    AUTO_START,
    CODINGS,
    CodingChooser,
    VersionObservation,
    describe,
    encode_parallelism,
    encode_with,
    probe,
)
from nemo_dcr.integrations.settings import RefitOptions
from nemo_dcr.layout.mapping import CanonicalProjector, CanonicalSpec
from nemo_dcr.layout.runs import CanonicalRuns, canonical_runs
from nemo_dcr.layout.shards import ParamView
from nemo_dcr.protocol.commit import CommitCoordinator, FailureBudget
from nemo_dcr.protocol.manifest import ChunkRef, Manifest, check_version, chunk_key
from nemo_dcr.protocol.run import RunState, claim_store, resume_position
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.protocol.snapshot import prune_snapshots, write_snapshot
from nemo_dcr.transport.store import ObjectStore


EXIT_PUBLISH_GRACE_S = 60.0
"""Settling on exit (:meth:`RefitSender.settle_on_exit`): how long rank 0 waits for the
version in flight to reach its manifest (its ranks' remaining uploads, their chunk refs
gathered to rank 0).  Past it the version is given up before anything names it: no manifest,
no HEAD, so receivers stay on the committed version."""
EXIT_DECIDE_GRACE_S = 10.0
"""Settling on exit: beyond ``ack_timeout_s`` from the manifest's publication, the time left
for the decision record's (retried) put; rank 0 then gives the other ranks this long again
to receive the decision."""
_SETTLE_ON_EXIT = True
"""Private switch for tests: False runs a process without the exit settle (the old
behaviour, a control), set before the first version is submitted."""


def exit_settle_bound_s(ack_timeout_s: float) -> float:
    """The longest :meth:`RefitSender.settle_on_exit` holds a rank at interpreter exit or
    SIGTERM: the publish grace, the ack timeout and the decide grace."""
    return EXIT_PUBLISH_GRACE_S + ack_timeout_s + EXIT_DECIDE_GRACE_S


class ReceiverRefused(ProtocolError):
    """Training must stop: versions were aborted (refused, unacknowledged, or failed on a
    trainer rank) more often in a row than ``SenderConfig.on_refusal`` allows."""


@dataclass(kw_only=True, frozen=True)
class SenderConfig(RefitOptions):
    """The refit schema (:class:`~nemo_dcr.integrations.settings.RefitOptions`: every field,
    its default, validation and meaning) as :class:`RefitSender` takes it.  It adds nothing,
    so no setting can be lost between the settings a user wrote and the sender: settings
    that embed the schema give theirs with ``.sender_config()``."""


@dataclass
class PublishStats:
    version: int
    base_version: int
    changed: int = 0
    numel: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    chunks: int = 0
    diff_s: float = 0.0
    project_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    publish_s: float = 0.0
    commit_wait_s: float = 0.0
    reference_s: float = 0.0
    """Verification only: time to gather the dense reference (not part of a refit)."""
    committed: bool = False
    reason: str = ""
    """Why the version was aborted ('' when committed)."""
    acks: list[dict] = field(default_factory=list)
    members: tuple[str, ...] = ()
    """The receivers the decision covered (rank 0)."""
    joined: tuple[str, ...] = ()
    """Receivers admitted at this version (elastic membership; rank 0)."""
    evicted: tuple[str, ...] = ()
    """Receivers evicted at this version (elastic membership; rank 0)."""
    pause_s: float = 0.0
    """How long the call that published this version held the training loop: pipelined
    (``submit``), its settle of the previous version plus the diff and projection, the
    slowest rank's on rank 0; synchronous (``refit``), the whole refit, this rank's."""
    refit_s: float = 0.0
    """Wall time from the start of the diff to the decision, on this rank."""
    snapshot_s: float = 0.0
    """Gathering this committed version's snapshot (``refit.snapshot_every``), in the call
    that settled it (its upload runs in the background on rank 0); 0 when none was taken."""
    coding: str = ""
    """The coding this version's chunks used (``refit.coding``; under ``auto``, the choice)."""
    raw_bytes: int = 0
    """Raw record bytes (positions + values) handed to the encoder (totals on rank 0)."""
    encode_cpu_s: float = 0.0
    """CPU seconds of the encode calls, summed over chunks (totals over ranks on rank 0)."""
    puts: list[tuple[int, float]] = field(default_factory=list)
    """This rank's chunks as (wire bytes, put seconds), for ``refit.coding=auto``."""
    next_coding: str = ""
    """The coding decided for the next version (``auto``: rank 0's choice, on every rank)."""
    coding_walls: dict[str, float] = field(default_factory=dict)
    """``auto``, rank 0: every candidate's projected wall (s) behind ``next_coding`` ({}
    before anything was measured)."""


def _split(delta: TensorDelta, chunk_bytes: int):
    """Cut a record into pieces of at most ``chunk_bytes`` raw bytes (positions + values),
    each with the tight element range of its positions, so one large tensor streams as
    several chunks instead of one."""
    per = max(1, chunk_bytes // (8 + delta.values.itemsize))
    if delta.nnz <= per:
        yield delta
        return
    for i in range(0, delta.nnz, per):
        pos, val = delta.positions[i : i + per], delta.values[i : i + per]
        yield TensorDelta(name=delta.name, dtype=delta.dtype, shape=delta.shape, op=delta.op,
                          positions=pos, values=val, element_range=(int(pos[0]), int(pos[-1]) + 1))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def from_rank0(obj, group=None):
    """Collective over ``group`` (default: the default group): rank 0's ``obj`` on every rank
    (``obj`` itself without a process group).  For small plain values only (it travels
    pickled between this job's own ranks)."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(obj, group=None) -> list:
    """Collective over ``group`` (default: the default group): every rank's ``obj``, in rank
    order (``[obj]`` without a process group)."""
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj, group=group)
    return out


def _gather_to0(obj, group) -> list | None:
    """Collective over ``group`` (every rank): rank 0 gets every rank's ``obj``."""
    if _world() == 1:
        return [obj]
    out = [None] * _world() if _rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


class CommittedBits(Mapping):
    """The committed baseline as tensors of the parameters' dtypes and shapes, one copy per
    lookup (``params[name]``): what a snapshot gathers instead of the live parameters, which
    already hold the next step.  A copy, so nothing downstream can write the baseline."""

    def __init__(self, params: dict[str, torch.Tensor], baseline: Baseline):
        self._params, self._baseline = params, baseline

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name]
        bits = self._baseline.bits(name)
        signed = bits.view(np.dtype(f"i{bits.itemsize}")).copy()
        return torch.from_numpy(signed).view(p.dtype).reshape(p.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


@dataclass(eq=False)
class _InFlight:
    """A version between its hook call and the settling of its decision on this rank."""

    version: int
    stats: PublishStats
    t_start: float
    thread: threading.Thread | None = None
    commit: bool = False
    reason: str = ""
    stop: bool = False
    digest: str = ""
    failure: str = ""
    """The background work itself failed on this rank (not an abort: a lost collective, a bug)."""
    outcomes: list | None = None
    """Every rank's (version, commit, digest, failure), gathered by the background work once
    the decision is known; None if that gather itself failed on this rank."""
    applied: bool = False
    next_coding: str = ""
    """The coding rank 0 decided for the next version ('' = unchanged)."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    """Guards the exit fields below (rank 0's background work and :meth:`RefitSender.settle_on_exit`)."""
    publishing_at: float | None = None
    """Rank 0: ``time.monotonic()`` when the manifest's publication began (None: not yet)."""
    recorded: bool = False
    """Rank 0: the background work is past the decision (recorded, or failed before any)."""
    abandoned: bool = False
    """Rank 0: the process exits and gave up on this version before its manifest: never publish it."""
    exit_settled: bool = False
    """:meth:`RefitSender.settle_on_exit` ran for this version (it reports once)."""
    outcome: tuple | str | None = None
    """Rank 0: the decision as recorded (what the background work broadcasts), for the exit report."""


class RefitSender:
    """One per trainer rank; all ranks call ``refit(version)`` together (it is collective)."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        views: dict[str, list[ParamView]],
        projector: CanonicalProjector,
        store: ObjectStore,
        cfg: SenderConfig,
        *,
        committed_version: int = 0,
        snapshot_state: Callable[[], Mapping[str, torch.Tensor] | None] | None = None,
    ):
        """``snapshot_state``: collective, the canonical dense state of the committed
        baseline (:meth:`committed_bits`) on rank 0, None on the other ranks; called after a
        settle that committed a multiple of ``cfg.snapshot_interval``.  None: no snapshots."""
        self.params = params
        self.snapshot_state = snapshot_state
        self._snapshot_pool: ThreadPoolExecutor | None = None  # rank 0: serialize + upload
        self._snapshot_upload: Future | None = None
        self.views = views
        self.projector = projector
        self.store = store
        self.cfg = cfg
        self.baseline = Baseline(params, version=committed_version)
        self.sealer = Sealer(load_key(cfg.key_file or None, log=_log if _rank() == 0 else None))
        self.run_id: str | None = None
        self.committed_digest = ""  # the committed version's decision digest (INIT.json's for v0)
        self._floor = 0  # highest version published so far (by this or an earlier incarnation)
        self._failures = FailureBudget(cfg.on_refusal, cfg.max_consecutive_failures)
        self._inflight: _InFlight | None = None
        # the background refit's collectives (chunk refs to rank 0, the decision back) run on a
        # group of their own, never interleaved with the training loop's on the default group;
        # its timeout covers a whole ack wait
        self._group = None
        if _world() > 1:
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=max(1800.0, 2 * cfg.ack_timeout_s + 600.0)))
        # canonical inventory (union over ranks): what a dense refit would send
        mine = {c.name: c for vs in views.values() for v in vs if v.spec.is_main_replica
                for c in projector.canonical_specs(v.spec)}
        allspecs: list[dict[str, CanonicalSpec]] = all_gather(mine)
        self.canonical: dict[str, CanonicalSpec] = {}
        for d in allspecs:
            for name, c in d.items():
                prev = self.canonical.setdefault(name, c)
                if prev != c:
                    raise PlacementError(f"ranks disagree on canonical tensor {name}: {prev} vs {c}")
        # context mode: where this rank can rebuild a record's canonical base bits (built
        # whatever refit.coding says: auto may choose context, and a test bed may switch codings)
        self._runs: dict[tuple[str, str], CanonicalRuns] = {}
        for pname, vs in views.items():
            for v in vs:
                if v.spec.is_main_replica:
                    for cname, runs in canonical_runs(projector, v).items():
                        if runs.contiguous:
                            self._runs[(pname, cname)] = runs
        # refit.coding=auto: the coding of the next version (the same on every rank: rank 0
        # decides it and sends it with each decision); the chooser and its probe on rank 0
        self._coding = AUTO_START
        self._chooser: CodingChooser | None = None
        self._probe_sample: list[tuple[TensorDelta, str]] | None = None
        self.canonical_numel = sum(shape_numel(c.shape) for c in self.canonical.values())
        self.dense_bytes = sum(shape_numel(c.shape) * BITS_DTYPE[c.dtype].itemsize for c in self.canonical.values())

    # ------------------------------------------------------------------ run
    def claim(self, *, resume: RunState | None = None) -> str:
        """Collective: rank 0 claims the store for a new run, or checks the run ``resume``
        (the trainer checkpoint's run state) against the store's signed history; every rank
        learns the run id and position, and a refusal (another run's prefix, a checkpoint the
        history does not confirm, an unreachable store) raises the same error on every rank.

        Resuming, the baseline is the checkpoint's committed version -- the parameters hold
        exactly its bits, since they come from the same checkpoint -- and version numbers
        continue above every one in use, so a receiver never sees one number with two
        contents.  A new run's chain starts at version 0 once :meth:`set_root` names it."""
        result: tuple = (None, 0, "", 0, None)
        if _rank() == 0:
            try:
                run_id = claim_store(self.store, self.sealer, self.cfg.model_id,
                                     resume_run_id=resume.run_id if resume else None).run_id
                if resume is not None:
                    digest, floor = resume_position(self.store, self.sealer, resume)
                    result = (run_id, resume.committed_version, digest, floor, None)
                else:
                    result = (run_id, 0, "", 0, None)
            except Exception as e:  # noqa: BLE001 - every rank must learn the outcome
                result = (None, 0, "", 0, f"{type(e).__name__}: {e}")
        run_id, committed, digest, floor, error = from_rank0(result)
        if error is not None:
            raise ProtocolError(f"cannot start the run: {error}")
        self.run_id = run_id
        # the committed bits are what the parameters hold now: a new run's version 0 is
        # exported from them, a resumed run's weights were restored into them (possibly after
        # this sender was built, e.g. a framework loading its checkpoint after the callback
        # attached): a baseline kept from construction would diff against the wrong bits
        self.baseline.reset(self.params, version=committed)
        self.committed_digest = digest
        self._floor = floor
        if _rank() == 0:
            self.coordinator = CommitCoordinator(self.store, self.sealer, run_id, self.cfg.receivers,
                                                 ack_timeout_s=self.cfg.ack_timeout_s, poll_s=self.cfg.ack_poll_s,
                                                 membership=self.cfg.membership, min_receivers=self.cfg.min_receivers,
                                                 evict_after=self.cfg.evict_after)
        return run_id

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
                        committed_digest=self.committed_digest, published_version=max(self._floor,
                                                                                      self.baseline.version))

    # ------------------------------------------------------------------ publish
    def _deltas_for_param(self, name: str, positions: np.ndarray, xor: np.ndarray, stats: PublishStats):
        t0 = time.perf_counter()
        per_name: dict[str, tuple[CanonicalSpec, list[np.ndarray], list[np.ndarray]]] = {}
        for v in self.views[name]:
            if not v.spec.is_main_replica:
                continue
            lo, hi = np.searchsorted(positions, [v.start, v.start + v.spec.numel])
            if lo == hi:
                continue
            local = positions[lo:hi] - v.start
            vals = xor[lo:hi]
            for cspec, cflat, sel in self.projector.project(v.spec, local):
                entry = per_name.setdefault(cspec.name, (cspec, [], []))
                entry[1].append(cflat)
                entry[2].append(vals[sel])
        out = []
        for cname, (cspec, pos_l, val_l) in per_name.items():
            pos = np.concatenate(pos_l)
            val = np.concatenate(val_l)
            if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
                order = np.argsort(pos, kind="stable")
                pos, val = pos[order], val[order]
            out.append(TensorDelta(name=cname, dtype=cspec.dtype, shape=cspec.shape, op=DeltaOp.XOR,
                                   positions=pos, values=val,
                                   element_range=(int(pos[0]), int(pos[-1]) + 1)))
        stats.project_s += time.perf_counter() - t0
        return out

    def _context_bases(self, records: list[tuple[TensorDelta, str]]) -> dict[str, np.ndarray]:
        """Committed canonical base bits over each context-coded record's range.  The arrays
        are full-length but only ``[lo, hi)`` of each record is written or read by the
        codec (``np.empty``: untouched pages cost no memory)."""
        bases: dict[str, np.ndarray] = {}
        for d, pname in records:
            runs = self._runs.get((pname, d.name))
            if runs is None:
                continue
            arr = bases.get(d.name)
            if arr is None:
                arr = bases[d.name] = np.empty(d.numel, dtype=BITS_DTYPE[d.dtype])
            lo, hi = d.element_range
            runs.fill(arr, self.baseline.bits(pname), lo, hi)
        return bases

    def _encode_upload(self, key: str, records: list[tuple[TensorDelta, str]], meta: dict[str, str],
                       coding: str) -> tuple[ChunkRef, float, float, float]:
        """Encode one chunk under ``coding`` and put it; returns its ref, the encode's wall
        and CPU seconds (this thread's: the coders run in it) and the put's wall seconds."""
        t0, c0 = time.perf_counter(), time.thread_time()
        deltas = [d for d, _ in records]
        base = self._context_bases(records) if CODINGS[coding].uses_base else None
        blob = encode_with(coding, deltas, meta=meta, base=base)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.store.put(key, blob)
        t2 = time.perf_counter()
        ref = ChunkRef(key=key, nbytes=len(blob), digest=chunk_digest(blob), rank=_rank(),
                       tensors=len(deltas), changed=sum(d.nnz for d in deltas))
        return ref, t1 - t0, t2 - t1, c1 - c0

    def _start(self, version: int, pool: ThreadPoolExecutor) -> tuple[list[Future], PublishStats]:
        """Diff every local parameter against the committed baseline (this thread) and submit
        its chunks to ``pool`` for encoding and upload.  Records submitted but not yet encoded
        are capped at ``pipeline_max_staged_bytes``: past it this waits for the encoder."""
        base = self.baseline.version
        check_version(version)
        if version <= max(base, self._floor):
            raise ProtocolError(f"version {version} must be newer than the committed {base} and the last "
                                f"published {self._floor} (a version number is never reused)")
        coding = self._coding if self.cfg.coding == AUTO else self.cfg.coding
        stats = PublishStats(version=version, base_version=base, coding=coding)
        want_sample = self.cfg.coding == AUTO and _rank() == 0 and self._probe_sample is None and (
            self._chooser is None or self._chooser.needs_probe)
        if self.run_id is None:
            raise ProtocolError("publish before claim(): the sender has no run id")
        if not self.committed_digest:
            raise ProtocolError("publish before the chain's root is known (version 0 not exported)")
        self._floor = version  # used from here on, whatever happens to this version
        meta = {"run_id": self.run_id, "model_id": self.cfg.model_id, "version": str(version),
                "base_version": str(base), "rank": str(_rank())}
        futures: list[Future] = []
        sizes: dict[Future, int] = {}  # staged raw bytes of each chunk not yet known encoded
        pending: list[tuple[TensorDelta, str]] = []  # (record, parameter it came from)
        pending_bytes = 0
        seq = 0

        def flush():
            nonlocal pending, pending_bytes, seq, want_sample
            if pending:
                if want_sample:  # rank 0, auto: the probe's sample chunk (run once, in _next_coding)
                    self._probe_sample, want_sample = list(pending), False
                while sizes and sum(sizes.values()) + pending_bytes > self.cfg.pipeline_max_staged_bytes:
                    wait(list(sizes), return_when=FIRST_COMPLETED)
                    for f in [f for f in sizes if f.done()]:
                        del sizes[f]
                f = pool.submit(self._encode_upload, chunk_key(version, _rank(), seq), pending, meta, coding)
                futures.append(f)
                sizes[f] = pending_bytes
                stats.raw_bytes += pending_bytes
                seq += 1
            pending, pending_bytes = [], 0

        for name, p in self.params.items():
            t0 = time.perf_counter()
            d = self.baseline.diff(name, p)
            stats.diff_s += time.perf_counter() - t0
            stats.numel += d.numel
            if d.positions.size == 0:
                continue
            for delta in self._deltas_for_param(name, d.positions, d.xor_values, stats):
                stats.changed += delta.nnz
                for piece in _split(delta, self.cfg.chunk_bytes):
                    size = piece.nnz * (8 + piece.values.itemsize)
                    if pending and pending_bytes + size > self.cfg.chunk_bytes:
                        flush()
                    pending.append((piece, name))
                    pending_bytes += size
        flush()
        return futures, stats

    @staticmethod
    def _finish_uploads(futures: list[Future], stats: PublishStats) -> list[ChunkRef]:
        refs = []
        for f in futures:
            ref, enc_s, up_s, enc_cpu_s = f.result()
            refs.append(ref)
            stats.encode_s += enc_s
            stats.upload_s += up_s
            stats.encode_cpu_s += enc_cpu_s
            stats.puts.append((ref.nbytes, up_s))
        stats.chunks = len(refs)
        stats.wire_bytes = sum(r.nbytes for r in refs)
        return refs

    def publish(self, version: int) -> tuple[list[ChunkRef], PublishStats]:
        """Diff every local parameter against the committed baseline and upload the chunks
        of ``version`` (not yet the manifest).  Returns this rank's chunk refs."""
        t_start = time.perf_counter()
        with ThreadPoolExecutor(self.cfg.upload_workers, thread_name_prefix="dcr-upload") as pool:
            futures, stats = self._start(version, pool)
            refs = self._finish_uploads(futures, stats)
        stats.publish_s = time.perf_counter() - t_start
        return refs, stats

    # ------------------------------------------------------------------ commit
    def refit(self, version: int, *, before_manifest=None) -> PublishStats:
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
        assert stats is not None
        # the loop was held until the decision (every rank waits for the same broadcast)
        stats.pause_s = time.perf_counter() - t0
        return stats

    def submit(self, version: int, *, before_manifest=None) -> PublishStats | None:
        """Collective, the pipelined refit: settle the version in flight (waiting only if its
        decision is not there yet), diff ``version`` against the committed baseline, hand its
        chunks to the encoder and return; encode, upload, manifest, acks and the decision run
        in the background.  Returns the stats of the version settled here (None if there was
        none); it raises what :meth:`refit` raises, one call later."""
        t_enter = time.perf_counter()
        settled = self.settle()
        t_start = time.perf_counter()
        pool = ThreadPoolExecutor(self.cfg.upload_workers, thread_name_prefix="dcr-upload")
        try:
            futures, stats = self._start(version, pool)
            error = None
        except Exception as e:  # noqa: BLE001 - reported to rank 0, decided for all ranks
            futures, error = [], f"rank {_rank()}: {type(e).__name__}: {e}"
            stats = PublishStats(version=version, base_version=self.baseline.version)
        stats.pause_s = time.perf_counter() - t_enter
        flight = _InFlight(version=version, stats=stats, t_start=t_start)
        flight.thread = threading.Thread(target=self._background, args=(flight, pool, futures, error, before_manifest),
                                         name=f"dcr-refit-v{version}", daemon=True)
        self._inflight = flight
        _watch_exit(self)
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
            raise ProtocolError(f"version {flight.version}: the background refit failed on rank {_rank()}: "
                                f"{flight.failure}")
        failed = [(r, o[3]) for r, o in enumerate(outcomes) if o[3]]
        if failed:
            r, why = failed[0]
            raise ProtocolError(f"version {flight.version}: the background refit failed on rank {r}: {why}")
        if len({(o[0], o[1], o[2], o[4]) for o in outcomes}) != 1:
            raise ProtocolError(f"version {flight.version}: ranks applied different decisions {sorted(set(outcomes))}")
        stats = flight.stats
        stats.next_coding = flight.next_coding or stats.coding
        stats.committed, stats.reason = flight.commit, flight.reason
        if flight.stop:
            raise ReceiverRefused(f"version {flight.version} not committed ({self._failures.consecutive} in a row, "
                                  f"on_refusal={self.cfg.on_refusal}): {flight.reason}")
        if not flight.commit and _rank() == 0:
            _log(f"nemo_dcr: version {flight.version} aborted, training continues and the next version is diffed "
                 f"against version {self.baseline.version}: {flight.reason}")
        if flight.commit:
            self._maybe_snapshot(flight.version, stats)
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

    # ------------------------------------------------------------------ snapshots
    def committed_bits(self) -> CommittedBits:
        """The committed baseline as this rank's parameters (dtype, shape), copied per lookup."""
        return CommittedBits(self.params, self.baseline)

    def _maybe_snapshot(self, version: int, stats: PublishStats) -> None:
        """Collective, right after every rank applied the commit of ``version``: if it is a
        multiple of ``snapshot_interval``, gather the committed state (``snapshot_state``)
        and hand its serialization and upload to rank 0's snapshot worker.  Skipped (logged)
        while the previous upload still runs; a failure is logged, never raised: a snapshot
        only speeds up joins, training does not depend on it."""
        every = self.cfg.snapshot_interval
        if not every or version % every or self.snapshot_state is None:
            return
        busy = from_rank0(self._snapshot_upload is not None and not self._snapshot_upload.done())
        if busy:
            if _rank() == 0:
                _log(f"nemo_dcr: snapshot of v{version} skipped: the previous one is still uploading")
            return
        t0 = time.perf_counter()
        try:
            state = self.snapshot_state()
        except Exception as e:  # noqa: BLE001 - a snapshot never stops training
            _log(f"nemo_dcr: snapshot of v{version} not taken on rank {_rank()}: {type(e).__name__}: {e}")
            return
        stats.snapshot_s = time.perf_counter() - t0
        if _rank() != 0 or state is None:
            return
        if self._snapshot_pool is None:
            self._snapshot_pool = ThreadPoolExecutor(1, thread_name_prefix="dcr-snapshot")
        self._snapshot_upload = self._snapshot_pool.submit(self._upload_snapshot, version, self.committed_digest,
                                                           state)

    def _upload_snapshot(self, version: int, decision_digest: str, state: Mapping[str, torch.Tensor]) -> bool:
        """Rank 0, the snapshot worker: serialize, upload (record last), prune the old ones."""
        from safetensors.torch import save as save_safetensors

        t0 = time.perf_counter()
        try:
            blob = save_safetensors({k: v.contiguous() for k, v in sorted(state.items())})
            del state
            write_snapshot(self.store, self.sealer, self.run_id, version, decision_digest,
                           {"model.safetensors": blob})
        except Exception as e:  # noqa: BLE001 - logged, training goes on; no record was written
            _log(f"nemo_dcr: snapshot of v{version} failed, skipped: {type(e).__name__}: {e}")
            return False
        _log(f"nemo_dcr: snapshot of v{version} written ({len(blob)} bytes, {time.perf_counter() - t0:.1f} s)")
        try:
            prune_snapshots(self.store, self.sealer, self.run_id)
        except Exception as e:  # noqa: BLE001 - best effort
            _log(f"nemo_dcr: deleting old snapshots failed (kept): {type(e).__name__}: {e}")
        return True

    def wait_snapshot(self) -> bool | None:
        """This rank: wait for the snapshot upload in progress, if any; True/False: whether it
        was written, None: none was pending."""
        upload, self._snapshot_upload = self._snapshot_upload, None
        return None if upload is None else upload.result()

    @property
    def published_version(self) -> int:
        """The highest version number in use (published by this or an earlier incarnation);
        unlike :meth:`run_state`, it does not wait for the version in flight."""
        return max(self._floor, self.baseline.version)

    @property
    def in_flight(self) -> int | None:
        """The version whose decision this rank has not applied yet (None: nothing pending)."""
        flight = self._inflight
        return None if flight is None or flight.applied else flight.version

    def _join(self, flight: _InFlight) -> None:
        """This rank alone (no collective): wait for the background work of ``flight`` and
        apply its decision to the baseline, once."""
        flight.thread.join()
        if flight.applied:
            return
        flight.applied = True
        if flight.next_coding:
            self._coding = flight.next_coding
        if flight.commit:
            self.baseline.commit(flight.version)
            self.committed_digest = flight.digest
        else:
            self.baseline.discard()

    # ------------------------------------------------------------------ exit
    @staticmethod
    def _may_publish(flight: _InFlight) -> bool:
        """Rank 0, the background work, before the manifest: False once the exit settle gave
        up on ``flight`` (the process is exiting: a manifest now would have no decision)."""
        with flight.cond:
            if flight.abandoned:
                return False
            flight.publishing_at = time.monotonic()
            flight.cond.notify_all()
            return True

    @staticmethod
    def _mark_recorded(flight: _InFlight, outcome: tuple | str | None = None) -> None:
        with flight.cond:
            if not flight.recorded:
                flight.recorded, flight.outcome = True, outcome
            flight.cond.notify_all()

    def settle_on_exit(self, why: str = "interpreter exit") -> str | None:
        """This rank alone, no collective, bounded: at interpreter exit (``atexit``) or on
        SIGTERM, let the version in flight reach its decision, so that receivers are not left
        waiting on a version whose trainer is gone (a loop that never calls :meth:`finish`,
        Megatron-Bridge's ``sys.exit()`` before ``on_train_end``).  Returns a one-line
        report on rank 0 (also logged), None elsewhere or when nothing was in flight.

        The background work decides as always: rank 0 publishes the manifest once every
        rank's chunk refs are in, waits for the acks (``ack_timeout_s``) and records commit
        only if every member acknowledged these bytes -- the joint-commit invariant is the
        one of a normal settle.  What this adds is the bounded wait, and on rank 0 the
        refusal to publish late: if the manifest is not being published within
        ``EXIT_PUBLISH_GRACE_S`` (a peer rank gone, its collectives torn down), the version
        is given up before anything names it, so receivers stay on the committed version.
        Once published, rank 0 waits for the decision record up to ``ack_timeout_s +
        EXIT_DECIDE_GRACE_S`` from the publication; the other ranks wait for their
        background work at most :func:`exit_settle_bound_s`.  The decision is not applied
        to the baseline (the process is ending; a Python SIGTERM handler chained after this
        that lets training go on leaves it to the next :meth:`settle`)."""
        flight = self._inflight
        if flight is None or flight.applied or flight.thread is None or flight.thread.ident is None:
            return None
        with flight.cond:
            if flight.exit_settled:
                return None
            flight.exit_settled = True
        t0 = time.monotonic()
        v = flight.version
        if _rank() != 0:
            flight.thread.join(exit_settle_bound_s(self.cfg.ack_timeout_s))
            return None
        with flight.cond:
            while not flight.recorded and flight.thread.is_alive():
                if flight.publishing_at is None:
                    left = t0 + EXIT_PUBLISH_GRACE_S - time.monotonic()
                    if left <= 0:
                        flight.abandoned = True
                        break
                else:
                    left = flight.publishing_at + self.cfg.ack_timeout_s + EXIT_DECIDE_GRACE_S - time.monotonic()
                    if left <= 0:
                        break
                flight.cond.wait(min(left, 0.5))
            recorded, outcome, abandoned = flight.recorded, flight.outcome, flight.abandoned
        waited = time.monotonic() - t0
        if recorded:  # let the other ranks receive the decision (they are released by it)
            flight.thread.join(EXIT_DECIDE_GRACE_S)
        if isinstance(outcome, tuple):
            commit, reason = outcome[0], outcome[1]
            report = (f"version {v} committed" if commit else f"version {v} aborted: {reason}")
        elif isinstance(outcome, str):
            report = f"version {v} not decided: {outcome}"
        elif recorded or not flight.thread.is_alive():
            report = f"version {v} not decided: {flight.failure or 'the background refit ended without a decision'}"
        elif abandoned:
            report = (f"version {v} given up, never published: its manifest was not reached within "
                      f"{EXIT_PUBLISH_GRACE_S:.0f} s (a trainer rank gone?); receivers stay on version "
                      f"{self.baseline.version}")
        else:
            report = (f"version {v} published but not decided within {self.cfg.ack_timeout_s + EXIT_DECIDE_GRACE_S:.0f} s "
                      "of its publication; receivers wait for its decision until their timeout")
        report = f"at {why}, after {waited:.1f} s: {report}"
        _log(f"nemo_dcr: {report}")
        return report

    def _background(self, flight: _InFlight, pool: ThreadPoolExecutor, futures: list[Future], error: str | None,
                    before_manifest) -> None:
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
                    refs = self._finish_uploads(futures, stats)
            except Exception as e:  # noqa: BLE001 - reported to rank 0, decided for all ranks
                refs, error = [], f"rank {_rank()}: {type(e).__name__}: {e}"
            finally:
                pool.shutdown(wait=True)
            stats.publish_s = time.perf_counter() - flight.t_start
            gathered = _gather_to0((refs, stats, error), self._group)
            decision: tuple | str | None = None
            if _rank() == 0 and not self._may_publish(flight):
                decision = f"rank 0: the trainer process exited before version {flight.version} was published"
            elif _rank() == 0:
                try:
                    per_rank = [(st.raw_bytes, st.encode_cpu_s, st.upload_s, sum(r.nbytes for r in rrefs), st.puts)
                                for rrefs, st, _ in gathered]  # before _decide turns rank 0's into totals
                    decision = self._decide(flight.version, stats, gathered, before_manifest)
                    decision = (*decision, self._next_coding(stats, per_rank, errors=any(e for _, _, e in gathered),
                                                             t_start=flight.t_start))
                except BaseException as e:  # noqa: BLE001 - every rank waits for rank 0's word: send it
                    decision = f"rank 0: {type(e).__name__}: {e}"
            self._mark_recorded(flight, decision)
            decision = from_rank0(decision, self._group)
            if isinstance(decision, str):
                raise ProtocolError(decision)
            flight.commit, flight.reason, flight.stop, flight.digest, flight.next_coding = decision
            stats.refit_s = time.perf_counter() - flight.t_start
        except BaseException as e:  # noqa: BLE001 - kept for settle(), which raises it on every rank
            flight.failure = f"{type(e).__name__}: {e}"
            flight.commit, flight.stop = False, False
        self._mark_recorded(flight)
        # every rank learns every rank's outcome here, off the training loop, so that settle()
        # needs no collective: the hook never waits for a slower rank to reach it
        try:
            flight.outcomes = all_gather((flight.version, flight.commit, flight.digest, flight.failure,
                                          flight.next_coding), self._group)
        except BaseException as e:  # noqa: BLE001 - settle() raises it on this rank
            flight.failure = flight.failure or f"{type(e).__name__}: {e}"
            flight.outcomes = None

    def _next_coding(self, stats: PublishStats, per_rank: list[tuple[int, float, float, int, list]], *,
                     errors: bool, t_start: float | None = None) -> str:
        """Rank 0, ``refit.coding=auto``: fold this version's measurements (``per_rank``: each
        rank's raw bytes, encode CPU s, put s, wire bytes, (bytes, put s) per chunk; the acks
        in ``stats``) into
        the chooser and pick the next version's coding (``integrations/coding_choice.py``).
        Returns '' (unchanged) without ``auto``, and on any failure here, which is logged: the
        choice of a coding never fails a version."""
        if self.cfg.coding != AUTO:
            return ""
        current = stats.coding
        try:
            if self._chooser is None:
                local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's, for the cores per rank
                self._chooser = CodingChooser(encode_parallel=encode_parallelism(self.cfg.upload_workers, local_ranks))
            chooser = self._chooser
            if chooser.needs_probe and self._probe_sample:
                sample, self._probe_sample = self._probe_sample, None
                chooser.record_probe(probe([d for d, _ in sample], self._context_bases(sample)))
            if not errors:
                acks = [a.get("stats") or {} for a in stats.acks]
                decode = [float(a["decode_cpu_s"]) / max(1, int(a.get("fetch_threads") or 1))
                          for a in acks if a.get("decode_cpu_s")]
                download = [float(a["download_s"]) for a in acks if a.get("download_s")]
                chooser.observe(VersionObservation(
                    coding=current, raw_bytes=sum(r[0] for r in per_rank),
                    raw_bytes_max_rank=max(r[0] for r in per_rank), encode_cpu_s=sum(r[1] for r in per_rank),
                    upload_wall_s=max(r[2] for r in per_rank) / self.cfg.upload_workers,
                    wire_bytes=sum(r[3] for r in per_rank), chunks=sum(len(r[4]) for r in per_rank),
                    puts=tuple(p for r in per_rank for p in r[4]),
                    rx_decode_s=max(decode, default=None), rx_download_s=max(download, default=None),
                    wall_s=None if t_start is None else
                    time.perf_counter() - t_start - stats.diff_s - stats.project_s))
            choice, projections = chooser.choose(current)
        except Exception as e:  # noqa: BLE001 - keep the coding in use
            _log(f"nemo_dcr: coding after v{stats.version}: the choice failed, {current} kept: {type(e).__name__}: {e}")
            return ""
        stats.coding_walls = {c: p.wall_s for c, p in projections.items()}
        stats.next_coding = choice
        _log(f"nemo_dcr: coding after v{stats.version} ({current}): next {describe(choice, projections)}")
        return choice

    def _decide(self, version: int, stats: PublishStats, gathered, before_manifest) -> tuple[bool, str, bool, str]:
        """Rank 0: totals, manifest, acks, decision record.  Never raises: any failure is
        an abort with its reason (the policy decides whether training stops)."""
        errors = [e for _, _, e in gathered if e is not None]
        all_refs = tuple(r for rank_refs, _, _ in gathered for r in rank_refs)
        # totals over ranks; per-stage times are the slowest rank's (ranks run in parallel)
        for _, st, _ in gathered[1:]:
            stats.changed += st.changed
            stats.numel += st.numel
            stats.raw_bytes += st.raw_bytes
            stats.encode_cpu_s += st.encode_cpu_s
            for t in ("diff_s", "project_s", "encode_s", "upload_s", "publish_s", "pause_s"):
                setattr(stats, t, max(getattr(stats, t), getattr(st, t)))
        stats.chunks = len(all_refs)
        stats.wire_bytes = sum(r.nbytes for r in all_refs)
        stats.dense_bytes = self.dense_bytes
        reason = "; ".join(errors)
        commit = False
        digest = ""
        t0 = time.perf_counter()
        try:
            if not errors:
                manifest = Manifest(run_id=self.run_id, model_id=self.cfg.model_id, version=version,
                                    base_version=stats.base_version, base_digest=self.committed_digest,
                                    chunks=all_refs,
                                    stats={"changed": float(stats.changed)})
                if before_manifest is not None:
                    before_manifest(manifest)
                digest = self.coordinator.publish(manifest)
                t0 = time.perf_counter()
                outcome = self.coordinator.collect_acks(version, digest)
                stats.acks = outcome.acks
                stats.members = outcome.members or tuple(self.coordinator.receivers)
                stats.joined, stats.evicted = outcome.joined, outcome.evicted
                for line in outcome.ignored:
                    _log(f"nemo_dcr: version {version}: ignored ack {line}")
                commit, reason = outcome.ok, outcome.reason
        except Exception as e:  # noqa: BLE001 - e.g. the store failed: abort, never half-commit
            commit, reason = False, (reason + "; " if reason else "") + f"rank 0: {type(e).__name__}: {e}"
        stats.commit_wait_s = time.perf_counter() - t0
        decision_digest = ""
        try:
            decision_digest = self.coordinator.decide(version, stats.base_version, commit, reason, digest)
        except Exception as e:  # noqa: BLE001
            if commit:
                # the commit record may have landed (receivers would then hold v as committed)
                # or not: the trainer cannot know which, so it neither advances nor goes on
                self._failures.record(False)
                return False, (f"the commit decision on version {version} could not be recorded "
                               f"({type(e).__name__}: {e}); receivers may hold it as committed: stop, then "
                               "resume the run, which reads the decision records"), True, ""
            # an unrecorded abort is safe: receivers infer it from the chain of the next HEAD
            reason += f"; decision record not written ({type(e).__name__}: {e})"
        return commit, reason, self._failures.record(commit), decision_digest


# ---------------------------------------------------------------------- settling on exit
_exit_senders: weakref.WeakSet = weakref.WeakSet()
_exit_hooks = {"installed": False, "settling": False}


def _watch_exit(sender: RefitSender) -> None:
    """Settle ``sender``'s version in flight at interpreter exit and on SIGTERM (installed
    once per process, at the first submitted version, unless ``_SETTLE_ON_EXIT`` is off)."""
    if not _SETTLE_ON_EXIT:
        return
    _exit_senders.add(sender)
    if _exit_hooks["installed"]:
        return
    _exit_hooks["installed"] = True
    atexit.register(_settle_all, "interpreter exit")
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread: atexit still settles
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous is signal.SIG_IGN:
        # a handler installed outside Python cannot be chained; an ignored SIGTERM stays ignored
        if _rank() == 0:
            _log("nemo_dcr: SIGTERM has a handler this process cannot chain (or is ignored): the version in "
                 "flight is settled at interpreter exit only")
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(previous, signum, frame))


def _settle_all(why: str) -> None:
    if _exit_hooks["settling"]:
        return
    _exit_hooks["settling"] = True

    def one(sender: RefitSender) -> None:
        try:
            sender.settle_on_exit(why)
        except Exception as e:  # noqa: BLE001 - exiting: report, never raise
            _log(f"nemo_dcr: settling on {why} failed: {type(e).__name__}: {e}")

    try:
        senders = [s for s in list(_exit_senders) if s.in_flight is not None]
        if len(senders) == 1:  # the usual case: one refit per process, waited for on this thread
            one(senders[0])
            return
        # several (a test process): side by side, so the wait is the longest one's, not their sum
        # (at interpreter exit on Python >= 3.12 no thread can start: one after the other)
        threads = []
        for s in senders:
            t = threading.Thread(target=one, args=(s,), daemon=True)
            try:
                t.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                one(s)
                continue
            threads.append(t)
        for t in threads:
            t.join()
    finally:
        _exit_hooks["settling"] = False


def _on_sigterm(previous, signum, frame) -> None:
    """Settle (bounded; a second SIGTERM meanwhile skips straight to the next step), then
    do what SIGTERM did before: the previous Python handler, or the default (terminate
    by the signal)."""
    _settle_all("SIGTERM")
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
