"""iid_bound_bytes counts symbols by sorting and scanning runs a block at a time: the same
number as one ``symbol_counts`` dict, in memory that does not grow with the distinct values."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import bound
from nemo_dcr.codec.bound import _entropy_bits, iid_bound_bytes, symbol_counts


def _dict_bound(n: int, values: np.ndarray) -> float:
    return _entropy_bits(np.fromiter(symbol_counts(n, values).values(), dtype=np.int64)) / 8


def _cases(rng):
    yield 10, np.zeros(0, np.uint16)
    yield 10, np.array([5], np.uint16)
    yield 1, np.array([5], np.uint16)  # one symbol: 0 bits
    yield 7, np.array([3, 3, 3, 3, 3, 3, 3], np.uint8)
    yield 9, np.array([0, 2, 0, 2], np.uint8)  # zeros among the values count as unchanged
    yield 50, np.array([-3, 0, 4, -3, 9], np.int64)  # signed: zeros sort into the middle
    for dtype, hi in [(np.uint8, 255), (np.uint16, 65535), (np.uint32, 2**32 - 1), (np.uint64, 2**64 - 1)]:
        for k in [2, 100, 5000]:
            v = rng.integers(1, hi, size=k, dtype=dtype, endpoint=True)
            v[: k // 3] = v[0]  # a long run
            yield k * 2, v


@pytest.mark.parametrize("block", [bound._BLOCK, 3])
def test_bound_is_what_symbol_counts_gives(rng, monkeypatch, block):
    """Bit for bit while every symbol fits one block; summed per block (to rounding) past it.
    A block of 3 makes runs straddle blocks and symbols span several flushes."""
    monkeypatch.setattr(bound, "_BLOCK", block)
    for n, v in _cases(rng):
        want = _dict_bound(n, v)
        keep = v.copy()
        got = iid_bound_bytes(n, v)
        assert np.array_equal(v, keep)  # not overwritten
        in_place = iid_bound_bytes(n, v.copy(), overwrite=True)
        if len(symbol_counts(n, v)) < block:
            assert got == want and in_place == want
        else:
            assert got == pytest.approx(want, rel=1e-12) and in_place == pytest.approx(want, rel=1e-12)
    # negative control: merging two symbols is seen
    v = np.array([1, 2, 2, 3], np.uint16)
    assert iid_bound_bytes(8, v) != iid_bound_bytes(8, np.array([2, 2, 2, 3], np.uint16))


def test_overwrite_sorts_in_place_and_leaves_read_only_arrays_alone(rng):
    v = rng.integers(1, 1000, size=500).astype(np.uint32)
    want = _dict_bound(1000, v)
    w = v.copy()
    assert iid_bound_bytes(1000, w, overwrite=True) == want
    assert np.array_equal(w, np.sort(v))
    ro = v.copy()
    ro.flags.writeable = False
    assert iid_bound_bytes(1000, ro, overwrite=True) == want
    assert np.array_equal(ro, v)


def test_bound_of_many_distinct_values_is_computed_in_small_memory():
    """2**19 distinct uint32 values: the dict of symbol_counts holds a Python int pair per
    value (~50 MB); the run scan holds one block (~8 MB, the same at 2**18 or 2**20 values).
    tracemalloc sees numpy's allocations."""
    import tracemalloc

    v = np.random.default_rng(0).permutation(1 << 19).astype(np.uint32) + 1
    tracemalloc.start()
    try:
        iid_bound_bytes(1 << 20, v, overwrite=True)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        symbol_counts(1 << 20, v)  # control: the dict the bound used to build
        dict_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 < dict_peak
