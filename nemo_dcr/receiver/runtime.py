"""The one seam between the receiver and a serving runtime.

The receiver never knows how a runtime lays out its parameters.  An adapter gives it four
things and nothing more:

* ``module``: the live ``torch.nn.Module`` whose parameters and buffers are the weights
  being served (their storages are what the apply engine may write into);
* ``tensor_specs()``: the canonical tensors the runtime's checkpoint format holds
  (Hugging Face names, element dtype, shape) -- the only names a delta may target;
* ``load_weights(weights)``: the runtime's own loader for in-memory canonical tensors,
  taking ``Iterable[tuple[str, torch.Tensor]]``; the apply engine observes the copies it
  makes (``nemo_dcr.receiver.capture``) instead of re-implementing its placement;
* ``post_load(names)``: what the runtime must run after weights changed (e.g. vLLM's
  ``process_weights_after_loading``); a no-op where nothing is cached.

plus ``initial_tensor(name)``: the canonical tensor the runtime's current weights were
loaded from, when the adapter can read it without trusting foreign bytes (safetensors).
The apply engine needs it only for tensors whose loader transforms values (a cast or a
scale cannot be inverted from the parameter), to seed its canonical mirror of them.

Optional: ``load_groups() -> Iterable[Iterable[str]]``, names the loader must be given
together (a converter that builds one fused parameter from several checkpoint tensors, e.g.
the experts of a MoE layer).  The apply engine then probes and feeds those groups whole.
It is not part of the ``Protocol`` so adapters without it still satisfy ``isinstance``.

Runtimes (``nemo_dcr.runtimes.*``) implement this protocol and import it from here; the
receiver never imports a runtime.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from nemo_dcr import dtypes
from nemo_dcr.codec.types import shape_numel
from nemo_dcr.errors import ValidationError


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return dtypes.get(name).torch


def dtype_name(dtype: torch.dtype) -> str:
    """The wire dtype name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return dtypes.from_torch(dtype).name


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor as the runtime's checkpoint format defines it."""

    name: str
    dtype: str
    """Wire dtype name (a key of ``nemo_dcr.dtypes.DTYPES``)."""
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValidationError("TensorSpec needs a name")
        if self.dtype not in dtypes.DTYPES:
            raise ValidationError(f"{self.name}: dtype {self.dtype!r} is not one the wire format carries")
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise ValidationError(f"{self.name}: negative dimension in {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        return shape_numel(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


@runtime_checkable
class RuntimeAdapter(Protocol):
    """How the receiver reaches one serving runtime (see the module docstring)."""

    @property
    def module(self) -> torch.nn.Module:
        """The live module; every parameter and buffer storage of it is runtime state."""
        ...

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        """Canonical name -> spec for every tensor of the runtime's checkpoint format."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Run the runtime's native loader on in-memory canonical tensors.

        Contract the apply engine relies on: the loader writes into the *existing*
        parameter/buffer storages (``copy_`` or other in-place ops) rather than rebinding
        parameters, runs on the calling thread, and does not read back what it wrote.  The
        engine checks the first two at prewarm and refuses a loader that breaks them.
        Called under ``torch.no_grad()``.
        """
        ...

    def post_load(self, names: frozenset[str]) -> None:
        """Hook run once after a batch of canonical tensors ``names`` was written."""
        ...

    def initial_tensor(self, name: str) -> torch.Tensor | None:
        """The canonical tensor the current weights were loaded from, or ``None``."""
        ...
