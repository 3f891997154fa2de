"""The unit every stage after the diff speaks: a delta for one canonical tensor.

A ``TensorDelta`` is expressed in *canonical* coordinates (the Hugging Face checkpoint
tensor named ``name``, flattened row-major).  It never refers to a training shard: the
layout stage has already projected shard-local positions into canonical ones.

Values are carried as the raw bit patterns of the tensor's dtype (``BITS_DTYPE``), never
as floats, so nothing on the path can round, canonicalise a NaN or flush a subnormal.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from nemo_dcr import dtypes
from nemo_dcr.errors import ValidationError

#: Element dtypes the wire format knows, mapped to the unsigned integer dtype that carries
#: their bits (a view of the one table, ``nemo_dcr.dtypes``).
BITS_DTYPE = dtypes.BITS_DTYPE


def shape_numel(shape: tuple[int, ...]) -> int:
    """Element count of a shape, in Python ints (no overflow for any real tensor)."""
    return math.prod(int(d) for d in shape)


class DeltaOp(enum.Enum):
    """How the receiver combines ``values`` with what it holds at ``positions``."""

    XOR = "xor"
    """``new_bits = old_bits ^ values``: valid where the placement copies bits unchanged."""
    OVERWRITE = "overwrite"
    """``new_bits = values``: idempotent; used for residual tensors, dense fallbacks and
    journal repairs (a retried XOR would undo itself, an overwrite cannot)."""


@dataclass(frozen=True, eq=False)
class TensorDelta:
    """Changes to one canonical tensor (or to a part of it, see ``element_range``).

    positions: sorted, unique int64 flat indices into the canonical tensor.
    values: ``BITS_DTYPE[dtype]`` array, same length as ``positions``.
    element_range: ``[start, stop)`` flat range bounding the positions (every position
        lies inside it); defaults to the whole tensor.  Several records (e.g. from several
        trainer ranks) may target the same tensor: their positions must be disjoint, their
        ranges may interleave (row-parallel shards split columns, so each rank's range
        spans nearly the whole tensor).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    op: DeltaOp
    positions: np.ndarray
    values: np.ndarray
    element_range: tuple[int, int] | None = field(default=None)
    #: Internal, for decoders whose positions are strictly increasing by construction (the
    #: native LANES decoder's: ranks from gaps >= 1, or a scan in range order): skips that
    #: one O(nnz) pass; every other check still runs.  Not a field.
    _ordered: InitVar[bool] = False

    def __post_init__(self, _ordered: bool = False) -> None:
        # Decoders build one of these per record (tens of thousands per MoE version): the
        # checks below are C-level calls where they can be, no generator per field.
        if self.dtype not in BITS_DTYPE:
            raise ValidationError(f"{self.name}: unsupported dtype {self.dtype!r}")
        shape = tuple(map(int, self.shape))
        if shape and min(shape) < 0:
            raise ValidationError(f"{self.name}: negative dimension in shape {self.shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.op, DeltaOp):
            object.__setattr__(self, "op", DeltaOp(self.op))
        pos = np.asarray(self.positions)
        val = np.asarray(self.values)
        if pos.ndim != 1 or val.ndim != 1 or pos.shape != val.shape:
            raise ValidationError(
                f"{self.name}: positions {pos.shape} and values {val.shape} must be 1-D and equal"
            )
        if pos.dtype != np.int64:
            raise ValidationError(f"{self.name}: positions must be int64, got {pos.dtype}")
        want = BITS_DTYPE[self.dtype]
        if val.dtype != want:
            raise ValidationError(f"{self.name}: values for {self.dtype} must be {want}, got {val.dtype}")
        numel = math.prod(shape)
        lo, hi = self.element_range if self.element_range is not None else (0, numel)
        if not (0 <= lo <= hi <= numel):
            raise ValidationError(f"{self.name}: element_range {(lo, hi)} outside [0, {numel}]")
        object.__setattr__(self, "element_range", (int(lo), int(hi)))
        if pos.size:
            if pos[0] < lo or pos[-1] >= hi:
                raise ValidationError(f"{self.name}: positions outside element_range {(lo, hi)}")
            if pos.size > 1 and not _ordered and not bool(np.all(pos[1:] > pos[:-1])):
                raise ValidationError(f"{self.name}: positions must be strictly increasing")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints (``__post_init__`` made them so): no overflow

    @property
    def nnz(self) -> int:
        return self.positions.size


def check_records(deltas: Sequence[TensorDelta]) -> None:
    """Every record's own invariants (those ``TensorDelta.__post_init__`` establishes),
    checked again for records that may not have run their constructor (unpickled in
    another process, altered with ``object.__setattr__``); raises ``ValidationError`` naming
    the first bad record.

    One batch at once: per record only its fields are checked in Python; "positions
    strictly increasing, inside ``element_range``" is a few numpy passes over the
    concatenated positions.  A version of an MoE model has tens of thousands of small
    records, and per-record numpy calls were most of its validation.  Stricter than the
    constructor in one way: fields must already have the constructor's normal form (a
    tuple of ints for ``shape``, ints for ``element_range``), not be convertible to it."""
    kept: list[int] = []
    arrays: list[np.ndarray] = []
    bounds: list[tuple[int, int]] = []
    for i, d in enumerate(deltas):
        name = d.name
        if d.dtype not in BITS_DTYPE:
            raise ValidationError(f"{name}: unsupported dtype {d.dtype!r}")
        shape = d.shape
        if type(shape) is not tuple or not all(type(s) is int and s >= 0 for s in shape):
            raise ValidationError(f"{name}: shape {shape!r} is not a tuple of non-negative ints")
        if not isinstance(d.op, DeltaOp):
            raise ValidationError(f"{name}: op {d.op!r} is not a DeltaOp")
        pos, val = d.positions, d.values
        if not (isinstance(pos, np.ndarray) and isinstance(val, np.ndarray)):
            raise ValidationError(f"{name}: positions and values must be numpy arrays")
        if pos.ndim != 1 or val.ndim != 1 or pos.shape != val.shape:
            raise ValidationError(f"{name}: positions {pos.shape} and values {val.shape} must be 1-D and equal")
        if pos.dtype != np.int64:
            raise ValidationError(f"{name}: positions must be int64, got {pos.dtype}")
        if val.dtype != BITS_DTYPE[d.dtype]:
            raise ValidationError(f"{name}: values for {d.dtype} must be {BITS_DTYPE[d.dtype]}, got {val.dtype}")
        numel = math.prod(shape)
        er = d.element_range
        lo, hi = (0, numel) if er is None else er
        if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= numel:
            raise ValidationError(f"{name}: element_range {er!r} outside [0, {numel}]")
        if pos.size:
            kept.append(i)
            arrays.append(pos)
            bounds.append((lo, hi))
    if not kept:
        return
    flat = np.concatenate(arrays)
    ends = np.cumsum([a.size for a in arrays])
    starts = ends - np.array([a.size for a in arrays])
    lo_hi = np.array(bounds, dtype=np.int64)
    outside = (flat[starts] < lo_hi[:, 0]) | (flat[ends - 1] >= lo_hi[:, 1])
    if outside.any():
        d = deltas[kept[int(np.argmax(outside))]]
        raise ValidationError(f"{d.name}: positions outside element_range {d.element_range}")
    rising = flat[1:] > flat[:-1]
    rising[ends[:-1] - 1] = True  # from one record's last position to the next record's first
    if not rising.all():
        d = deltas[kept[int(np.searchsorted(ends, int(np.argmin(rising)), side="right"))]]
        raise ValidationError(f"{d.name}: positions must be strictly increasing")
