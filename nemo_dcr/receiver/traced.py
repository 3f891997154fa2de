"""TRACED placements: where a loader's data movement puts each canonical element.

Made from ``CapturedWrite.origins`` (``nemo_dcr.receiver.provenance``): a write whose
source was built from fed tensors by whitelisted data movement tells, per destination
element, which fed element it receives.  Per canonical tensor those pairs are compressed to
affine runs ``(canonical start, owner, destination start, length)``: a stacked expert is one
run, so memory is O(runs), not O(numel).  ``apply`` then XORs (or overwrites) changed
elements of the destination storages directly: O(nnz log runs), no loader call, exactly
like a DIRECT placement whose index map is piecewise affine.

Rules (checked here, at prewarm): the runs of one canonical tensor cover each of its
elements exactly once (an element dropped or copied twice makes the tensor a TRANSFORM),
and no destination element is written by two canonical elements (refused, as for plain
copies).  What is *not* here: a fallback index array for maps that do not compress
(a transposing conversion gives one run per element, 32 bytes per element).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.dtypes import int_view
from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.capture import CapturedWrite
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.provenance import OriginTable


@dataclass(frozen=True, eq=False)
class Runs:
    """Affine pieces of a canonical -> destination-storage index map (all int64 arrays).

    Canonical element ``canon[i] + k`` lands at storage element ``dest[i] + k`` of
    ``owners[owner[i]]`` for ``0 <= k < length[i]``; storage elements count from the start
    of the owner's storage (not from the parameter's storage offset)."""

    owners: tuple[str, ...]
    canon: np.ndarray
    dest: np.ndarray
    length: np.ndarray
    owner: np.ndarray

    def __post_init__(self) -> None:
        n = self.canon.size
        if not all(a.ndim == 1 and a.size == n for a in (self.dest, self.length, self.owner)):
            raise ValidationError("Runs: arrays differ in length")
        bad_owner = n and (int(self.owner.min()) < 0 or int(self.owner.max()) >= len(self.owners))
        if n and (int(self.length.min()) <= 0 or bad_owner):
            raise ValidationError("Runs: empty run or owner index out of range")

    @property
    def count(self) -> int:
        return int(self.canon.size)

    @classmethod
    def compress(cls, owner: str, canon: np.ndarray, dest: np.ndarray) -> Runs:
        """Runs of element pairs ``canon[i] -> dest[i]`` into one owner."""
        order = np.argsort(canon, kind="stable")
        c, d = canon[order], dest[order]
        brk = (np.diff(c) != 1) | (np.diff(d) != 1)
        starts = np.flatnonzero(np.concatenate([[True], brk]))
        lengths = np.diff(np.concatenate([starts, [c.size]]))
        return cls((owner,), c[starts], d[starts], lengths, np.zeros(starts.size, dtype=np.int64))

    @classmethod
    def merge(cls, parts: Iterable[Runs]) -> Runs:
        """One sorted map from several (each may name other owners); adjacent runs fuse."""
        parts = list(parts)
        owners = tuple(sorted({o for p in parts for o in p.owners}))
        idx = {o: i for i, o in enumerate(owners)}
        canon = np.concatenate([p.canon for p in parts])
        dest = np.concatenate([p.dest for p in parts])
        length = np.concatenate([p.length for p in parts])
        owner = np.concatenate([np.array([idx[o] for o in p.owners], dtype=np.int64)[p.owner] for p in parts])
        order = np.argsort(canon, kind="stable")
        canon, dest, length, owner = canon[order], dest[order], length[order], owner[order]
        if canon.size > 1:
            joins = (canon[:-1] + length[:-1] == canon[1:]) & (dest[:-1] + length[:-1] == dest[1:]) & (
                owner[:-1] == owner[1:]
            )
            if joins.any():
                head = np.flatnonzero(np.concatenate([[True], ~joins]))
                length = np.add.reduceat(length, head)
                canon, dest, owner = canon[head], dest[head], owner[head]
        return cls(owners, canon, dest, length, owner)

    def coverage_problem(self, numel: int) -> str | None:
        """``None`` when the runs cover ``[0, numel)`` exactly once, else what is wrong."""
        if self.count == 0:
            return "no element reaches the module"
        ends = self.canon + self.length
        if bool(np.any(self.canon[1:] < ends[:-1])):
            return "some canonical elements are copied to more than one place"
        if int(self.canon[0]) != 0 or int(ends[-1]) != numel or bool(np.any(self.canon[1:] != ends[:-1])):
            return "some canonical elements never reach the module"
        return None

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Canonical flat positions -> (owner index, storage element), O(len(pos) log runs).
        One run (a stacked expert slice: the common case) is a shift (the owner indices a
        read-only broadcast)."""
        if self.canon.size == 1:
            return np.broadcast_to(self.owner[:1], pos.shape), pos + int(self.dest[0] - self.canon[0])
        r = np.searchsorted(self.canon, pos, side="right") - 1
        return self.owner[r], self.dest[r] + (pos - self.canon[r])


def storage_positions(t: torch.Tensor) -> np.ndarray:
    """Storage element index of each element of ``t`` (row-major over its shape)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    every = torch.arange(n, dtype=torch.int64)
    return torch.as_strided(every, t.shape, t.stride(), t.storage_offset()).reshape(-1).numpy()


def traced_pieces(w: CapturedWrite, table: OriginTable) -> dict[str, Runs]:
    """Split one traced write into per-canonical-name runs."""
    assert w.origins is not None
    ids = w.origins.numpy()
    dest = storage_positions(w.dest)
    out = {}
    for name, at in table.split(ids).items():
        out[name] = Runs.compress(w.dest_owner.name, ids[at] - table.base(name), dest[at])
    return out


def plain_pieces(w: CapturedWrite, fed: torch.Tensor) -> Runs:
    """Runs of a plain copy (a view of the fed tensor ``fed``) into its destination."""
    assert w.plain and w.source is not None
    every = torch.arange(fed.untyped_storage().nbytes() // fed.element_size(), dtype=torch.int64)
    src = torch.as_strided(every, w.source.shape, w.source.stride(), w.source.storage_offset())
    canon = src.expand(w.dest.shape).reshape(-1).numpy() - fed.storage_offset()
    return Runs.compress(w.dest_owner.name, canon, storage_positions(w.dest))


def flat_storage(t: torch.Tensor) -> np.ndarray:
    """Writable integer numpy view over the whole storage of ``t`` (element-sized)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(int_view(t.detach()), (n,), (1,), 0).numpy()


def check_traced_overlaps(
    traced: Mapping[str, Runs], others: Mapping[str, list[CapturedWrite]], owner_tensors: Mapping[str, torch.Tensor]
) -> None:
    """No destination element may be reached twice: across traced tensors, or by a traced
    tensor and another write into the same storage."""
    by_owner: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for name, runs in traced.items():
        for i, owner in enumerate(runs.owners):
            sel = runs.owner == i
            by_owner.setdefault(owner, []).append((name, runs.dest[sel], runs.length[sel]))
    for owner, entries in by_owner.items():
        t = owner_tensors[owner]
        n = t.untyped_storage().nbytes() // t.element_size()
        count = np.zeros(n + 1, dtype=np.int32)
        for _, start, length in entries:
            np.add.at(count, start, 1)
            np.add.at(count, start + length, -1)
        count = np.cumsum(count)[:n]
        writers = [name for name, _, _ in entries]
        for name, ws in others.items():
            for w in ws:
                if w.dest_owner.name == owner or owner in w.dest_owner.aliases:
                    count[storage_positions(w.dest)] += 1
                    writers.append(name)
        if int(count.max(initial=0)) > 1:
            raise LoaderError(
                f"destination elements of {owner} are written more than once (by {sorted(set(writers))[:4]})"
            )


def load_units(adapter, names: Iterable[str]) -> list[tuple[str, ...]]:
    """Partition ``names`` into the groups the adapter's loader must receive together.

    An adapter may offer ``load_groups() -> Iterable[Iterable[str]]`` (e.g. all experts of
    a fused MoE layer); names it does not group load alone."""
    names = list(names)
    groups = getattr(adapter, "load_groups", None)
    unit_of: dict[str, tuple[str, ...]] = {}
    if groups is not None:
        for g in groups():
            unit = tuple(g)
            for n in unit:
                if n in unit_of:
                    raise LoaderError(f"the adapter puts {n} in two load groups")
                unit_of[n] = unit
    out, seen = [], set()
    for n in names:
        unit = unit_of.get(n, (n,))
        if unit in seen:
            continue
        seen.add(unit)
        out.append(unit)
    return out
