"""``Baseline.diff_many``: one XOR pass over many small parameters gives, per parameter,
exactly what ``Baseline.diff`` gives, and committing it advances the baseline bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.baseline.pinned import Baseline
from nemo_dcr.errors import ValidationError
from nemo_dcr.kernels import bits_view_np
from nemo_dcr.sender.chunker import SMALL_PARAM_NUMEL, Chunker


def _params(seed: int, shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=g).to(torch.bfloat16) for i, s in enumerate(shapes)}


def _step(params: dict[str, torch.Tensor], seed: int, rate: float) -> None:
    """Change about ``rate`` of the elements of every parameter, some of none."""
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params.values()):
        if i % 5 == 3:
            continue  # unchanged parameters are left out of the result
        mask = torch.rand(p.shape, generator=g) < rate
        p[mask] = (p[mask].float() * 1.01 + 1e-3).to(p.dtype)


SHAPES = [(8, 64), (64,), (3, 5), (1,), (16, 8), (0,), (7, 9, 2), (64, 64), (2, 2)]


def test_diff_many_equals_diff_per_parameter_and_commits_bit_exactly():
    params = _params(0, SHAPES)
    one, many = Baseline(params), Baseline(params)
    _step(params, 1, 0.05)
    got = dict(many.diff_many(list(params.items())))
    want = {n: one.diff(n, p) for n, p in params.items()}
    assert set(got) == {n for n, d in want.items() if d.positions.size}
    assert len(got) < len(params)  # some parameters have no change and are left out
    for name, change in got.items():
        np.testing.assert_array_equal(change.positions, want[name].positions)
        np.testing.assert_array_equal(change.xor_values, want[name].xor_values)
    many.commit(1)
    for name, p in params.items():
        np.testing.assert_array_equal(many.bits(name), bits_view_np(p.contiguous()))


def test_diff_many_negative_control_sees_one_flipped_bit():
    params = _params(2, SHAPES)
    base = Baseline(params)
    assert base.diff_many(list(params.items())) == []  # nothing changed
    target = params["p6"]
    bits = bits_view_np(target)
    bits[17] ^= 1 << 3  # one stored bit, one parameter in the middle of the batch
    got = base.diff_many(list(params.items()))
    assert [n for n, _ in got] == ["p6"]
    assert got[0][1].positions.tolist() == [17] and got[0][1].xor_values.tolist() == [1 << 3]


def test_diff_many_refuses_mixed_dtypes_and_shapes():
    params = _params(3, [(4,), (5,)])
    base = Baseline(params)
    with pytest.raises(ValidationError, match="one batch holds one dtype"):
        base.diff_many([("p0", params["p0"]), ("p1", params["p1"].float())])
    with pytest.raises(ValidationError, match="p1"):
        base.diff_many([("p0", params["p0"]), ("p1", torch.zeros(6, dtype=torch.bfloat16))])


def test_chunker_batches_small_parameters_in_order():
    shapes = [(8,), (SMALL_PARAM_NUMEL + 1,), (4,), (4,), (2,)]
    params = _params(4, shapes)
    params["p4"] = params["p4"].float()  # a dtype change ends a batch
    chunker = Chunker.__new__(Chunker)  # only the parameter walk is under test here
    chunker.params = params
    got = [[n for n, _ in b] for b in chunker._batches()]
    assert got == [["p0"], ["p1"], ["p2", "p3"], ["p4"]]  # a large parameter is a batch of its own
