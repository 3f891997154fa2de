"""Admission of untrusted chunks: what a receiver checks before it decodes any payload.

A chunk's directory states, per record, a tensor (name, dtype, shape), an element range, a
count of entries (``nnz``) and a payload length.  Decoding allocates ``nnz * (8 + width)``
bytes and walks context-mode ranges, so a few hundred hostile bytes can claim gigabytes.
``decode_chunk(..., expect=..., budget=...)`` therefore checks, from the directory alone:

* every record names a tensor the receiver holds, with its dtype and shape
  (``check_expected``): ``range_hi <= numel`` and ``nnz <= range_hi - range_lo`` then bound
  each record by a real tensor, not by the chunk's claim;
* the payload can hold what the record declares (``payload.check_payload_size``);
* the version's chunks together stay within a ``DecodeBudget``: the sum of declared ``nnz``
  at most the elements of the tensors a version may change (a version names each element
  at most once), the sum of context-mode MODEL and BUCKET ranges at most a multiple of that.

So the memory a chunk can make a receiver allocate before refusal is proportional to its
header; what an admitted version decodes is bounded by the state it may change.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nemo_dcr.codec.format import CONTEXT_CODINGS, ChunkValidationError
from nemo_dcr.codec.types import BITS_DTYPE, shape_numel
from nemo_dcr.errors import ValidationError, WrongTypeError

if TYPE_CHECKING:
    from nemo_dcr.codec.chunk import RecordInfo

#: Default ``scan_factor`` of ``DecodeBudget.for_tensors``.  The context-mode decoder walks
#: a record's whole range; records of one tensor from several trainer ranks may interleave
#: (a row-parallel split gives each tensor-parallel rank a range spanning nearly the whole
#: tensor), so an honest version walks up to (ranks per tensor) x numel.  16 covers
#: tensor parallelism up to 16.
DEFAULT_SCAN_FACTOR = 16


def expected_spec(name: str, spec: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of one ``expect`` value: a ``(dtype, shape)`` pair, or any object with
    ``dtype`` (a ``BITS_DTYPE`` name) and ``shape`` attributes, such as a runtime's
    ``TensorSpec``."""
    if hasattr(spec, "dtype") and hasattr(spec, "shape"):
        dtype, shape = spec.dtype, spec.shape
    else:
        try:
            dtype, shape = spec
        except (TypeError, ValueError):
            raise WrongTypeError(f"expect[{name!r}] must be (dtype, shape), got {spec!r}") from None
    dtype = str(dtype)
    if dtype not in BITS_DTYPE:
        raise ValidationError(f"expect[{name!r}]: dtype {dtype!r} is not one the wire format carries")
    return dtype, tuple(int(s) for s in shape)


def check_expected(records: Iterable[RecordInfo], expect: Mapping[str, Any]) -> None:
    """Every record names a tensor of ``expect`` with its dtype and shape; raises
    ``ChunkValidationError`` naming the record and the field otherwise."""
    for r in records:
        if r.name not in expect:
            raise ChunkValidationError(f"record {r.name!r}: name is not one of the {len(expect)} expected tensors")
        dtype, shape = expected_spec(r.name, expect[r.name])
        if r.dtype != dtype:
            raise ChunkValidationError(f"record {r.name!r}: dtype {r.dtype}, expected {dtype}")
        if r.shape != shape:
            raise ChunkValidationError(f"record {r.name!r}: shape {list(r.shape)}, expected {list(shape)}")


def _scan_len(r: RecordInfo) -> int:
    """Elements the decoder walks for a record: its range in context mode (one present flag
    per element); context-free records are gap-coded, so their work is per entry."""
    lo, hi = r.element_range
    return hi - lo if (r.context and r.coding in CONTEXT_CODINGS) else 0


class DecodeBudget:
    """What the chunks of one version may make a receiver decode, shared by all of them.

    ``decode_chunk(..., budget=b)`` charges every record of a chunk before it decodes any
    payload: declared ``nnz`` against ``max_changed``, context-mode MODEL/BUCKET ranges against
    ``max_scan``.  A chunk that would overdraw either is refused whole and charges
    nothing (``ChunkValidationError``).  Create one per version; safe to share between threads.
    Records of several chunks naming the same elements are the apply engine's to refuse;
    this only bounds their sum.
    """

    def __init__(self, max_changed: int, max_scan: int | None = None) -> None:
        if not isinstance(max_changed, int) or max_changed < 0:
            raise ValidationError(f"max_changed must be a non-negative int, got {max_changed!r}")
        if max_scan is None:
            max_scan = DEFAULT_SCAN_FACTOR * max_changed
        if not isinstance(max_scan, int) or max_scan < 0:
            raise ValidationError(f"max_scan must be a non-negative int, got {max_scan!r}")
        self.max_changed = max_changed
        """Declared entries (``nnz``) summed over every record of the version."""
        self.max_scan = max_scan
        """Range elements of context-mode MODEL and BUCKET records summed over the version."""
        self._changed = 0
        self._scanned = 0
        self._lock = threading.Lock()

    @classmethod
    def for_tensors(cls, expect: Mapping[str, Any], *, scan_factor: int = DEFAULT_SCAN_FACTOR) -> DecodeBudget:
        """The budget of a version that may change the tensors of ``expect`` (the
        ``decode_chunk`` mapping): each element at most once, so ``max_changed`` is their
        total element count, and ``max_scan`` is ``scan_factor`` times that."""
        total = sum(shape_numel(expected_spec(n, s)[1]) for n, s in expect.items())
        return cls(total, scan_factor * total)

    @property
    def changed(self) -> int:
        """Entries charged so far."""
        return self._changed

    @property
    def scanned(self) -> int:
        """Context-mode range elements charged so far."""
        return self._scanned

    def charge(self, records: Sequence[RecordInfo]) -> None:
        """Charge one chunk's records, all or nothing."""
        with self._lock:
            changed, scanned = self._changed, self._scanned
            for r in records:
                changed += r.nnz
                if changed > self.max_changed:
                    raise ChunkValidationError(
                        f"record {r.name!r}: nnz {r.nnz} brings the version's declared entries to {changed}, "
                        f"over its budget of {self.max_changed}")
                scanned += _scan_len(r)
                if scanned > self.max_scan:
                    lo, hi = r.element_range
                    raise ChunkValidationError(
                        f"record {r.name!r}: context range [{lo}, {hi}) brings the version's scanned elements "
                        f"to {scanned}, over its budget of {self.max_scan}")
            self._changed, self._scanned = changed, scanned
