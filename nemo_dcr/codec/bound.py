"""The i.i.d. entropy bound the codec is measured against (docs/benchmarks.md).

For one XOR record over ``n`` elements, let X be the per-element XOR symbol (the full
bit pattern, 0 where the element is unchanged).  The bound is ``n * H(p) / 8`` bytes, where
``p`` is the empirical distribution of X over those n elements.  It is what an ideal coder
that treats elements as independent draws from the record's own symbol distribution would
spend, with that distribution given for free.  A chunk's bound is the sum over its records;
"pooled" uses one distribution for all elements of all records instead.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

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


#: Sorted values are scanned, and symbol counts turned into bits, this many at a time: the
#: temporaries of ``iid_bound_bytes`` are O(_BLOCK) however many distinct values a record has.
#: A record with fewer distinct values is summed in one piece, as ``_entropy_bits`` does.
_BLOCK = 1 << 18


def _sorted_run_lengths(s: np.ndarray) -> Iterator[np.ndarray]:
    """Lengths of the runs of equal values in sorted ``s``, in order, ``_BLOCK`` values at a
    time (the run a block ends in is held back: the next block may continue it)."""
    carry, last = 0, None
    for start in range(0, s.size, _BLOCK):
        b = s[start : start + _BLOCK]
        lengths = np.diff(np.concatenate(([0], np.flatnonzero(b[1:] != b[:-1]) + 1, [b.size])))
        if carry:
            if b[0] == last:
                lengths[0] += carry
            else:
                yield np.array([carry], dtype=np.int64)
        carry, last = int(lengths[-1]), b[-1]
        yield lengths[:-1]
    if carry:
        yield np.array([carry], dtype=np.int64)


def iid_bound_bytes(n: int, xor_values: np.ndarray, *, overwrite: bool = False) -> float:
    """Bound of one record: ``n`` elements, ``xor_values`` at the changed ones.

    Symbols are counted by sorting the values and scanning the runs: memory beyond
    ``xor_values`` is a sorted copy of its nonzero values, or nothing with ``overwrite=True``
    (which sorts ``xor_values`` in place, for a caller that owns it), plus O(``_BLOCK``).  The
    same number as ``_entropy_bits`` of ``symbol_counts`` (bit for bit up to ``_BLOCK``
    distinct values; beyond, summed a block at a time)."""
    if n == 0:
        return 0.0
    x = np.asarray(xor_values).reshape(-1)
    if overwrite and x.flags.writeable and x.flags.c_contiguous:
        x.sort()
        # the zeros are one run of the sorted values: leave them out, as symbol_counts does
        # (a zero of x's own dtype: searchsorted casts x to a common dtype, a copy, otherwise)
        zero = x.dtype.type(0)
        parts = (x[: np.searchsorted(x, zero, "left")], x[np.searchsorted(x, zero, "right") :])
    else:
        s = x[x != 0]
        s.sort()
        parts = (s,)
    nonzero = sum(p.size for p in parts)
    zeros = n - nonzero
    total = nonzero + max(zeros, 0)
    bits, symbols, pending, npending = 0.0, 0, [], 0

    def flush() -> float:
        if not pending:
            return 0.0
        c = np.concatenate(pending).astype(np.float64)
        pending.clear()
        return float(-(c * np.log2(c / total)).sum())

    for p in parts:
        for lengths in _sorted_run_lengths(p):
            pending.append(lengths)
            npending += lengths.size
            symbols += lengths.size
            if npending >= _BLOCK:
                bits, npending = bits + flush(), 0
    if zeros > 0:  # symbol 0 last, as in symbol_counts
        pending.append(np.array([zeros], dtype=np.int64))
        symbols += 1
    if symbols <= 1:
        return 0.0
    return (bits + flush()) / 8


def pooled_bound_bytes(records: Iterable[tuple[int, np.ndarray]]) -> float:
    """One symbol distribution over every element of every (n, xor_values) record."""
    total: dict[int, int] = {}
    for n, vals in records:
        for k, c in symbol_counts(n, vals).items():
            total[k] = total.get(k, 0) + c
    return _entropy_bits(np.fromiter(total.values(), dtype=np.int64)) / 8
