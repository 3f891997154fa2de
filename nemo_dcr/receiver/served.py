"""What the receiver loop needs from the model it keeps current: the seam between
``receiver/engine.py`` (manifests, chunks, acks) and a serving runtime.

``ServedModel`` is deliberately small.  ``InProcessModel`` implements it for a runtime
whose module lives in the receiver process (transformers: a ``DeltaApplier`` over a
``RuntimeAdapter``); a runtime whose weights live in other processes (vLLM's TP workers)
implements it at its edge (``runtimes/vllm``), applying the same ``DeltaApplier`` inside
each worker.

``validate_version`` is the one check of a version's records against a runtime's tensor
specs: ``DeltaApplier.validate`` and ``apply`` run it (in every worker), and catch-up runs
it on each version it composes.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from nemo_dcr.codec.types import TensorDelta, check_records
from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.errors import DeltaValidationError
from nemo_dcr.receiver.runtime import RuntimeAdapter, TensorSpec


def validate_version(specs: Mapping[str, TensorSpec], deltas: Sequence[TensorDelta]) -> dict[str, list[TensorDelta]]:
    """The one check of a version's records against a runtime's canonical tensors, before
    anything is written: every record names a spec, with its dtype and shape, and no element
    is named by two records.

    A record's own invariants (1-D int64 positions, strictly increasing, inside
    ``element_range`` inside the tensor; values of the dtype's bit width) are
    ``TensorDelta.__post_init__``'s.  They are checked again for the whole batch by
    ``codec.types.check_records``: a record can arrive without its constructor having run
    (unpickled from another process, or altered with ``object.__setattr__``).
    Returns the records grouped by name, in batch order; raises ``DeltaValidationError``."""
    grouped: dict[str, list[TensorDelta]] = defaultdict(list)
    for d in deltas:
        if not isinstance(d, TensorDelta):
            raise DeltaValidationError(f"expected TensorDelta, got {type(d).__name__}")
        spec = specs.get(d.name)
        if spec is None:
            raise DeltaValidationError(f"{d.name}: not a canonical tensor of this runtime")
        if d.dtype != spec.dtype or tuple(d.shape) != spec.shape:
            raise DeltaValidationError(f"{d.name}: delta is {d.dtype}{d.shape}, runtime has {spec.dtype}{spec.shape}")
        grouped[d.name].append(d)
    try:
        check_records(deltas)  # the records' own checks, whether or not their constructors ran
    except ValidationError as e:
        raise DeltaValidationError(str(e)) from None
    for name, records in grouped.items():
        # Records of one tensor may interleave (row-parallel shards split columns, so each
        # rank's range spans nearly the whole tensor), but no element may be named twice:
        # two XORs would cancel.  Disjoint ranges prove it without a sort.
        spans = sorted(r.element_range for r in records if r.nnz)
        if all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:])):
            continue
        merged = np.sort(np.concatenate([r.positions for r in records]))
        repeated = merged[1:][merged[1:] == merged[:-1]]
        if repeated.size:
            raise DeltaValidationError(f"{name}: position {int(repeated[0])} is in more than one record")
    return dict(grouped)


@runtime_checkable
class ServedModel(Protocol):
    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        """The canonical tensors a delta may name."""
        ...

    def canonical_bits(self, name: str) -> np.ndarray:
        """The canonical bits held now (the context-mode decode base)."""
        ...

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        """Every check ``apply`` runs before its first write, without writing
        (``validate_version`` against ``tensor_specs()``, plus the runtime's own checks)."""
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

    def canonical_bits_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        return self.applier.canonical_bits_at(name, positions)

    def canonical_bits_at_many(self, requests) -> list[np.ndarray]:
        return [self.applier.canonical_bits_at(name, pos) for name, pos in requests]

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        self.applier.validate(deltas)

    def apply(self, deltas: Sequence[TensorDelta], staged=None) -> object:
        return self.applier.apply(deltas, staged)

    def stage(self, deltas: Sequence[TensorDelta]) -> object:
        """Phase one of a two-phase apply (``DeltaApplier.stage``): nothing served changes."""
        return self.applier.stage(deltas)

    def unstage(self, staged) -> None:
        self.applier.unstage(staged)

    def verify_dense(self, dense: Mapping[str, torch.Tensor]) -> dict:
        from nemo_dcr.receiver.verify import compare_with_dense

        if self.reference is None:
            raise ValidationError("verify_dense needs a reference runtime")
        report = compare_with_dense(self.applier.adapter.module, self.reference, dense)
        return {"bit_exact": report.equal, "mismatches": list(report.mismatched_names)[:10]}

    def sample(self) -> dict | None:
        return None
