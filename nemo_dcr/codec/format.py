"""Wire format v1 of a delta chunk: constants, binary layouts, limits and the error type.

The normative description is ``docs/wire-format.md``; this module is its executable form.
Everything is little-endian and fixed-width; no pickle, no eval, no torch.load.

    chunk     = header meta directory payloads trailer
    header    = magic[8] version:u16 flags:u16 n_records:u32 meta_len:u32 dir_len:u32
                dir_raw_len:u32 payloads_len:u64 total_len:u64 header_crc:u32        (48 bytes)
    meta      = meta_body[meta_len] meta_crc:u32
    directory = zstd(entry * n_records)[dir_len] dir_crc:u32      (dir_raw_len bytes inflated)
    entry     = fixed[44] name[name_len] shape:u64[ndim]
    payloads  = payload * n_records (each entry's payload_len bytes, in order) payloads_crc:u32
    trailer   = chunk_crc:u32 end_magic[4]

CRCs are zlib's crc32.  ``chunk_crc`` covers every byte before it; each entry carries the
CRC of its decoded content (positions, values), which also catches a context-mode record
decoded against the wrong base.  A manifest names a chunk by the sha256 of all of its
bytes (``chunk_digest``).  The directory is zstd-compressed because per-record framing
(canonical names share long prefixes) would otherwise cost several percent of a sparse
delta.
"""
from __future__ import annotations

import enum
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np

from nemo_dcr import dtypes
from nemo_dcr.codec.types import DeltaOp
from nemo_dcr.errors import FormatError, ValidationError

MAGIC = b"NEMODCR\x00"
END_MAGIC = b"DCR\x00"
FORMAT_VERSION = 1

HEADER = struct.Struct("<8sHHIIIIQQI")
TRAILER = struct.Struct("<I4s")
#: name_len, dtype code, op, ndim, coding, flags, param, range_lo, range_hi, nnz,
#: payload_len, content_crc
ENTRY_FIXED = struct.Struct("<HBBBBBBQQQQI")
U32 = struct.Struct("<I")
DIR_ZSTD_LEVEL = 19
#: Directories up to DIR_ZSTD_SMALL raw bytes (a few records) are compressed at
#: ``DIR_ZSTD_LEVEL``; up to ``DIR_ZSTD_FAST_ABOVE`` (a model's worth of tensors) at
#: ``DIR_ZSTD_MID_LEVEL``: a 6.6 KB directory (69 records) took 2.1 ms at level 19 and 0.19 ms
#: at 9, for 51 more bytes (955 against 1006) in a 283 KB chunk; larger ones (thousands of small
#: records, e.g. the experts of an MoE layer) at ``DIR_ZSTD_FAST_LEVEL``: at level 19, zstd took
#: half of such a chunk's encode time, for 1.6% fewer chunk bytes.  Any level decodes the same.
DIR_ZSTD_SMALL = 2 << 10
DIR_ZSTD_MID_LEVEL = 9
DIR_ZSTD_FAST_ABOVE = 16 << 10
DIR_ZSTD_FAST_LEVEL = 3


def dir_zstd_level(raw_len: int) -> int:
    """The zstd level an encoder compresses a directory of ``raw_len`` bytes at."""
    if raw_len <= DIR_ZSTD_SMALL:
        return DIR_ZSTD_LEVEL
    return DIR_ZSTD_MID_LEVEL if raw_len <= DIR_ZSTD_FAST_ABOVE else DIR_ZSTD_FAST_LEVEL

#: Record flag: the payload was coded in context mode; decoding needs the base bits.
FLAG_CONTEXT = 0x01
RECORD_FLAGS_KNOWN = FLAG_CONTEXT

#: Wire code of each dtype, and back (views of ``nemo_dcr.dtypes``, where the codes live).
#: Append only: a code, once published, never changes meaning.
DTYPE_CODES: dict[str, int] = {d.name: d.code for d in dtypes.DTYPES.values()}
DTYPE_NAMES: dict[int, str] = {d.code: d.name for d in dtypes.DTYPES.values()}

OP_CODES = {DeltaOp.XOR: 0, DeltaOp.OVERWRITE: 1}
OP_FROM_CODE = {v: k for k, v in OP_CODES.items()}


class Coding(enum.IntEnum):
    """How a record's payload represents its positions and values."""

    DENSE_RAW = 0
    """``range_len`` raw elements: the XOR mask over the range (zeros where unchanged), or
    for an overwrite that covers every element of its range, the new values."""
    SPARSE_RAW = 1
    """``nnz`` u64 absolute positions, then ``nnz`` raw values."""
    SPARSE_ZSTD = 2
    """A zstd frame of ``nnz`` gap-minus-one integers (u32, or u64 if the range exceeds
    2**32 elements) followed by ``nnz`` raw values."""
    MODEL = 3
    """Adaptive binary range coding with the context models of ``codec/csrc/ans.c``: one
    binary decision per element in context mode (the v1 default until BUCKET)."""
    BUCKET = 4
    """Gaps between ranks within base-exponent buckets and bucket-conditioned values, coded
    by adaptive interleaved rANS (``codec/csrc/rans.c``): work per changed element plus one
    vectorised pass over the base."""
    LANES = 5
    """BUCKET's modelling with static per-record frequency tables and 16 interleaved rANS
    lanes (``codec/csrc/lanes.c``): no adaptive state, nothing shared between records, and a
    decoder that runs 8 lanes per AVX2 vector."""


#: Codings whose records may be in context mode (``FLAG_CONTEXT``); their context-mode ranges
#: count against ``ChunkLimits.max_scan_elements`` and a ``DecodeBudget``'s ``max_scan``.
CONTEXT_CODINGS = frozenset({Coding.MODEL, Coding.BUCKET, Coding.LANES})


class ChunkFormatError(FormatError):
    """The bytes are not a valid v1 chunk (corrupt, truncated, hostile or over a limit)."""


class ContentMismatchError(ChunkFormatError):
    """A record decoded to content whose checksum differs from the one the encoder stored:
    the payload is corrupt or, for a context-mode record, the base is not the encoder's."""


class BaseMismatchError(ChunkFormatError):
    """A context-mode record names a tensor whose dtype or size differs from the base array
    given for it: the chunk was not made against this base (or is corrupt)."""


class MissingBaseError(ChunkFormatError):
    """A context-mode record was decoded without base bits for its tensor: either the caller
    did not pass them or the chunk names a tensor the caller does not hold.  A subclass of
    ChunkFormatError so that every way a chunk can fail to decode is one exception type."""


def c_decode(coding: str, decode, *args) -> None:
    """``decode(*args)``, a C extension's decoder (``_cans``, ``_crans``): the ``ValueError``
    it raises on a payload that does not decode for its record is the chunk's
    :class:`ChunkFormatError` (``<coding> payload: <reason>``).  The one place that turns
    the extensions' ``ValueError`` into the library's error."""
    try:
        decode(*args)
    except ValueError as e:
        raise ChunkFormatError(f"{coding} payload: {e}") from None


class ChunkValidationError(ValidationError):
    """A well-formed chunk that does not fit what decoding it was allowed: a record whose
    name, dtype or shape is not a tensor the caller expects, or a version's chunks declaring
    more than its ``DecodeBudget``.  Raised before any payload is decoded."""


@dataclass(frozen=True)
class ChunkLimits:
    """Upper bounds a decoder enforces before it allocates anything a chunk asks for."""

    max_chunk_bytes: int = 1 << 34
    """Largest chunk accepted at all."""
    max_records: int = 1 << 20
    """Records (tensor parts) per chunk."""
    max_name_bytes: int = 1024
    """UTF-8 bytes of one tensor name."""
    max_ndim: int = 16
    """Dimensions of one tensor."""
    max_numel: int = 1 << 40
    """Elements of one tensor."""
    max_meta_entries: int = 1024
    """Key/value pairs in the chunk's metadata."""
    max_meta_bytes: int = 1 << 20
    """Bytes of the metadata section."""
    max_directory_bytes: int = 1 << 26
    """Inflated bytes of the record directory."""
    max_decoded_bytes: int = 1 << 34
    """Total bytes of decoded positions (8 per entry) and values, summed over the chunk."""
    max_scan_elements: int = 1 << 33
    """Elements the context-mode decoders walk (range lengths of MODEL and context-mode BUCKET
    records), summed over the chunk: bounds decoding CPU time (~1 minute at the default),
    since a tiny payload can declare a huge range."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValidationError(f"ChunkLimits.{name} must be a non-negative int, got {v!r}")


def _crc_function():
    """zlib.crc32, or the native coder's equal one where it folds with PCLMULQDQ (~3.5x zlib's
    speed here: the content checksums cost a twelfth of a context-mode decode with zlib's)."""
    try:
        from nemo_dcr.codec import _crans
    except ImportError:
        return zlib.crc32
    return _crans.crc32 if hasattr(_crans, "crc32_clmul") and _crans.crc32_clmul() else zlib.crc32


_crc = _crc_function()


def crc32(*parts: bytes | bytearray | memoryview | np.ndarray) -> int:
    c = 0
    for p in parts:
        c = _crc(p, c)
    return c & 0xFFFFFFFF


_LITTLE = sys.byteorder == "little"


def content_crc(positions: np.ndarray, values: np.ndarray) -> int:
    """Checksum of a record's decoded content (int64 LE positions, then LE values)."""
    if (_LITTLE and positions.dtype == np.int64 and positions.flags.c_contiguous and values.flags.c_contiguous
            and values.dtype.byteorder != ">"):
        return crc32(positions, values)  # the decoders' arrays: no conversion
    return crc32(np.ascontiguousarray(positions, dtype="<i8"),
                 np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")))
