"""Follow fed bits through a loader's data movement, so a conversion is observed, not re-coded.

Some loaders do not copy views of the tensors they are fed: transformers v5 stacks the
per-expert checkpoint tensors of a MoE layer (``torch.stack``) and concatenates gate and up
(``torch.cat``) before one ``copy_`` into the fused parameter.  ``WriteCapture`` sees that
``copy_`` as coming from a computed tensor.  ``TracingCapture`` adds provenance: each fed
tensor gets a *shadow* (an int64 tensor of origin ids, one per element, made lazily the first
time the tensor enters a traced op) and, when a whitelisted pure data-movement op runs on
tensors that all have shadows, the SAME op runs on the shadows, giving the output's shadow.
Views need nothing: shadows are kept per storage, so any view of a shadowed storage reads
its shadow through its own geometry.  A ``copy_`` into module storage whose source has a
complete shadow (no element of unknown origin) gets ``CapturedWrite.origins``: which fed
element each destination element receives.  Because the shadow ran through the runtime's
own op sequence, the map is whatever the runtime does; nothing about expert layouts is
written here.

Whitelist (``_MOVES``): ops whose output elements are input elements, unchanged: ``cat``,
``stack``, ``clone``, ``_to_copy`` without a dtype or device change, ``index_select``,
``_unsafe_view``.  Anything else (a cast, arithmetic, a gather we did not list) produces no
shadow, so a later ``copy_`` of its result has no origins and is classified as a transform:
correct, only slower.  Adding an op is safe only if it moves elements without changing bits.

Origin ids: fed tensor ``i`` (in the order given) owns ids ``[base_i, base_i + numel_i)``,
with a gap of one id between tensors so that affine runs never cross two tensors
(``OriginTable.split`` turns ids back into (name, canonical flat index)).

Lifetime: the mode keeps every shadowed intermediate alive until it is dropped (a freed
storage's address could otherwise be reused by an unrelated tensor and inherit its shadow).
Memory at prewarm: 8 bytes per fed element that enters a traced op, plus the loader's own
intermediates; a plain ``load_state_dict`` creates no shadows at all.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.capture import StorageOwner, WriteCapture

_aten = torch.ops.aten
#: op -> positions of the arguments whose elements the output is made of
_MOVES = {
    _aten.cat.default: (0,),
    _aten.stack.default: (0,),
    _aten.clone.default: (0,),
    _aten._to_copy.default: (0,),
    _aten.index_select.default: (0,),
    _aten._unsafe_view.default: (0,),
}


@dataclass(frozen=True)
class OriginTable:
    """Origin id ranges of the tensors fed in one loader call."""

    names: tuple[str, ...]
    bases: np.ndarray
    """int64, ascending: first id of each name."""
    numels: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.names) == self.bases.size == self.numels.size):
            raise ValidationError("OriginTable: names, bases and numels differ in length")
        if self.bases.size > 1 and not bool(np.all(self.bases[1:] > self.bases[:-1] + self.numels[:-1])):
            raise ValidationError("OriginTable: id ranges must ascend with a gap")

    @classmethod
    def of(cls, fed: Mapping[str, torch.Tensor]) -> OriginTable:
        names = tuple(fed)
        numels = np.array([fed[n].numel() for n in names], dtype=np.int64)
        bases = np.concatenate([[0], np.cumsum(numels + 1)[:-1]]).astype(np.int64)
        return cls(names, bases, numels)

    def base(self, name: str) -> int:
        return int(self.bases[self._index[name]])

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def split(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Origin ids -> {name: positions in ``ids`` of that name's elements, ascending}.

        One stable sort of the ids' table rows, O(len(ids) log len(ids)) whatever the number
        of names: a probe of a 256-expert layer feeds hundreds of tensors at once."""
        which = np.searchsorted(self.bases, ids, side="right") - 1
        if which.size and (int(which.min()) < 0 or bool(np.any(ids >= self.bases[which] + self.numels[which]))):
            raise ValidationError("OriginTable: origin id in a gap or below the first tensor")
        order = np.argsort(which, kind="stable")
        rows, starts = np.unique(which[order], return_index=True)
        pieces = np.split(order, starts[1:])
        return {self.names[int(r)]: piece for r, piece in zip(rows, pieces)}


@dataclass(frozen=True)
class _Shadow:
    store: torch.Tensor  # int64, one id per element of the shadowed storage; -1: unknown
    element_size: int


class TracingCapture(WriteCapture):
    """``WriteCapture`` that also records origins of copies made through data movement."""

    def __init__(self, storages: Mapping[int, StorageOwner], fed: Mapping[str, torch.Tensor], *, execute: bool):
        super().__init__(storages, fed, execute=execute)
        self.table = OriginTable.of(fed)
        self._shadows: dict[int, _Shadow] = {}
        self._alive: list[torch.Tensor] = []

    @property
    def fed(self) -> Mapping[str, torch.Tensor]:
        """The tensors fed to the loader, by canonical name."""
        return self._fed

    def _shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        if t.device.type != "cpu" or not t.numel():
            return None
        ptr = t.untyped_storage().data_ptr()
        entry = self._shadows.get(ptr)
        if entry is None:
            name = self._fed_by_ptr.get(ptr)
            if name is None:
                return None
            f = self._fed[name]
            ids = torch.arange(f.numel(), dtype=torch.int64).add_(self.table.base(name)).view(f.shape)
            entry = self._register(f, ids)
        if entry.element_size != t.element_size():
            return None  # a reinterpreting view: its elements are not the fed elements
        return torch.as_strided(entry.store, t.shape, t.stride(), t.storage_offset())

    def _register(self, t: torch.Tensor, ids: torch.Tensor) -> _Shadow:
        n = t.untyped_storage().nbytes() // t.element_size()
        store = torch.full((n,), -1, dtype=torch.int64)
        torch.as_strided(store, t.shape, t.stride(), t.storage_offset()).copy_(ids)
        entry = _Shadow(store, t.element_size())
        self._shadows[t.untyped_storage().data_ptr()] = entry
        self._alive.append(t)
        return entry

    def _pure(self, func, args, kwargs):
        out = func(*args, **kwargs)
        positions = _MOVES.get(func)
        if positions is None or not isinstance(out, torch.Tensor) or not out.numel() or out.device.type != "cpu":
            return out
        shadow_args = list(args)
        for i in positions:
            arg = args[i]
            inputs = list(arg) if isinstance(arg, (list, tuple)) else [arg]
            if not inputs or not all(isinstance(t, torch.Tensor) and t.dtype == out.dtype for t in inputs):
                return out
            shadows = [self._shadow_of(t) for t in inputs]
            if any(s is None for s in shadows):
                return out
            shadow_args[i] = shadows if isinstance(arg, (list, tuple)) else shadows[0]
        shadow_kwargs = {k: v for k, v in kwargs.items() if k not in ("dtype", "layout", "device", "pin_memory")}
        self._register(out, func(*shadow_args, **shadow_kwargs))
        return out

    def _origins(self, source: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        shadow = self._shadow_of(source)
        if shadow is None:
            return None
        ids = shadow.expand(dest.shape).reshape(-1)
        if bool((ids < 0).any()):
            return None  # part of the source has no known origin
        return ids.clone()
