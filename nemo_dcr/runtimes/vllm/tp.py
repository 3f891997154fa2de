"""The weight-transfer backend across an engine's tensor-parallel workers.

At TP=N vLLM creates one backend engine per worker, each holding its shard of every weight.
One engine is one member of the joint commit, and context-mode decode needs the whole
canonical base of each tensor it decodes, which no single worker holds.  So the workers take
two roles:

* **rank 0 leads.**  It runs the protocol (the background follower, acks, the status file) over
  :class:`ShardedModel`, a ``ServedModel`` that reaches the other workers through a
  :class:`WorkerChannel`: ``canonical_bits`` (and ``canonical_bits_at_many``, the journal's
  undo values of a version in one call) is the OR of every worker's view (each reads 0
  outside the shard it holds; shards are disjoint, replicas equal), ``apply`` validates the
  batch in every worker before any worker writes, then writes in every worker (each feeds the
  full canonical tensors to its own vLLM loader, which selects its shard), as ``VLLMRuntime``
  does for ``nemo-dcr receive --runtime vllm``.
* **ranks 1..N-1 serve.**  A service thread answers rank 0's requests.  Its writes pass the
  worker's own :class:`~nemo_dcr.receiver.gated.WriteGate`, opened only while that worker is
  inside ``update_weights`` (vLLM calls every worker), so no worker writes while it could be
  running a forward pass.  Rank 0 ends each window with an ``end`` message carrying the
  update's outcome, which the other workers then return or raise.

The channel is a gloo process group of the engine's workers, created for the backend when it
is initialised (every worker is in that call), used only by these threads, never by vLLM's
own collectives.  Messages are Python objects between the engine's own processes (pickled by
``torch.distributed``'s object collectives), never anything read from the store or the network.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch.distributed as dist

from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.errors import ProtocolError
from nemo_dcr.receiver.errors import IncompleteApplyError
from nemo_dcr.receiver.gated import UpdateRefused, WriteGate
from nemo_dcr.receiver.runtime import TensorSpec
from nemo_dcr.runtimes.vllm.extension import worker_apply, worker_bits, worker_bits_at, worker_stage, worker_validate
from nemo_dcr.runtimes.vllm.runtime import _checked

IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The group's timeout: a serving worker waits for rank 0's next request for as long as the
engine is idle (gloo ends a wait at the group's timeout, then the group is unusable)."""


class WorkerChannel:
    """Rank 0's requests to the other workers of one engine, answered in order.  ``call`` is
    rank 0's (thread-safe, one request at a time); ``serve`` runs on the other ranks."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self._lock = threading.Lock()

    @classmethod
    def create(cls) -> WorkerChannel:
        """Every worker of the engine must call this, in the same order (it is a collective)."""
        group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (a collective: every rank calls it)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere)."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def call(self, op: str, arg, local=None) -> list:
        """Rank 0: send ``(op, arg)`` to every other rank; ``local()`` runs meanwhile on this
        one.  Returns the answers in rank order (``local``'s first)."""
        with self._lock:
            self.broadcast((op, arg))
            mine = local() if local is not None else None
            return self.gather(mine)


class _Phases:
    """One worker's two-phase apply: its phase one (``worker_stage``) held until the apply
    that finishes it, or its unstage."""

    def __init__(self, applier) -> None:
        self.applier = applier
        self.staged = None

    def stage(self, deltas) -> dict:
        self.staged, answer = worker_stage(self.applier, deltas)
        return answer

    def unstage(self) -> None:
        staged, self.staged = self.staged, None
        if staged is not None:
            self.applier.unstage(staged)

    def apply(self, deltas, staged: bool) -> dict:
        mine, self.staged = (self.staged if staged else None), None
        return worker_apply(self.applier, deltas, mine)


class ShardedModel:
    """Rank 0's ``ServedModel`` (``receiver/served.py``) over every worker of the engine."""

    def __init__(self, applier, channel: WorkerChannel) -> None:
        self.applier = applier
        self.channel = channel
        self._phases = _Phases(applier)

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.applier.adapter.tensor_specs()

    def canonical_bits(self, name: str) -> np.ndarray:
        parts = _checked(self.channel.call("bits", name, lambda: worker_bits(self.applier, name)))
        out = np.array(parts[0], copy=True)
        for p in parts[1:]:
            np.bitwise_or(out, p, out=out)
        return out

    def canonical_bits_at_many(self, requests) -> list[np.ndarray]:
        """``canonical_bits(name)[positions]`` of every request in ONE call to the workers
        (the journal's undo values of a version: not a call per changed tensor)."""
        requests = [(name, np.asarray(pos, dtype=np.int64)) for name, pos in requests]
        parts = _checked(self.channel.call("bits_at", requests, lambda: worker_bits_at(self.applier, requests)))
        out = [np.array(a, copy=True) for a in parts[0]]
        for worker in parts[1:]:
            for o, a in zip(out, worker):
                np.bitwise_or(o, a, out=o)
        return out

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        deltas = list(deltas)
        _checked(self.channel.call("validate", deltas, lambda: worker_validate(self.applier, deltas)))

    def stage(self, deltas: Sequence[TensorDelta]) -> bool:
        """Phase one in every worker (``DeltaApplier.stage``: unserved writes only), after
        every worker accepted the batch; a worker's refusal unstages all of them."""
        deltas = list(deltas)
        self.validate(deltas)
        try:
            _checked(self.channel.call("stage", deltas, lambda: self._phases.stage(deltas)))
        except BaseException:
            self.unstage(True)
            raise
        return True

    def unstage(self, staged: bool) -> None:
        self.channel.call("unstage", None, self._phases.unstage)

    def apply(self, deltas: Sequence[TensorDelta], staged: bool = False) -> object:
        deltas = list(deltas)
        self.validate(deltas)  # every worker accepts before any writes
        results = _checked(self.channel.call("apply", (deltas, staged), lambda: self._phases.apply(deltas, staged)))
        counts = {r["applied"] for r in results}
        if len(counts) != 1:
            raise IncompleteApplyError(f"workers applied different tensor counts: {results}")
        return results[0]

    def verify_dense(self, dense):
        raise ProtocolError("nemo_dcr backend: no dense oracle inside a serving engine (compare /weight_checker)")

    def sample(self):
        return None

    def end_window(self, seq: int, error: str | None) -> None:
        """Tell the other workers that update window ``seq`` ended (``error``: its one line)."""
        self.channel.call("end", (seq, error))

    def stop(self) -> None:
        self.channel.call("stop", None)


class Serving:
    """Ranks 1..N-1: the service thread answering rank 0, and the end of each update window."""

    def __init__(self, applier, channel: WorkerChannel, gate: WriteGate) -> None:
        self.applier = applier
        self.channel = channel
        self.gate = gate
        self._cond = threading.Condition()
        self._ended: dict[int, str | None] = {}
        self._stopped = False
        self._phases = _Phases(applier)
        self.failure = ""
        self._thread = threading.Thread(target=self._loop, name=f"dcr-serve-rank{channel.rank}", daemon=True)

    def start(self) -> Serving:
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while True:
                op, arg = self.channel.broadcast()
                if op == "bits":
                    answer = worker_bits(self.applier, arg)
                elif op == "bits_at":
                    answer = worker_bits_at(self.applier, arg)
                elif op == "validate":
                    answer = worker_validate(self.applier, arg)
                elif op == "stage":  # unserved writes only: no window needed
                    answer = self._phases.stage(arg)
                elif op == "unstage":
                    answer = self._phases.unstage()
                elif op == "apply":
                    deltas, staged = arg
                    with self.gate.write():  # only while this worker is inside update_weights
                        answer = self._phases.apply(deltas, staged)
                elif op == "end":
                    seq, error = arg
                    with self._cond:
                        self._ended[seq] = error
                        for old in sorted(self._ended)[:-16]:
                            del self._ended[old]
                        self._cond.notify_all()
                    answer = None
                elif op == "stop":
                    self.channel.gather(None)
                    return
                else:
                    answer = {"error": "placement", "message": f"unknown request {op!r}"}
                self.channel.gather(answer)
        except Exception as e:  # noqa: BLE001 - the group is gone (rank 0 died or shut down)
            with self._cond:
                self.failure = f"{type(e).__name__}: {' '.join(str(e).split())}"
                self._cond.notify_all()
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def window(self, seq: int, timeout_s: float) -> None:
        """This worker's update window ``seq``: writes rank 0 sends may run until rank 0 ends
        it; raises its one-line error if the update failed."""
        with self.gate.window():
            with self._cond:
                ok = self._cond.wait_for(lambda: seq in self._ended or self._stopped, timeout_s)
                if not ok or seq not in self._ended:
                    why = self.failure or f"no word from rank 0 within {timeout_s:g}s"
                    raise UpdateRefused(f"nemo_dcr: update window {seq} did not end ({why})")
                error = self._ended.pop(seq)
        if error:
            raise UpdateRefused(error)

    def join(self, timeout_s: float) -> None:
        self.gate.close()
        self._thread.join(timeout_s)
