"""Diff -> project -> records -> chunks on one rank, streaming into the upload workers.

Per local parameter, in model order (this thread; the workers encode and put meanwhile)::

    Baseline.diff(param)        one read of param + baseline: 2 x numel x 2 B (BF16), O(numel);
                                consecutive small parameters (MoE experts) in one pass over their
                                concatenation (``Baseline.diff_many``), not a call each
    deltas_for_param            O(changed): per main-replica view, its changed positions
                                (searchsorted), projected to canonical coordinates (unravel,
                                shard offsets, fused-layout math); a stable sort only where
                                several views of one canonical tensor interleave
    split + ChunkQueue.add      O(changed): records cut at ``chunk_bytes`` raw bytes; a full
                                chunk goes to the pool (encode + put on a worker)

Memory: the changed positions (8 B) and values of one parameter at a time, plus the records
staged but not yet encoded, capped at ``pipeline_max_staged_bytes`` (past it the diff waits for
the encoder).  Context coding also reads the committed base over each record's range
(:meth:`Chunker.context_bases`: O(range) in the worker).  Nothing is gathered across ranks:
each rank emits only the canonical elements of its main replicas (Megatron's ``replica_id``),
so every canonical element is sent exactly once.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from nemo_dcr.baseline.pinned import Baseline
from nemo_dcr.codec import chunk_digest
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.layout.mapping import CanonicalProjector, CanonicalSpec
from nemo_dcr.layout.runs import CanonicalRuns, canonical_runs
from nemo_dcr.layout.shards import ParamView
from nemo_dcr.protocol.manifest import ChunkRef, chunk_key
from nemo_dcr.sender.coding_choice import CODINGS, encode_with
from nemo_dcr.sender.collectives import rank
from nemo_dcr.sender.stats import PublishStats, Upload
from nemo_dcr.transport.store import ObjectStore

SMALL_PARAM_NUMEL = 1 << 16
"""Parameters of at most this many elements are diffed in batches (``Chunker._batches``)."""
DIFF_BATCH_NUMEL = 1 << 22
"""Elements per batched diff: bounds the two concatenated copies it makes (16 MiB in BF16)."""

Record = tuple[TensorDelta, str]
"""A canonical record and the local parameter it came from (whose baseline holds its base)."""


def split(delta: TensorDelta, chunk_bytes: int) -> Iterator[TensorDelta]:
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


def record_bytes(delta: TensorDelta) -> int:
    """Raw bytes a record hands the encoder: 8-byte positions + its values."""
    return delta.nnz * (8 + delta.values.itemsize)


class Chunker:
    """This rank's side of every version: what changed since the committed baseline, as
    coded chunks on the store.  Holds no version state between calls."""

    def __init__(self, params: dict[str, torch.Tensor], views: dict[str, list[ParamView]],
                 projector: CanonicalProjector, baseline: Baseline, store: ObjectStore):
        self.params, self.views, self.projector = params, views, projector
        self.baseline, self.store = baseline, store
        # context coding: where this rank can rebuild a record's canonical base bits (built
        # whatever refit.coding says: auto may choose context, and a test bed may switch codings)
        self._main_views = {name: [(v, v.spec.numel) for v in vs if v.spec.is_main_replica]
                            for name, vs in views.items()}
        self.runs: dict[tuple[str, str], CanonicalRuns] = {}
        for pname, vs in views.items():
            for v in vs:
                if v.spec.is_main_replica:
                    for cname, runs in canonical_runs(projector, v).items():
                        if runs.contiguous:
                            self.runs[(pname, cname)] = runs

    def deltas_for_param(self, name: str, positions: np.ndarray, xor: np.ndarray,
                         stats: PublishStats) -> list[TensorDelta]:
        """The canonical records of one local parameter's changed ``positions`` (flat, sorted)."""
        t0 = time.perf_counter()
        per_name: dict[str, tuple[CanonicalSpec, list[np.ndarray], list[np.ndarray]]] = {}
        for v, numel in self._main_views[name]:
            if v.start == 0 and numel >= int(positions[-1]) + 1:
                local, vals = positions, xor  # the view holds every changed position (one view per parameter)
            else:
                lo, hi = np.searchsorted(positions, [v.start, v.start + numel])
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

    def context_bases(self, records: list[Record]) -> dict[str, np.ndarray]:
        """Committed canonical base bits over each context-coded record's range.  The arrays
        are full-length but only ``[lo, hi)`` of each record is written or read by the
        codec (``np.empty``: untouched pages cost no memory)."""
        bases: dict[str, np.ndarray] = {}
        for d, pname in records:
            runs = self.runs.get((pname, d.name))
            if runs is None:
                continue
            arr = bases.get(d.name)
            if arr is None:
                arr = bases[d.name] = np.empty(d.numel, dtype=BITS_DTYPE[d.dtype])
            lo, hi = d.element_range
            runs.fill(arr, self.baseline.bits(pname), lo, hi)
        return bases

    def encode_upload(self, key: str, records: list[Record], meta: dict[str, str], coding: str) -> Upload:
        """An upload worker: encode one chunk under ``coding`` and put it."""
        t0, c0 = time.perf_counter(), time.thread_time()
        deltas = [d for d, _ in records]
        base = self.context_bases(records) if CODINGS[coding].uses_base else None
        blob = encode_with(coding, deltas, meta=meta, base=base)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.store.put(key, blob)
        t2 = time.perf_counter()
        ref = ChunkRef(key=key, nbytes=len(blob), digest=chunk_digest(blob), rank=rank(),
                       tensors=len(deltas), changed=sum(d.nnz for d in deltas))
        return Upload(ref=ref, encode_s=t1 - t0, put_s=t2 - t1, encode_cpu_s=c1 - c0)

    def start(self, stats: PublishStats, meta: dict[str, str], *, chunk_bytes: int, max_staged_bytes: int,
              pool: ThreadPoolExecutor, keep_sample: bool = False) -> tuple[list[Future], list[Record] | None]:
        """Diff every local parameter of version ``stats.version`` against the committed
        baseline (this thread) and submit its chunks to ``pool``, coded as ``stats.coding``.
        Returns the chunks' futures, and with ``keep_sample`` the first chunk's records (the
        ``auto`` chooser's probe sample)."""
        queue = _ChunkQueue(self, stats, meta, pool, chunk_bytes=chunk_bytes, max_staged_bytes=max_staged_bytes,
                            keep_sample=keep_sample)
        for batch in self._batches():
            t0 = time.perf_counter()
            if len(batch) == 1:
                name, p = batch[0]
                d = self.baseline.diff(name, p)
                changes = [(name, d)] if d.positions.size else []
            else:
                changes = self.baseline.diff_many(batch)
            stats.diff_s += time.perf_counter() - t0
            stats.numel += sum(p.numel() for _, p in batch)
            for name, d in changes:
                for delta in self.deltas_for_param(name, d.positions, d.xor_values, stats):
                    stats.changed += delta.nnz
                    for piece in split(delta, chunk_bytes):
                        queue.add(piece, name)
        queue.flush()
        return queue.futures, queue.sample

    def _batches(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The parameters in model order, consecutive small ones of one dtype and device
        grouped (up to ``DIFF_BATCH_NUMEL`` elements) for one ``Baseline.diff_many`` pass;
        a parameter larger than ``SMALL_PARAM_NUMEL`` is a batch of its own."""
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, p in self.params.items():
            n = p.numel()
            if n > SMALL_PARAM_NUMEL:
                if batch:
                    yield batch
                    batch, size = [], 0
                yield [(name, p)]
                continue
            if batch and (size + n > DIFF_BATCH_NUMEL or p.dtype != batch[0][1].dtype
                          or p.device != batch[0][1].device):
                yield batch
                batch, size = [], 0
            batch.append((name, p))
            size += n
        if batch:
            yield batch

    @staticmethod
    def finish_uploads(futures: list[Future], stats: PublishStats) -> list[ChunkRef]:
        """Wait for every chunk of a version on this rank; their refs, with ``stats`` filled in."""
        refs = []
        for f in futures:
            up: Upload = f.result()
            refs.append(up.ref)
            stats.encode_s += up.encode_s
            stats.upload_s += up.put_s
            stats.encode_cpu_s += up.encode_cpu_s
            stats.puts.append((up.ref.nbytes, up.put_s))
        stats.chunks = len(refs)
        stats.wire_bytes = sum(r.nbytes for r in refs)
        return refs


class _ChunkQueue:
    """Records of one version gathered into chunks of at most ``chunk_bytes`` raw bytes, each
    handed to the pool when full; staged bytes (submitted, not yet encoded) are capped at
    ``max_staged_bytes``: past it :meth:`flush` waits for the encoder."""

    def __init__(self, chunker: Chunker, stats: PublishStats, meta: dict[str, str], pool: ThreadPoolExecutor, *,
                 chunk_bytes: int, max_staged_bytes: int, keep_sample: bool):
        self.chunker, self.stats, self.meta, self.pool = chunker, stats, meta, pool
        self.chunk_bytes, self.max_staged_bytes = chunk_bytes, max_staged_bytes
        self.futures: list[Future] = []
        self.sample: list[Record] | None = None
        self._keep_sample = keep_sample
        self._staged: dict[Future, int] = {}  # raw bytes of each chunk not yet known encoded
        self._pending: list[Record] = []
        self._pending_bytes = 0

    def add(self, piece: TensorDelta, pname: str) -> None:
        size = record_bytes(piece)
        if self._pending and self._pending_bytes + size > self.chunk_bytes:
            self.flush()
        self._pending.append((piece, pname))
        self._pending_bytes += size

    def flush(self) -> None:
        if not self._pending:
            return
        if self._keep_sample and self.sample is None:
            self.sample = list(self._pending)
        staged = self._staged
        while staged and sum(staged.values()) + self._pending_bytes > self.max_staged_bytes:
            wait(list(staged), return_when=FIRST_COMPLETED)
            for f in [f for f in staged if f.done()]:
                del staged[f]
        key = chunk_key(self.stats.version, rank(), len(self.futures))
        f = self.pool.submit(self.chunker.encode_upload, key, self._pending, self.meta, self.stats.coding)
        self.futures.append(f)
        staged[f] = self._pending_bytes
        self.stats.raw_bytes += self._pending_bytes
        self._pending, self._pending_bytes = [], 0
