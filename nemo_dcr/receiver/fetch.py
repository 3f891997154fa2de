"""Download, verify and decode a version's chunks on a pool of threads.

Each chunk is fetched, checked against its manifest entry (size, digest), its header
checked against the manifest (a chunk of another version is not even decoded) and decoded
against the held bits, on its own thread: the store client and the native coders release
the GIL, so downloads overlap decoding and chunks decode on every core.  Results come back
in manifest order; the first failing chunk (in manifest order) refuses the version, and
nothing has been written by then (decoding only returns arrays).

Downloads go through ``transport.failover.fetch_verified`` with the size and digest check:
on a store with several upstreams (relays), one that serves other bytes than the signed
manifest lists is demoted and the next one serves the chunk.  Chunks that streaming
receive (``receiver/stream.py``) already fetched and decoded before the manifest are
passed in ``prefetched``: one whose size and digest equal its entry's is used as it is
(its records still charged to the version's budget), any other is fetched here.
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
from nemo_dcr.transport.failover import VerificationFailed, fetch_verified


class RefitRefused(ProtocolError):
    """A version this receiver will not apply; the message names the chunk and reason."""


def admission_cap(specs: Mapping) -> int:
    """The most chunk bytes one version may make this receiver download: twice the dense
    size of the tensors it holds, plus 1 MiB (a manifest listing more is refused before
    any download; streaming receive stops prefetching at it)."""
    dense = sum(s.numel * BITS_DTYPE[s.dtype].itemsize for s in specs.values())
    return 2 * dense + (1 << 20)


@dataclass(frozen=True)
class ChunkTimes:
    """One chunk's download and decode, as ``perf_counter`` readings."""

    started: float
    """The download began."""
    arrived: float
    """Every byte had arrived."""
    decode_s: float
    """Seconds spent decoding it (on whichever thread)."""


@dataclass(frozen=True)
class Fetched:
    chunks: list[DecodedChunk]
    """In manifest order."""
    downloaded_at: float
    """``perf_counter`` when the last chunk had arrived."""
    done_at: float
    """``perf_counter`` when the last chunk was decoded."""
    decode_cpu_s: float
    """Seconds spent decoding, summed over threads (prefetched chunks included)."""
    decoded_param_bytes: int
    """Bytes of the parameter ranges the decoded records cover (numel x element size)."""
    download_busy_s: float = 0.0
    """Seconds during which at least one of the version's chunks was downloading, before or
    after the manifest (the union of every chunk's download interval)."""
    prefetched_chunks: int = 0
    """Chunks used as streaming receive had fetched and decoded them before the manifest."""
    prefetched_bytes: int = 0

    @property
    def decode_gbps(self) -> float:
        """Decode throughput per thread, in GB/s of the parameters covered."""
        return self.decoded_param_bytes / self.decode_cpu_s / 1e9 if self.decode_cpu_s > 0 else 0.0


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def fetch_chunks(store, refs: Sequence, *, held: Mapping, specs: Mapping, budget: DecodeBudget,
                 want: Mapping[str, str], threads: int, prefetched: Mapping | None = None) -> Fetched:
    """``refs``: the manifest's chunk entries (``key``, ``nbytes``, ``digest``); ``want``: the
    header metadata every chunk must carry; ``prefetched``: key -> ``stream.Prefetched``
    whose size, digest and header the caller matched to ``refs`` (``StreamState.take``);
    raises ``RefitRefused``."""
    prefetched = prefetched or {}

    def one(ref) -> tuple[DecodedChunk, ChunkTimes]:
        pre = prefetched.get(ref.key)
        if pre is not None:
            try:  # decoded against a budget of its own before the manifest: charged to the version's now
                budget.charge(pre.chunk.records)
            except ChunkValidationError as e:
                raise RefitRefused(f"chunk {ref.key}: {e}") from None
            return pre.chunk, pre.times

        reasons: list[str] = []

        def check(blob: bytes) -> str | None:
            if len(blob) != ref.nbytes:
                reasons.append(f"{len(blob)} bytes, manifest says {ref.nbytes}")
            elif chunk_digest(blob) != ref.digest:
                reasons.append("digest mismatch (corrupt or tampered)")
            else:
                return None
            return reasons[-1]

        started = time.perf_counter()
        try:  # at most the signed size is read: a bigger object is refused by its size alone
            blob = fetch_verified(store, ref.key, max_bytes=ref.nbytes, check=check)
        except KeyError as e:
            raise RefitRefused(f"chunk {ref.key}: missing from the store ({e})") from None
        except FormatError as e:  # ObjectTooLarge
            raise RefitRefused(f"chunk {ref.key}: {e}") from None
        except VerificationFailed as e:  # bytes other than the manifest's, from every upstream
            raise RefitRefused(f"chunk {ref.key}: {reasons[-1] if reasons else e}") from None
        arrived = time.perf_counter()
        try:
            meta = read_chunk_index(blob, expect=specs).meta  # once: it parses the whole directory
            got = {k: meta.get(k) for k in want}
            if got != dict(want):
                raise RefitRefused(f"chunk {ref.key}: header {got} disagrees with manifest {dict(want)}")
            t = time.perf_counter()
            chunk = decode_chunk(blob, base=held, expect=specs, budget=budget)
            spent = time.perf_counter() - t
        except (ChunkFormatError, ChunkValidationError) as e:
            raise RefitRefused(f"chunk {ref.key}: {e}") from None
        return chunk, ChunkTimes(started, arrived, spent)

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
    used = [prefetched[ref.key] for ref in refs if ref.key in prefetched]
    return Fetched(chunks=chunks, downloaded_at=max((t.arrived for _, t in results), default=done), done_at=done,
                   decode_cpu_s=sum(t.decode_s for _, t in results), decoded_param_bytes=covered,
                   download_busy_s=busy_seconds([(t.started, t.arrived) for _, t in results]),
                   prefetched_chunks=len(used), prefetched_bytes=sum(p.nbytes for p in used))

