"""Inverse of the shard -> canonical projection, as runs, for context-mode coding.

Context mode conditions every element of a record's canonical range ``[lo, hi)`` on its
base bits, so the trainer must produce the committed canonical bits of that range from
its local baseline.  ``CanonicalRuns`` records where the local elements of one
``ParamView`` land in one canonical tensor as maximal runs ``local[i] + k -> canon[i] + k``
(``k < length[i]``).  Column-parallel shards, replicated norms and vocabulary shards give
one run or a few (fused QKV: three per query group); row-parallel shards give one run per
row and a strided coverage -- those are not ``contiguous`` and are coded context-free,
because the rank does not hold the base of the other ranks' columns inside its range.

Computed once per view at set-up, in blocks (O(numel) time, O(block) memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nemo_dcr.layout.mapping import CanonicalProjector
from nemo_dcr.layout.shards import LayoutError, ParamView


@dataclass(frozen=True)
class CanonicalRuns:
    name: str
    param_start: np.ndarray
    """int64 run starts as flat indices into the *parameter* (view start included)."""
    canon_start: np.ndarray
    """int64 run starts in the canonical tensor, increasing."""
    length: np.ndarray

    def __post_init__(self) -> None:
        n = self.canon_start.size
        if self.param_start.size != n or self.length.size != n or (n and self.length.min() < 1):
            raise LayoutError(f"{self.name}: inconsistent runs")
        if n > 1 and np.any(self.canon_start[1:] < self.canon_start[:-1] + self.length[:-1]):
            raise LayoutError(f"{self.name}: runs overlap in canonical coordinates")

    @property
    def lo(self) -> int:
        return int(self.canon_start[0])

    @property
    def hi(self) -> int:
        return int(self.canon_start[-1] + self.length[-1])

    @property
    def contiguous(self) -> bool:
        """The runs tile ``[lo, hi)`` without a gap."""
        return int(self.length.sum()) == self.hi - self.lo

    def fill(self, dst: np.ndarray, param_bits: np.ndarray, lo: int, hi: int) -> None:
        """``dst[lo:hi] = canonical bits`` taken from the parameter's flat bits; ``[lo, hi)``
        must lie inside the covered range (checked)."""
        if not (self.contiguous and self.lo <= lo <= hi <= self.hi):
            raise LayoutError(f"{self.name}: [{lo}, {hi}) is not inside the contiguous coverage "
                              f"[{self.lo}, {self.hi})")
        ends = self.canon_start + self.length
        first = int(np.searchsorted(ends, lo, side="right"))
        for i in range(first, self.canon_start.size):
            c0 = int(self.canon_start[i])
            if c0 >= hi:
                break
            a, b = max(lo, c0), min(hi, int(ends[i]))
            p0 = int(self.param_start[i]) + (a - c0)
            dst[a:b] = param_bits[p0 : p0 + (b - a)]


def canonical_runs(projector: CanonicalProjector, view: ParamView, *, block: int = 1 << 22) -> dict[str, CanonicalRuns]:
    """Runs of every canonical tensor ``view`` contributes to (see the module docstring)."""
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    n = view.spec.numel
    for b0 in range(0, n, block):
        local = np.arange(b0, min(n, b0 + block), dtype=np.int64)
        for cspec, cflat, sel in projector.project(view.spec, local):
            loc = local[sel]
            brk = np.flatnonzero((np.diff(loc) != 1) | (np.diff(cflat) != 1)) + 1
            starts = np.concatenate(([0], brk))
            lengths = np.diff(np.concatenate((starts, [loc.size])))
            parts.setdefault(cspec.name, []).append((loc[starts] + view.start, cflat[starts], lengths))
    out = {}
    for name, pieces in parts.items():
        p = np.concatenate([x[0] for x in pieces])
        c = np.concatenate([x[1] for x in pieces])
        ln = np.concatenate([x[2] for x in pieces])
        order = np.argsort(c, kind="stable")
        p, c, ln = p[order], c[order], ln[order]
        # merge runs that continue each other (split only by a block boundary)
        cont = (c[1:] == c[:-1] + ln[:-1]) & (p[1:] == p[:-1] + ln[:-1])
        if cont.any():
            head = np.concatenate(([True], ~cont))
            group = np.cumsum(head) - 1
            ln = np.bincount(group, weights=ln).astype(np.int64)
            p, c = p[head], c[head]
        out[name] = CanonicalRuns(name=name, param_start=p, canon_start=c, length=ln)
    return out
