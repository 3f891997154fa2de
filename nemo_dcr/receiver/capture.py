"""Observe the writes a runtime's loader makes into its module's storages.

``WriteCapture`` is a ``TorchDispatchMode``: every ATen op the loader runs passes through
it.  An op whose schema marks an argument as written (``Tensor(a!)``: ``copy_``, ``fill_``,
``out=`` variants, ...) and whose written tensor lives in the storage of one of the
module's parameters or buffers is recorded as a ``CapturedWrite``; with
``execute=False`` the op is *not* run, so the module is left untouched.  That is how the
apply engine learns a runtime's placement without re-implementing it: it feeds canonical
tensors to the loader and looks at where their bits land.

A write is *plain* when it is ``aten.copy_`` from a view of one of the tensors fed to the
loader, with the same dtype at both ends: the destination then receives the fed bits
unchanged, at positions given by the two views' geometry.  Anything else (a cast, a
computed source, ``mul_`` in place, ...) is recorded but not plain.

The mode is thread-local (PyTorch keeps the dispatch mode stack per thread): a loader that
copies on worker threads escapes it, which is one reason the apply engine checks, after
each loader run, that no parameter or buffer was rebound or written unseen.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COPY = torch.ops.aten.copy_.default


@dataclass(frozen=True)
class StorageOwner:
    """The parameter or buffer that owns one storage (aliases: tied names)."""

    name: str
    aliases: tuple[str, ...]
    tensor: torch.Tensor
    is_buffer: bool


def module_storages(module: torch.nn.Module) -> dict[int, StorageOwner]:
    """Storage data pointer -> owner, over every parameter and buffer of ``module``.

    Empty tensors are skipped (they own no bytes and may share a null pointer).
    """
    names: dict[int, list[str]] = {}
    first: dict[int, tuple[torch.Tensor, bool]] = {}
    items = [(n, p, False) for n, p in module.named_parameters(remove_duplicate=False)]
    items += [(n, b, True) for n, b in module.named_buffers(remove_duplicate=False)]
    for name, t, is_buffer in items:
        if t is None or t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        names.setdefault(ptr, []).append(name)
        first.setdefault(ptr, (t, is_buffer))
    return {
        ptr: StorageOwner(name=ns[0], aliases=tuple(ns[1:]), tensor=first[ptr][0], is_buffer=first[ptr][1])
        for ptr, ns in names.items()
    }


def storage_fingerprint(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Name -> (id of the tensor object, storage pointer): changes when a loader rebinds."""
    out = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        out[name] = (id(t), t.untyped_storage().data_ptr())
    for name, t in module.named_buffers(remove_duplicate=False):
        if t is not None:
            out["buffer:" + name] = (id(t), t.untyped_storage().data_ptr())
    return out


@dataclass(frozen=True)
class Geometry:
    """A strided view of a storage, in elements."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor, base_offset: int = 0) -> Geometry:
        return cls(t.storage_offset() - base_offset, tuple(t.shape), tuple(t.stride()))

    def is_contiguous_whole(self, shape: tuple[int, ...]) -> bool:
        """True when this is the full row-major tensor of ``shape`` starting at offset 0."""
        if self.offset != 0 or self.shape != shape:
            return False
        expect, acc = [], 1
        for s in reversed(shape):
            expect.append(acc)
            acc *= s
        return all(s == e or n == 1 for s, e, n in zip(self.stride, reversed(expect), shape))


@dataclass(frozen=True, eq=False)
class CapturedWrite:
    """One loader write into module storage.

    dest_owner: the parameter/buffer whose storage is written.
    dest: the written tensor as the op received it (a view of that storage).
    source: for ``copy_``, the source tensor; else ``None``.
    fed_name: the canonical name whose fed tensor ``source`` is a view of, else ``None``.
    plain: ``copy_``, source is a view of a fed tensor, equal dtypes at both ends.
    origins: for a ``copy_`` that is not plain but whose source was produced from fed tensors
        by data movement only (``nemo_dcr.receiver.provenance``): per destination element
        (row-major over ``dest.shape``), the int64 origin id of the fed element it receives.
    """

    op: str
    dest_owner: StorageOwner
    dest: torch.Tensor
    source: torch.Tensor | None
    fed_name: str | None
    plain: bool
    origins: torch.Tensor | None = None

    @property
    def dest_geometry(self) -> Geometry:
        return Geometry.of(self.dest, self.dest_owner.tensor.storage_offset())


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


class WriteCapture(TorchDispatchMode):
    """Record (and with ``execute=False`` suppress) loader writes into module storage.

    storages: ``module_storages(module)`` of the module being loaded.
    fed: canonical name -> the tensor handed to the loader under that name.
    """

    def __init__(self, storages: Mapping[int, StorageOwner], fed: Mapping[str, torch.Tensor], *, execute: bool):
        super().__init__()
        self._storages = storages
        self._fed_by_ptr = {t.untyped_storage().data_ptr(): name for name, t in fed.items() if t.numel()}
        self._fed = fed
        self._execute = execute
        self.writes: list[CapturedWrite] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func._schema.is_mutable:
            return self._pure(func, args, kwargs)
        written = _written_tensors(func, args, kwargs)
        hits = [(t, self._storages.get(t.untyped_storage().data_ptr())) for t in written if t.numel()]
        hits = [(t, owner) for t, owner in hits if owner is not None]
        if not hits:
            return func(*args, **kwargs)
        for dest, owner in hits:
            source = args[1] if func is _COPY else None
            fed_name = None
            plain = False
            if isinstance(source, torch.Tensor) and source.numel():
                fed_name = self._fed_by_ptr.get(source.untyped_storage().data_ptr())
                plain = (
                    fed_name is not None
                    and source.dtype == dest.dtype == self._fed[fed_name].dtype
                    and source.device == dest.device
                )
            origins = None
            if func is _COPY and not plain and isinstance(source, torch.Tensor) and source.dtype == dest.dtype:
                origins = self._origins(source, dest)
            self.writes.append(
                CapturedWrite(
                    op=str(func),
                    dest_owner=owner,
                    dest=dest,
                    source=source,
                    fed_name=fed_name,
                    plain=plain,
                    origins=origins,
                )
            )
        if self._execute:
            return func(*args, **kwargs)
        return written[0] if len(written) == 1 else tuple(written)

    def _pure(self, func, args, kwargs):
        """An op that writes nothing; a subclass may follow where its data comes from."""
        return func(*args, **kwargs)

    def _origins(self, source: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        """Origin ids of a non-plain ``copy_`` source (see ``CapturedWrite.origins``); none here."""
        del source, dest
        return None
