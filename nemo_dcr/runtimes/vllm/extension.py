"""Worker extension: one ``DeltaApplier`` per vLLM worker, reached by ``collective_rpc``.

vLLM mixes this class into every worker (``LLM(..., worker_extension_cls=...)``); the
facade (``nemo_dcr.runtimes.vllm.runtime``) calls its methods by name on all workers.
Errors the receiver must tell apart (a refused batch, a placement problem) are returned
as ``{"error": kind, "message": ...}`` rather than raised, because the multiprocess
executor flattens a worker's exception into a generic one.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.receiver.apply import DeltaApplier, PlacementKind, Staging
from nemo_dcr.receiver.errors import DeltaValidationError, IncompleteApplyError, LoaderError
from nemo_dcr.receiver.verify import module_state, tensor_digest

_ERRORS = {
    "validation": DeltaValidationError,
    "incomplete": IncompleteApplyError,
    "placement": LoaderError,
}


def _refusal(e: Exception) -> dict:
    for kind, cls in _ERRORS.items():
        if isinstance(e, cls):
            return {"error": kind, "message": str(e)}
    raise e


def worker_bits(applier: DeltaApplier, name: str) -> np.ndarray | dict:
    """One worker's view of ``name`` (a copy; 0 outside its shard), or its refusal."""
    try:
        return np.array(applier.canonical_bits(name), copy=True)
    except (DeltaValidationError, LoaderError) as e:
        return _refusal(e)


def worker_validate(applier: DeltaApplier, deltas: Sequence[TensorDelta]) -> dict | None:
    """None when this worker accepts ``deltas``, else its refusal."""
    try:
        applier.validate(deltas)
    except (DeltaValidationError, LoaderError) as e:
        return _refusal(e)
    return None


def worker_stage(applier: DeltaApplier, deltas: Sequence[TensorDelta]) -> tuple[Staging | None, dict]:
    """Phase one in this worker (``DeltaApplier.stage``): what it staged, or its refusal."""
    t0 = time.perf_counter()
    stage = getattr(applier, "stage", None)
    if stage is None:  # an applier of one phase: everything waits for the window
        return None, {"staged": 0, "stage_s": 0.0}
    try:
        staged = stage(deltas)
    except (DeltaValidationError, LoaderError) as e:
        return None, _refusal(e)
    return staged, {"staged": len(staged.names), "stage_s": time.perf_counter() - t0}


def worker_apply(applier: DeltaApplier, deltas: Sequence[TensorDelta], staged: Staging | None = None) -> dict:
    """Apply ``deltas`` in this worker (the rest of them after ``worker_stage``): what it
    wrote, or its refusal."""
    t0 = time.perf_counter()
    try:
        result = applier.apply(deltas) if staged is None else applier.apply(deltas, staged)
    except (DeltaValidationError, LoaderError) as e:
        return _refusal(e)
    return {
        "applied": len(result.applied),
        "xor_elements": result.xor_elements,
        "overwrite_elements": result.overwrite_elements,
        "through_loader": len(result.through_loader),
        "apply_s": time.perf_counter() - t0,
    }


class DCRWorkerExtension:
    """Methods vLLM adds to each worker (names prefixed ``dcr_``)."""

    def dcr_setup(self, checkpoint_dir: str) -> dict:
        from nemo_dcr.runtimes.vllm.adapter import VLLMWorkerAdapter

        adapter = VLLMWorkerAdapter(self.model_runner.get_model(), checkpoint_dir)
        self._dcr_adapter = adapter
        self._dcr_applier = DeltaApplier(adapter)
        return {"rank": self.rank, "staged_layers": len(adapter.staged_layers()), "staging_bytes": adapter.staging_bytes()}

    def dcr_prewarm(self) -> dict:
        t0 = time.perf_counter()
        try:
            placements = self._dcr_applier.prewarm()
        except LoaderError as e:
            return _refusal(e)
        kinds: dict[str, int] = {}
        for p in placements.values():
            kinds[p.kind.value] = kinds.get(p.kind.value, 0) + 1
        mirror = sum(
            p.spec.numel * p.spec.torch_dtype.itemsize
            for p in placements.values()
            if p.kind is PlacementKind.TRANSFORM
        )
        return {
            "rank": self.rank,
            "kinds": kinds,
            "mirror_bytes": mirror,
            "staging_bytes": self._dcr_adapter.staging_bytes(),
            "prewarm_s": time.perf_counter() - t0,
        }

    def dcr_validate(self, deltas: Sequence[TensorDelta]) -> dict:
        return worker_validate(self._dcr_applier, deltas) or {"rank": self.rank}

    def dcr_apply(self, deltas: Sequence[TensorDelta]) -> dict:
        result = worker_apply(self._dcr_applier, deltas)
        return result if "error" in result else {"rank": self.rank, **result}

    def dcr_canonical_bits(self, name: str) -> np.ndarray | dict:
        return worker_bits(self._dcr_applier, name)

    def dcr_state(self) -> dict[str, torch.Tensor]:
        """Every non-empty parameter and buffer of this worker's model (copies)."""
        model = self.model_runner.get_model()
        return {n: t.detach().clone() for n, t in module_state(model).items() if t.numel()}

    def dcr_digest(self) -> dict[str, str]:
        model = self.model_runner.get_model()
        return {n: tensor_digest(t) for n, t in sorted(module_state(model).items()) if t.numel()}

    def dcr_dense_reload(self, checkpoint_dir: str) -> dict:
        """Time a dense refit of this worker from ``checkpoint_dir`` through the same
        path ``apply`` uses (every tensor through ``load_weights``, every layer rebuilt)."""
        adapter = self._dcr_adapter
        t0 = time.perf_counter()
        from safetensors.torch import load_file
        from pathlib import Path

        state: dict[str, torch.Tensor] = {}
        for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
            state.update(load_file(str(path)))
        t1 = time.perf_counter()
        with torch.no_grad():
            adapter.load_weights(state.items())
        adapter.post_load(frozenset(state))
        t2 = time.perf_counter()
        return {"rank": self.rank, "read_s": t1 - t0, "load_s": t2 - t1}
