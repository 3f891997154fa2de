"""Delta codec: v1 chunks of per-tensor records (wire format in ``docs/wire-format.md``).

Encode: ``encode_chunk(deltas, meta=..., base=...) -> bytes``.  Decode:
``decode_chunk(data, base=..., limits=..., expect=..., budget=...) -> DecodedChunk``
(returns arrays, writes nothing; ``expect`` and a per-version ``DecodeBudget`` admit an
untrusted chunk before any payload is decoded); ``stream_chunk`` admits the same way and
decodes one record at a time.  Apply: ``apply_delta_(bits, delta)``.
A manifest names a chunk by ``chunk_digest(data)``.
"""
from nemo_dcr.codec import bucket, lanes
from nemo_dcr.codec.admit import DecodeBudget
from nemo_dcr.codec.apply import apply_delta_
from nemo_dcr.codec.chunk import (
    ChunkStream,
    DecodedChunk,
    RecordInfo,
    StreamedRecord,
    chunk_digest,
    decode_chunk,
    read_chunk_index,
    stream_chunk,
)
from nemo_dcr.codec.encode import encode_chunk
from nemo_dcr.codec.format import (
    BaseMismatchError,
    ChunkFormatError,
    ChunkLimits,
    ChunkValidationError,
    Coding,
    ContentMismatchError,
    MissingBaseError,
)
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta

__all__ = [
    "BITS_DTYPE",
    "BaseMismatchError",
    "ChunkFormatError",
    "ChunkLimits",
    "ChunkStream",
    "ChunkValidationError",
    "Coding",
    "ContentMismatchError",
    "DecodeBudget",
    "DecodedChunk",
    "DeltaOp",
    "MissingBaseError",
    "RecordInfo",
    "StreamedRecord",
    "TensorDelta",
    "apply_delta_",
    "bucket",
    "lanes",
    "chunk_digest",
    "decode_chunk",
    "encode_chunk",
    "read_chunk_index",
    "stream_chunk",
]
