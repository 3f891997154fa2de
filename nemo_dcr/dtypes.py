"""The element dtypes nemo_dcr carries: one table, one frozen record per dtype.

Every other module asks this one for a dtype's wire code, bit width, the unsigned integer
dtype that carries its bits, its torch dtype, its safetensors tag or its exponent field;
none keeps a table of its own (``tests/test_dtypes.py`` checks both the facts and that).

The wire codes are those of ``docs/wire-format.md`` ("Dtypes") and are append-only: a code,
once published, never changes meaning.  Names are the torch names without ``torch.``.

This module sits on the package floor: it imports numpy and ``nemo_dcr.errors`` only.  The
torch dtypes are resolved on first use, so the codec (which never imports torch) can use
the table without pulling torch in.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from nemo_dcr.errors import ValidationError

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class DType:
    """One element dtype the wire format carries.

    ``exponent`` is ``(shift, bits)`` of the IEEE-style exponent field within the bit
    pattern (the MODEL and BUCKET coders bucket elements by it); ``None`` for integers.
    """

    name: str
    """Torch name without the ``torch.`` prefix; also the name in chunks and manifests."""
    code: int
    """Wire code (a chunk directory entry's ``dtype`` byte)."""
    bits: np.dtype
    """Unsigned numpy integer dtype of the same width: what values travel as."""
    safetensors: str
    """The dtype tag of a safetensors header (``"BF16"``)."""
    exponent: tuple[int, int] | None = None
    """``(shift, bits)`` of the exponent field, for floats."""

    def __post_init__(self) -> None:
        bits = np.dtype(self.bits)
        if bits.kind != "u":
            raise ValidationError(f"{self.name}: bits dtype {bits} is not an unsigned integer")
        object.__setattr__(self, "bits", bits)
        if not 1 <= self.code <= 255:
            raise ValidationError(f"{self.name}: wire code {self.code} does not fit a u8")
        if self.exponent is not None:
            shift, ebits = self.exponent
            if not (0 < ebits and 0 <= shift and shift + ebits < 8 * bits.itemsize):
                raise ValidationError(f"{self.name}: exponent field {self.exponent} outside the sign bit")

    @property
    def width(self) -> int:
        """Bytes per element."""
        return self.bits.itemsize

    @property
    def is_float(self) -> bool:
        return self.exponent is not None

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype (imports torch on first use)."""
        import torch

        return getattr(torch, self.name)


def _u(width: int) -> np.dtype:
    return np.dtype(f"u{width}")


#: Every dtype the wire format carries, in wire-code order (docs/wire-format.md).
_ALL = (
    DType("bfloat16", 1, _u(2), "BF16", (7, 8)),
    DType("float16", 2, _u(2), "F16", (10, 5)),
    DType("float32", 3, _u(4), "F32", (23, 8)),
    DType("float8_e4m3fn", 4, _u(1), "F8_E4M3", (3, 4)),
    DType("float8_e5m2", 5, _u(1), "F8_E5M2", (2, 5)),
    DType("int8", 6, _u(1), "I8"),
    DType("uint8", 7, _u(1), "U8"),
    DType("int16", 8, _u(2), "I16"),
    DType("int32", 9, _u(4), "I32"),
    DType("int64", 10, _u(8), "I64"),
    DType("bool", 11, _u(1), "BOOL"),
)

#: The table, by name.
DTYPES: Mapping[str, DType] = MappingProxyType({d.name: d for d in _ALL})
_BY_CODE: Mapping[int, DType] = MappingProxyType({d.code: d for d in _ALL})
_BY_TAG: Mapping[str, DType] = MappingProxyType({d.safetensors: d for d in _ALL})
assert len(_BY_CODE) == len(_BY_TAG) == len(DTYPES) == len(_ALL)

#: Name -> bits dtype, the view older code indexes (``BITS_DTYPE["bfloat16"]``).
BITS_DTYPE: Mapping[str, np.dtype] = MappingProxyType({d.name: d.bits for d in _ALL})

#: Element widths (bytes) any table entry has; bit views exist for exactly these.
WIDTHS: frozenset[int] = frozenset(d.width for d in _ALL)


def get(name: str) -> DType:
    """The dtype called ``name``; ``ValidationError`` if the wire format does not carry it."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValidationError(f"dtype {name!r} is not one the wire format carries") from None


def from_code(code: int) -> DType | None:
    """The dtype of a wire code, or None for a code this version does not know."""
    return _BY_CODE.get(code)


def from_safetensors(tag: str) -> DType:
    """The dtype of a safetensors header tag (``"BF16"``)."""
    try:
        return _BY_TAG[tag]
    except (KeyError, TypeError):
        raise ValidationError(f"safetensors dtype {tag!r} is not one the wire format carries") from None


def from_torch(dtype: Any) -> DType:
    """The dtype of a torch dtype (``torch.bfloat16``)."""
    name = str(dtype).removeprefix("torch.")
    d = DTYPES.get(name)
    if d is None or d.torch != dtype:
        raise ValidationError(f"{dtype} is not a dtype the wire format carries")
    return d


def bits_of_width(width: int) -> np.dtype:
    """Unsigned numpy dtype carrying ``width``-byte elements."""
    if width not in WIDTHS:
        raise ValidationError(f"no bit view for {width}-byte elements")
    return _u(width)


def torch_int_of_width(width: int) -> torch.dtype:
    """Integer torch dtype of ``width`` bytes for device-side bit views: signed for 2, 4 and
    8 bytes (torch's unsigned 16/32/64-bit types lack most kernels), ``uint8`` for 1.
    Never used for arithmetic on values, only for views, copies and bitwise ops."""
    import torch

    if width not in WIDTHS:
        raise ValidationError(f"no bit view for {width}-byte elements")
    return torch.uint8 if width == 1 else getattr(torch, f"int{8 * width}")


def torch_int_np(width: int) -> np.dtype:
    """numpy twin of ``torch_int_of_width`` (``int_view(t).numpy()`` has this dtype), to copy
    wire bits into a torch bit view without a cast."""
    if width not in WIDTHS:
        raise ValidationError(f"no bit view for {width}-byte elements")
    return np.dtype("u1") if width == 1 else np.dtype(f"i{width}")


def int_view(x):
    """Same-width integer view of a tensor or an array (no copy); bit operations on it are
    exact.  A torch tensor gets ``torch_int_of_width`` (any strides), a numpy array its
    unsigned ``bits`` dtype (its last axis must be contiguous, as for any ``ndarray.view``)."""
    if isinstance(x, np.ndarray):
        return x.view(bits_of_width(x.dtype.itemsize))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.view(torch_int_of_width(x.element_size()))
    raise ValidationError(f"int_view needs a torch tensor or a numpy array, got {type(x).__name__}")
