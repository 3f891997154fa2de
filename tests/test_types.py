import numpy as np
import pytest

from nemo_dcr.codec.types import DeltaOp, TensorDelta


def _delta(pos, vals, **kw):
    return TensorDelta(
        name="w", dtype="bfloat16", shape=(4, 4), op=DeltaOp.XOR,
        positions=np.asarray(pos, dtype=np.int64), values=np.asarray(vals, dtype=np.uint16), **kw,
    )


def test_valid_delta_roundtrips_fields():
    d = _delta([1, 5, 15], [1, 2, 3])
    assert d.nnz == 3 and d.numel == 16 and d.element_range == (0, 16)


@pytest.mark.parametrize(
    "pos,vals,kw",
    [
        ([5, 1], [1, 2], {}),  # unsorted
        ([1, 1], [1, 2], {}),  # duplicate
        ([16], [1], {}),  # out of tensor
        ([3], [1], {"element_range": (4, 8)}),  # outside its range
        ([1, 2], [1], {}),  # length mismatch
    ],
)
def test_inconsistent_delta_is_rejected(pos, vals, kw):
    with pytest.raises(ValueError):
        _delta(pos, vals, **kw)


def test_values_must_carry_bits_not_floats():
    with pytest.raises(ValueError):
        TensorDelta(name="w", dtype="bfloat16", shape=(2,), op="xor",
                    positions=np.array([0], np.int64), values=np.array([1.0], np.float32))
