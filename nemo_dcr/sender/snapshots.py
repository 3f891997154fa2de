"""Committed-version snapshots (``refit.snapshot_every``): the dense canonical state of a
committed version on the store, so that a receiver joining later loads it instead of version
0 and every version since (``protocol/snapshot.py`` owns the records and their layout).

A snapshot only speeds up joins: nothing here ever fails a version or stops training.  The
gather is collective (right after every rank applied the commit); serializing and uploading
run on rank 0's one snapshot worker, in the background.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from nemo_dcr.baseline.pinned import Baseline
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.protocol.snapshot import prune_snapshots, write_snapshot
from nemo_dcr.sender.collectives import from_rank0, log, rank
from nemo_dcr.transport.store import ObjectStore


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


class Snapshots:
    """Every ``interval`` committed versions, the committed state on the store."""

    def __init__(self, store: ObjectStore, sealer: Sealer, interval: int,
                 state: Callable[[], Mapping[str, torch.Tensor] | None] | None):
        """``state``: collective, the canonical dense state of the committed baseline on rank
        0, None on the other ranks.  None, or ``interval`` 0: no snapshots."""
        self.store, self.sealer, self.interval, self.state = store, sealer, interval, state
        self._pool: ThreadPoolExecutor | None = None  # rank 0: serialize + upload
        self._upload: Future | None = None

    def after_commit(self, run_id: str, version: int, decision_digest: str) -> float:
        """Collective, right after every rank applied the commit of ``version``: if it is a
        multiple of the interval, gather the committed state and hand its serialization and
        upload to rank 0's worker.  Skipped (logged) while the previous upload still runs; a
        failure is logged, never raised.  Returns the gather's seconds (0: none taken)."""
        if not self.interval or version % self.interval or self.state is None:
            return 0.0
        if from_rank0(self._upload is not None and not self._upload.done()):
            if rank() == 0:
                log(f"nemo_dcr: snapshot of v{version} skipped: the previous one is still uploading")
            return 0.0
        t0 = time.perf_counter()
        try:
            state = self.state()
        except Exception as e:  # noqa: BLE001 - a snapshot never stops training
            log(f"nemo_dcr: snapshot of v{version} not taken on rank {rank()}: {type(e).__name__}: {e}")
            return 0.0
        gathered_s = time.perf_counter() - t0
        if rank() != 0 or state is None:
            return gathered_s
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcr-snapshot")
        self._upload = self._pool.submit(self._write, run_id, version, decision_digest, state)
        return gathered_s

    def _write(self, run_id: str, version: int, decision_digest: str, state: Mapping[str, torch.Tensor]) -> bool:
        """Rank 0, the snapshot worker: serialize, upload (record last), prune the old ones."""
        from safetensors.torch import save as save_safetensors

        t0 = time.perf_counter()
        try:
            blob = save_safetensors({k: v.contiguous() for k, v in sorted(state.items())})
            del state
            write_snapshot(self.store, self.sealer, run_id, version, decision_digest, {"model.safetensors": blob})
        except Exception as e:  # noqa: BLE001 - logged, training goes on; no record was written
            log(f"nemo_dcr: snapshot of v{version} failed, skipped: {type(e).__name__}: {e}")
            return False
        log(f"nemo_dcr: snapshot of v{version} written ({len(blob)} bytes, {time.perf_counter() - t0:.1f} s)")
        try:
            prune_snapshots(self.store, self.sealer, run_id)
        except Exception as e:  # noqa: BLE001 - best effort
            log(f"nemo_dcr: deleting old snapshots failed (kept): {type(e).__name__}: {e}")
        return True

    def wait(self) -> bool | None:
        """This rank: wait for the upload in progress, if any; True/False: whether it was
        written, None: none was pending."""
        upload, self._upload = self._upload, None
        return None if upload is None else upload.result()
