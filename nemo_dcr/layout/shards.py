"""Where each element of a training shard lives in Megatron's global (checkpoint) tensors.

Megatron-Core already knows this: ``module.sharded_state_dict()`` returns, for every local
parameter, ``ShardedTensor``s (key, global_shape, global_offset, axis_fragmentations,
replica_id, prepend_axis_num) -- the same metadata its distributed checkpointing uses to
write a TP/PP/EP-sharded model as one global checkpoint.  Factories (e.g. the SwiGLU
``linear_fc1`` split into gate/up halves) are built into the ShardedTensors they stand for.

This module turns that metadata into data-free ``ShardSpec``s plus, for each local
parameter, the ``ParamView``s that say which contiguous range of the parameter's flat
storage is which ShardedTensor.  Nothing here copies weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.codec.types import shape_numel
from nemo_dcr.errors import PlacementError


class LayoutError(PlacementError, ValueError):
    """Megatron's shard metadata, or a layout rule, does not describe the parameters it is
    applied to (inconsistent offsets, gaps, overlaps, shapes a rule does not fit).  Also a
    ``ValueError``, as code written before the error families caught it."""


@dataclass(frozen=True)
class ShardSpec:
    """Data-free form of a Megatron ``ShardedTensor`` (what a manifest may carry).

    ``global_offset`` is in elements.  The first ``prepend_axis_num`` global axes are not
    present in the local tensor (e.g. the layer axis of stacked ``decoder.layers.*`` keys):
    the local tensor sits at a single index ``global_offset[i]`` along each of them.
    """

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    replica_id: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        nd = len(self.global_shape)
        p = self.prepend_axis_num
        if len(self.global_offset) != nd:
            raise LayoutError(f"{self.key}: global_offset {self.global_offset} vs global_shape {self.global_shape}")
        if not 0 <= p <= nd or len(self.local_shape) != nd - p:
            raise LayoutError(
                f"{self.key}: local_shape {self.local_shape} + {p} prepended axes != global rank {nd}"
            )
        for ax in range(nd):
            extent = 1 if ax < p else self.local_shape[ax - p]
            if self.global_offset[ax] < 0 or self.global_offset[ax] + extent > self.global_shape[ax]:
                raise LayoutError(
                    f"{self.key}: shard [{self.global_offset[ax]}, +{extent}) outside axis {ax} "
                    f"of global shape {self.global_shape}"
                )

    @property
    def is_main_replica(self) -> bool:
        """Exactly one rank holds the main replica of each global element (Megatron's rule)."""
        return all(r == 0 for r in self.replica_id)

    @property
    def numel(self) -> int:
        return shape_numel(self.local_shape)

    def global_index(self, local_flat: np.ndarray) -> np.ndarray:
        """Global multi-indices, shape ``(n, len(global_shape))``, of local flat indices."""
        local_flat = np.asarray(local_flat, dtype=np.int64)
        p = self.prepend_axis_num
        out = np.empty((local_flat.size, len(self.global_shape)), dtype=np.int64)
        out[:, :p] = np.asarray(self.global_offset[:p], dtype=np.int64)
        if self.local_shape:
            local = np.unravel_index(local_flat, self.local_shape)
            for i, li in enumerate(local):
                out[:, p + i] = li + self.global_offset[p + i]
        return out


@dataclass(frozen=True)
class ParamView:
    """A contiguous range ``[start, start + spec.numel)`` of a parameter's flat storage."""

    param_name: str
    start: int
    spec: ShardSpec


def _flatten_sharded(obj: Any, out: list) -> None:
    """Depth-first walk collecting ShardedTensors, building factories on the way."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(obj, ShardedTensorFactory):
        _flatten_sharded(obj.build(), out)
    elif isinstance(obj, ShardedTensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _flatten_sharded(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _flatten_sharded(v, out)


def collect_param_views(module: torch.nn.Module) -> dict[str, list[ParamView]]:
    """Map every parameter of ``module`` to the ShardedTensor views that cover it.

    Each ShardedTensor's data must be a contiguous view into exactly one parameter; the
    views of one parameter must tile it without overlap (checked).  ShardedObjects
    (e.g. ``_extra_state``) carry no weights and are ignored.  A parameter that no
    ShardedTensor covers is an error: it would silently never be refit.
    """
    sharded: list = []
    _flatten_sharded(module.sharded_state_dict(), sharded)
    params = dict(module.named_parameters())
    # Parameters may be views into one flat buffer (Megatron DDP / distributed optimizer),
    # so a ShardedTensor is matched by storage AND element range, not by storage alone.
    by_storage: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in params.items():
        if not p.is_contiguous():
            raise LayoutError(f"parameter {name} is not contiguous")
        by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(
            (p.storage_offset(), p.numel(), name, p)
        )

    def owner_of(t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        lo, hi = t.storage_offset(), t.storage_offset() + t.numel()
        for off, n, name, p in by_storage.get(t.untyped_storage().data_ptr(), ()):
            if off <= lo and hi <= off + n and t.dtype == p.dtype:
                return name, p
        return None

    views: dict[str, list[ParamView]] = {name: [] for name in params}
    for st in sharded:
        data = st.data
        if data is None or not isinstance(data, torch.Tensor):
            raise LayoutError(f"ShardedTensor {st.key} carries no local data")
        owner = owner_of(data)
        if owner is None:
            continue  # a buffer or a tensor that is not a parameter (not refit here)
        name, p = owner
        if not data.is_contiguous() or data.dtype != p.dtype:
            raise LayoutError(f"ShardedTensor {st.key} is not a contiguous {p.dtype} view of {name}")
        start = data.storage_offset() - p.storage_offset()
        if tuple(st.local_shape) != tuple(data.shape):
            raise LayoutError(f"ShardedTensor {st.key}: local_shape {st.local_shape} != data {tuple(data.shape)}")
        spec = ShardSpec(
            key=st.key,
            local_shape=tuple(int(s) for s in st.local_shape),
            global_shape=tuple(int(s) for s in st.global_shape),
            global_offset=tuple(int(s) for s in st.global_offset),
            prepend_axis_num=int(st.prepend_axis_num),
            replica_id=tuple(st.replica_id) if isinstance(st.replica_id, tuple) else (int(st.replica_id),),
            dtype=dtypes.from_torch(p.dtype).name,
        )
        views[name].append(ParamView(param_name=name, start=int(start), spec=spec))

    for name, vs in views.items():
        vs.sort(key=lambda v: v.start)
        covered = 0
        for v in vs:
            if v.start != covered:
                raise LayoutError(f"ShardedTensors of {name} leave a gap or overlap at element {covered}")
            covered += v.spec.numel
        if covered != params[name].numel():
            raise LayoutError(
                f"parameter {name}: ShardedTensors cover {covered} of {params[name].numel()} elements"
            )
    return views


def check_tiling(specs) -> None:
    """Every element of every global tensor is held by exactly one main replica.

    ``specs``: the main-replica ``ShardSpec``s of ALL ranks.  Per key, the shards must
    agree on the global shape, have distinct offsets, lie inside it (``ShardSpec``
    checks that) and their volumes must add up to the global volume.  Megatron's shards
    of one key are a grid (equal extents along each split axis), so distinct offsets and
    a matching volume mean an exact tiling; a missing shard or one emitted twice by two
    ranks (a wrong replica_id) is refused.  O(shards log shards), data-free.
    """
    by_key: dict[str, list[ShardSpec]] = {}
    for s in specs:
        by_key.setdefault(s.key, []).append(s)
    for key, group in by_key.items():
        shapes = {s.global_shape for s in group}
        if len(shapes) != 1:
            raise LayoutError(f"{key}: shards disagree on the global shape: {sorted(shapes)}")
        (shape,) = shapes
        offsets = [s.global_offset for s in group]
        if len(set(offsets)) != len(offsets):
            dup = next(o for o in offsets if offsets.count(o) > 1)
            raise LayoutError(f"{key}: two main replicas hold the shard at offset {dup} (an element would be "
                              "emitted twice: check replica_id)")
        volume = sum(shape_numel(s.local_shape) for s in group)
        total = shape_numel(shape[group[0].prepend_axis_num:]) * shape_numel(shape[: group[0].prepend_axis_num])
        if volume != total:
            raise LayoutError(f"{key}: main replicas cover {volume} of {total} elements of {shape}"
                              + (" (some shard has no main replica)" if volume < total else " (overlap)"))
