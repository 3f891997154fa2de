"""What one record's payload is about: :class:`RecordSpec` (the record header but the payload)."""
from __future__ import annotations

from dataclasses import dataclass

from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp
from nemo_dcr.errors import ValidationError


@dataclass(frozen=True)
class RecordSpec:
    """What a payload is about (everything in the record header except the payload)."""

    dtype: str
    shape: tuple[int, ...]
    op: DeltaOp
    lo: int
    hi: int
    nnz: int
    param: int = 0
    """Coding parameter from the directory entry (MODEL, BUCKET: e_lo; others: 0)."""

    def __post_init__(self) -> None:
        if self.dtype not in BITS_DTYPE:
            raise ValidationError(f"unsupported dtype {self.dtype!r}")
        if not (0 <= self.lo <= self.hi) or not (0 <= self.nnz <= self.hi - self.lo):
            raise ValidationError(f"inconsistent record: range [{self.lo}, {self.hi}), {self.nnz} entries")
        if not 0 <= self.param <= 255:
            raise ValidationError(f"coding parameter {self.param} outside u8")

    @property
    def width(self) -> int:
        return BITS_DTYPE[self.dtype].itemsize

    @property
    def range_len(self) -> int:
        return self.hi - self.lo
