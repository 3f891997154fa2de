"""Download, verify and decode a version's chunks on a pool of threads.

Each chunk is fetched, checked against its manifest entry (size, digest), its header
checked against the manifest (a chunk of another version is not even decoded) and decoded
against the held bits, on its own thread: the store client and the native coders release
the GIL, so downloads overlap decoding and chunks decode on every core.  Results come back
in manifest order; the first failing chunk (in manifest order) refuses the version, and
nothing has been written by then (decoding only returns arrays).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nemo_dcr.codec import (
    ChunkFormatError,
    ChunkValidationError,
    DecodeBudget,
    DecodedChunk,
    chunk_digest,
    decode_chunk,
    read_chunk_index,
)
from nemo_dcr.codec.types import BITS_DTYPE
from nemo_dcr.errors import FormatError, ProtocolError


class RefitRefused(ProtocolError):
    """A version this receiver will not apply; the message names the chunk and reason."""


@dataclass(frozen=True)
class Fetched:
    chunks: list[DecodedChunk]
    """In manifest order."""
    downloaded_at: float
    """``perf_counter`` when the last chunk had arrived."""
    done_at: float
    """``perf_counter`` when the last chunk was decoded."""
    decode_cpu_s: float
    """Seconds spent decoding, summed over threads."""
    decoded_param_bytes: int
    """Bytes of the parameter ranges the decoded records cover (numel x element size)."""

    @property
    def decode_gbps(self) -> float:
        """Decode throughput per thread, in GB/s of the parameters covered."""
        return self.decoded_param_bytes / self.decode_cpu_s / 1e9 if self.decode_cpu_s > 0 else 0.0


def fetch_chunks(store, refs: Sequence, *, held: Mapping, specs: Mapping, budget: DecodeBudget,
                 want: Mapping[str, str], threads: int) -> Fetched:
    """``refs``: the manifest's chunk entries (``key``, ``nbytes``, ``digest``); ``want``: the
    header metadata every chunk must carry; raises ``RefitRefused``."""

    def one(ref) -> tuple[DecodedChunk, float, float]:
        try:  # at most the signed size is read: a bigger object is refused by its size alone
            blob = store.get(ref.key, max_bytes=ref.nbytes)
        except KeyError as e:
            raise RefitRefused(f"chunk {ref.key}: missing from the store ({e})") from None
        except FormatError as e:  # ObjectTooLarge
            raise RefitRefused(f"chunk {ref.key}: {e}") from None
        arrived = time.perf_counter()
        if len(blob) != ref.nbytes:
            raise RefitRefused(f"chunk {ref.key}: {len(blob)} bytes, manifest says {ref.nbytes}")
        if chunk_digest(blob) != ref.digest:
            raise RefitRefused(f"chunk {ref.key}: digest mismatch (corrupt or tampered)")
        try:
            got = {k: read_chunk_index(blob, expect=specs).meta.get(k) for k in want}
            if got != dict(want):
                raise RefitRefused(f"chunk {ref.key}: header {got} disagrees with manifest {dict(want)}")
            t = time.perf_counter()
            chunk = decode_chunk(blob, base=held, expect=specs, budget=budget)
            spent = time.perf_counter() - t
        except (ChunkFormatError, ChunkValidationError) as e:
            raise RefitRefused(f"chunk {ref.key}: {e}") from None
        return chunk, arrived, spent

    if threads <= 1 or len(refs) <= 1:
        results = [one(ref) for ref in refs]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(refs)), thread_name_prefix="dcr-fetch") as pool:
            futures = [pool.submit(one, ref) for ref in refs]
            results = []
            try:
                for f in futures:
                    results.append(f.result())
            finally:
                for f in futures:
                    f.cancel()
    done = time.perf_counter()
    chunks = [r[0] for r in results]
    covered = sum((r.element_range[1] - r.element_range[0]) * BITS_DTYPE[r.dtype].itemsize
                  for c in chunks for r in c.records)
    return Fetched(chunks=chunks, downloaded_at=max((r[1] for r in results), default=done), done_at=done,
                   decode_cpu_s=sum(r[2] for r in results), decoded_param_bytes=covered)
