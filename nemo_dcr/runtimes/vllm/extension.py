"""The worker side of a vLLM receiver: the steps every worker runs on its ``DeltaApplier``.

The weight-transfer backend (``backend.py``, ``tp.py``) runs them for the run it follows;
``VLLMRuntime`` (``runtime.py``, ``nemo-dcr receive --runtime vllm``) runs them through
``collective_rpc`` with the ``rpc_*`` functions, on the applier of the same backend engine
(``weight_transfer_config={"backend": "nemo_dcr"}``, ``local_setup``).  Errors the receiver
must tell apart (a refused batch, a placement problem) are returned as ``{"error": kind,
"message": ...}`` rather than raised, because the multiprocess executor flattens a worker's
exception into a generic one.
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


def worker_bits_at(applier: DeltaApplier, requests: Sequence[tuple[str, np.ndarray]]) -> list[np.ndarray] | dict:
    """One worker's view of each ``(name, positions)`` (0 outside its shard), or its refusal."""
    try:
        return [np.asarray(applier.canonical_bits_at(name, pos)) for name, pos in requests]
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


def _local(worker) -> DeltaApplier:
    """The worker's backend engine's own applier (``DCRWeightTransferEngine.local_setup``)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    applier = getattr(engine, "local_applier", None)
    if applier is None:
        raise LoaderError("nemo_dcr: this engine was not built with weight_transfer_config "
                          "{'backend': 'nemo_dcr'} and set up by rpc_setup")
    return applier


# --- what ``VLLMRuntime`` runs in every worker (``collective_rpc`` with these functions) ---
def rpc_setup(worker, checkpoint_dir: str) -> dict:
    """Install the backend engine's placement plan for a receiver that runs the protocol in
    the calling process (``nemo-dcr receive``): the engine follows no run itself."""
    try:
        applier = worker.weight_transfer_engine.local_setup(checkpoint_dir)
    except LoaderError as e:
        return _refusal(e)
    adapter = applier.adapter
    return {"rank": worker.rank, "staged_layers": len(adapter.staged_layers()), "staging_bytes": adapter.staging_bytes()}


def rpc_prewarm(worker) -> dict:
    """Per worker: placement kinds (counts), canonical mirror bytes, staging bytes, and the
    weight-transfer engine class applying them."""
    applier = _local(worker)
    kinds: dict[str, int] = {}
    for p in applier.placements.values():
        kinds[p.kind.value] = kinds.get(p.kind.value, 0) + 1
    mirror = sum(p.spec.numel * p.spec.torch_dtype.itemsize for p in applier.placements.values()
                 if p.kind is PlacementKind.TRANSFORM)
    return {"rank": worker.rank, "kinds": kinds, "mirror_bytes": mirror,
            "staging_bytes": applier.adapter.staging_bytes(),
            "engine": type(worker.weight_transfer_engine).__name__}


def rpc_validate(worker, deltas: Sequence[TensorDelta]) -> dict:
    return worker_validate(_local(worker), deltas) or {"rank": worker.rank}


def rpc_apply(worker, deltas: Sequence[TensorDelta]) -> dict:
    result = worker_apply(_local(worker), deltas)
    return result if "error" in result else {"rank": worker.rank, **result}


def rpc_canonical_bits(worker, name: str) -> np.ndarray | dict:
    return worker_bits(_local(worker), name)


def rpc_canonical_bits_at(worker, requests: Sequence[tuple[str, np.ndarray]]) -> list[np.ndarray] | dict:
    return worker_bits_at(_local(worker), requests)


def rpc_state(worker) -> dict[str, torch.Tensor]:
    """Every non-empty parameter and buffer of this worker's model (copies)."""
    model = worker.model_runner.get_model()
    return {n: t.detach().clone() for n, t in module_state(model).items() if t.numel()}


def rpc_digest(worker) -> dict[str, str]:
    model = worker.model_runner.get_model()
    return {n: tensor_digest(t) for n, t in sorted(module_state(model).items()) if t.numel()}


def rpc_dense_reload(worker, checkpoint_dir: str) -> dict:
    """Time a dense refit of this worker from ``checkpoint_dir`` through the same path
    ``apply`` uses (every tensor through ``load_weights``, every layer rebuilt)."""
    from pathlib import Path

    from safetensors.torch import load_file

    adapter = _local(worker).adapter
    t0 = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    t1 = time.perf_counter()
    with torch.no_grad():
        adapter.load_weights(state.items())
    adapter.post_load(frozenset(state))
    t2 = time.perf_counter()
    return {"rank": worker.rank, "read_s": t1 - t0, "load_s": t2 - t1}
