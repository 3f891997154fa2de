"""What the receiver loop needs from the model it keeps current: the seam between
``receiver/worker.py`` (manifests, chunks, acks) and a serving runtime.

``ServedModel`` is deliberately small.  ``InProcessModel`` implements it for a runtime
whose module lives in the receiver process (transformers: a ``DeltaApplier`` over a
``RuntimeAdapter``); a runtime whose weights live in other processes (vLLM's TP workers)
implements it at its edge (``runtimes/vllm``), applying the same ``DeltaApplier`` inside
each worker.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.runtimes.base import RuntimeAdapter, TensorSpec


@runtime_checkable
class ServedModel(Protocol):
    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        """The canonical tensors a delta may name."""
        ...

    def canonical_bits(self, name: str) -> np.ndarray:
        """The canonical bits held now (the context-mode decode base)."""
        ...

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        """Every check ``apply`` runs before its first write, without writing."""
        ...

    def apply(self, deltas: Sequence[TensorDelta]) -> object:
        """Apply one version's records in place.  Everything is validated before the
        first write; a refusal raises ``ValueError`` (or a subclass) and writes nothing."""
        ...

    def verify_dense(self, dense: Mapping[str, torch.Tensor]) -> dict:
        """Compare with a dense refit of the same version through the same loader;
        returns at least ``{"bit_exact": bool, "mismatches": [names]}``."""
        ...

    def sample(self) -> dict | None:
        """A short greedy completion for the logs (``None`` where the runtime has none)."""
        ...


class InProcessModel:
    """A ``DeltaApplier`` over an in-process runtime, plus an optional second runtime of
    the same kind for ``verify_dense`` (a dense load through the same loader)."""

    def __init__(self, applier, reference: RuntimeAdapter | None = None):
        self.applier = applier
        self.reference = reference

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.applier.adapter.tensor_specs()

    def canonical_bits(self, name: str) -> np.ndarray:
        return self.applier.canonical_bits(name)

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        self.applier.validate(deltas)

    def apply(self, deltas: Sequence[TensorDelta]) -> object:
        return self.applier.apply(deltas)

    def verify_dense(self, dense: Mapping[str, torch.Tensor]) -> dict:
        from nemo_dcr.receiver.verify import compare_with_dense

        if self.reference is None:
            raise ValueError("verify_dense needs a reference runtime")
        report = compare_with_dense(self.applier.adapter.module, self.reference, dense)
        return {"bit_exact": report.equal, "mismatches": list(report.mismatched_names)[:10]}

    def sample(self) -> dict | None:
        return None
