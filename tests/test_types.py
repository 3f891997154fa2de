import numpy as np
import pytest

from nemo_dcr.codec.types import DeltaOp, TensorDelta, check_records
from nemo_dcr.errors import ValidationError


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


def _rec(name, positions, numel=16, element_range=None):
    pos = np.array(positions, dtype=np.int64)
    return TensorDelta(name, "bfloat16", (numel,), DeltaOp.XOR, pos, np.ones(pos.size, np.uint16),
                       element_range=element_range)


def _altered(d, **fields):
    for k, v in fields.items():
        object.__setattr__(d, k, v)
    return d


def test_check_records_passes_a_batch_whose_records_fall_between_each_other():
    # record b's positions are below a's: the batch is not sorted, each record is

    check_records([_rec("a", [5, 9, 12]), _rec("b", [0, 3]), _rec("c", []), _rec("d", [15], element_range=(15, 16))])
    check_records([])


@pytest.mark.parametrize("bad,match", [
    (lambda: _altered(_rec("m", [1, 2, 7]), positions=np.array([1, 7, 2], np.int64)), "m: positions must be strictly"),
    (lambda: _altered(_rec("m", [1, 2, 7]), positions=np.array([1, 2, 2], np.int64)), "m: positions must be strictly"),
    (lambda: _altered(_rec("m", [4, 6], element_range=(4, 7)), positions=np.array([3, 6], np.int64)), "m: positions outside"),
    (lambda: _altered(_rec("m", [4, 6], element_range=(4, 7)), positions=np.array([4, 7], np.int64)), "m: positions outside"),
    (lambda: _altered(_rec("m", [1]), shape=[16]), "m: shape"),
    (lambda: _altered(_rec("m", [1]), op="xor"), "m: op"),
    (lambda: _altered(_rec("m", [1]), values=np.ones(1, np.float32)), "m: values"),
    (lambda: _altered(_rec("m", [1]), element_range=(0, 17)), "m: element_range"),
])
def test_check_records_names_the_bad_record_of_a_batch(bad, match):
    """Each corruption a constructor would refuse, in the middle record of three (the
    control: the same batch without it passes)."""

    check_records([_rec("a", [0, 8]), _rec("m", [1, 2, 7]), _rec("z", [3])])
    with pytest.raises(ValidationError, match=match):
        check_records([_rec("a", [0, 8]), bad(), _rec("z", [3])])
