"""The sender's rank helpers and collectives over ``torch.distributed`` (gloo or NCCL).

Every collective here degrades to the local value without a process group (one process), so
the sender runs unchanged in a single-process test.  The object collectives are for small
plain values only: they travel pickled, between this job's own ranks.
"""
from __future__ import annotations

import sys

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def log(msg: str) -> None:
    """One line on stderr (the trainer's log), flushed at once."""
    print(msg, file=sys.stderr, flush=True)


def from_rank0(obj, group=None):
    """Collective over ``group`` (default: the default group): rank 0's ``obj`` on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(obj, group=None) -> list:
    """Collective over ``group`` (default: the default group): every rank's ``obj``, in rank order."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_to0(obj, group=None) -> list | None:
    """Collective over ``group``: rank 0 gets every rank's ``obj`` in rank order, the others None."""
    if world() == 1:
        return [obj]
    out = [None] * world() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def agree_or_raise(error: str | None, exc: type[Exception]) -> None:
    """Collective: raise the same ``exc`` on EVERY rank if any rank reports an ``error`` (a
    rank that raised alone would leave the others waiting in the next collective)."""
    errors = all_gather(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        raise exc(e if len(errors) == 1 else f"rank {r}: {e}")
