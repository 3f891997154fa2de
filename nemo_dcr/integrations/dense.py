"""Dense canonical state from a sharded Megatron model: the initial checkpoint and the
dense-refit reference the delta path is verified against.

This is the expensive path a delta refit avoids (every shard is gathered to one rank), so
it runs only for version 0 and in verification mode.  It shares the rule table with the
delta path but uses each transform's ``dense`` implementation, and its output is checked
independently by the logits test (HF model vs Megatron model).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_dcr.errors import PlacementError
from nemo_dcr.layout.mapping import CanonicalProjector
from nemo_dcr.layout.shards import ParamView


def gather_canonical_state(
    params: dict[str, torch.Tensor],
    views: dict[str, list[ParamView]],
    projector: CanonicalProjector,
    *,
    dst: int = 0,
) -> dict[str, torch.Tensor] | None:
    """All main-replica shards -> rank ``dst`` -> global Megatron tensors -> canonical tensors.

    Collective over the default process group; returns the canonical state dict on ``dst``
    and None elsewhere.
    """
    local = []
    for name, vs in views.items():
        flat = params[name].detach().reshape(-1).cpu()
        for v in vs:
            if v.spec.is_main_replica:
                local.append((v.spec, flat[v.start : v.start + v.spec.numel].clone()))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        gathered = [None] * world if dist.get_rank() == dst else None
        dist.gather_object(local, gathered, dst=dst)
        if dist.get_rank() != dst:
            return None
        pieces = [p for rank_pieces in gathered for p in rank_pieces]
    else:
        pieces = local

    globals_: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for spec, data in pieces:
        g = globals_.get(spec.key)
        if g is None:
            g = globals_[spec.key] = torch.zeros(spec.global_shape, dtype=data.dtype)
            filled[spec.key] = 0
        index = tuple(
            spec.global_offset[ax] if ax < spec.prepend_axis_num
            else slice(spec.global_offset[ax], spec.global_offset[ax] + spec.local_shape[ax - spec.prepend_axis_num])
            for ax in range(len(spec.global_shape))
        )
        g[index] = data.reshape(spec.local_shape)
        filled[spec.key] += spec.numel
    for key, g in globals_.items():
        if filled[key] != g.numel():
            raise PlacementError(f"dense gather of {key}: {filled[key]} of {g.numel()} elements present")
    out: dict[str, torch.Tensor] = {}
    for key, g in globals_.items():
        for cname, t in projector.dense(key, g).items():
            if cname in out:
                raise PlacementError(f"canonical tensor {cname} produced twice")
            out[cname] = t.contiguous()
    return out
