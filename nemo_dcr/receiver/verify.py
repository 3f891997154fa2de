"""Bit-exact comparison of runtime state: integer views, never tolerances.

``compare_modules`` checks every parameter AND buffer (persistent or not) of two modules;
``compare_with_dense`` loads a dense canonical state dict through a second runtime's own
loader and compares against that, which is the invariant the receiver promises ("what a
dense refit through the same native loader gives").  ``state_digest`` lets two processes
compare without shipping tensors.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_dcr.dtypes import int_view
from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.runtime import RuntimeAdapter


@dataclass(frozen=True)
class TensorDifference:
    name: str
    kind: str
    """``"bits"``, ``"dtype"`` or ``"shape"``."""
    count: int
    """Differing elements (``kind == "bits"``), else 0."""
    first_index: tuple[int, ...] | None
    left_bits: int | None
    right_bits: int | None


@dataclass(frozen=True)
class StateComparison:
    compared: int
    only_left: tuple[str, ...]
    only_right: tuple[str, ...]
    differences: tuple[TensorDifference, ...]

    @property
    def equal(self) -> bool:
        return not (self.only_left or self.only_right or self.differences)

    @property
    def mismatched_names(self) -> frozenset[str]:
        return frozenset(d.name for d in self.differences) | frozenset(self.only_left) | frozenset(self.only_right)

    def summary(self, limit: int = 5) -> str:
        if self.equal:
            return f"{self.compared} tensors bit-identical"
        parts = []
        if self.only_left:
            parts.append(f"only left: {list(self.only_left[:limit])}")
        if self.only_right:
            parts.append(f"only right: {list(self.only_right[:limit])}")
        for d in self.differences[:limit]:
            if d.kind == "bits":
                parts.append(
                    f"{d.name}: {d.count} elements differ, first at {d.first_index} "
                    f"(0x{d.left_bits:x} vs 0x{d.right_bits:x})"
                )
            else:
                parts.append(f"{d.name}: {d.kind} differs")
        more = len(self.differences) - limit
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")

    def raise_if_different(self) -> None:
        if not self.equal:
            raise AssertionError(self.summary())


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it is reachable by (tied aliases too)."""
    out = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({n: b.detach() for n, b in module.named_buffers(remove_duplicate=False) if b is not None})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    return int_view(t if t.dim() else t.reshape(1))


def compare_tensors(left: Mapping[str, torch.Tensor], right: Mapping[str, torch.Tensor]) -> StateComparison:
    diffs = []
    common = sorted(set(left) & set(right))
    for name in common:
        a, b = left[name], right[name]
        if a.dtype != b.dtype:
            diffs.append(TensorDifference(name, "dtype", 0, None, None, None))
            continue
        if a.shape != b.shape:
            diffs.append(TensorDifference(name, "shape", 0, None, None, None))
            continue
        ia, ib = _bits(a), _bits(b)
        if torch.equal(ia, ib):  # integer equality: bit equality, NaN payloads included
            continue
        ne = ia != ib
        if bool(ne.any()):
            flat = int(torch.nonzero(ne.reshape(-1))[0])
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
            mask = (1 << (8 * a.element_size())) - 1
            diffs.append(
                TensorDifference(
                    name,
                    "bits",
                    int(ne.sum()),
                    idx,
                    int(ia.reshape(-1)[flat]) & mask,
                    int(ib.reshape(-1)[flat]) & mask,
                )
            )
    return StateComparison(
        compared=len(common),
        only_left=tuple(sorted(set(left) - set(right))),
        only_right=tuple(sorted(set(right) - set(left))),
        differences=tuple(diffs),
    )


def compare_modules(left: torch.nn.Module, right: torch.nn.Module) -> StateComparison:
    return compare_tensors(module_state(left), module_state(right))


def load_dense(adapter: RuntimeAdapter, state: Mapping[str, torch.Tensor]) -> None:
    """A dense refit: every canonical tensor through the runtime's own loader."""
    specs = adapter.tensor_specs()
    missing, extra = sorted(set(specs) - set(state)), sorted(set(state) - set(specs))
    if missing or extra:
        raise ValidationError(f"dense state does not match the runtime's specs: missing {missing[:3]}, extra {extra[:3]}")
    with torch.no_grad():
        adapter.load_weights(state.items())
    adapter.post_load(frozenset(state))


def compare_with_dense(
    module: torch.nn.Module, reference: RuntimeAdapter, state: Mapping[str, torch.Tensor]
) -> StateComparison:
    """Load ``state`` densely into ``reference`` (a second runtime built like ``module``'s)
    and compare ``module`` against it."""
    load_dense(reference, state)
    return compare_modules(module, reference.module)


def tensor_digest(t: torch.Tensor) -> str:
    """``sha256:`` over ``dtype``, ``shape`` and the raw row-major bytes."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def state_digest(module: torch.nn.Module) -> dict[str, str]:
    """Name -> ``tensor_digest`` of every parameter and buffer of ``module``."""
    return {name: tensor_digest(t) for name, t in sorted(module_state(module).items())}
