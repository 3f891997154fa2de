"""The i.i.d. entropy bound the codec is measured against (docs/benchmarks.md).

For one XOR record over ``n`` elements, let X be the per-element XOR symbol (the full
bit pattern, 0 where the element is unchanged).  The bound is ``n * H(p) / 8`` bytes, where
``p`` is the empirical distribution of X over those n elements.  It is what an ideal coder
that treats elements as independent draws from the record's own symbol distribution would
spend, with that distribution given for free.  A chunk's bound is the sum over its records;
"pooled" uses one distribution for all elements of all records instead.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def _entropy_bits(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    if c.size <= 1:
        return 0.0
    total = c.sum()
    return float(-(c * np.log2(c / total)).sum())


def symbol_counts(n: int, xor_values: np.ndarray) -> dict[int, int]:
    nz = xor_values[xor_values != 0]
    vals, counts = np.unique(nz, return_counts=True)
    out = {int(v): int(c) for v, c in zip(vals, counts)}
    if n - nz.size:
        out[0] = n - int(nz.size)
    return out


def iid_bound_bytes(n: int, xor_values: np.ndarray) -> float:
    """Bound of one record: ``n`` elements, ``xor_values`` at the changed ones."""
    if n == 0:
        return 0.0
    return _entropy_bits(np.fromiter(symbol_counts(n, xor_values).values(), dtype=np.int64)) / 8


def pooled_bound_bytes(records: Iterable[tuple[int, np.ndarray]]) -> float:
    """One symbol distribution over every element of every (n, xor_values) record."""
    total: dict[int, int] = {}
    for n, vals in records:
        for k, c in symbol_counts(n, vals).items():
            total[k] = total.get(k, 0) + c
    return _entropy_bits(np.fromiter(total.values(), dtype=np.int64)) / 8
