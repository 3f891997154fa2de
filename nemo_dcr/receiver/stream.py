"""Streaming receive: fetch and decode the chunks of the next version as they land in the
store, before its signed manifest exists, so the receiver's download runs alongside the
trainer's upload instead of after it.

While the follower is idle (nothing awaiting a decision, no tentative version, ``HEAD.json``
naming nothing new), each of its steps calls ``Receiver.prefetch``, which polls one
``StreamState``: it lists ``v/<n>/chunks/`` for the candidate versions ``n`` and submits
every chunk key it has not seen to the state's own pool of ``threads`` workers, which
download it, check its header (run id, model id, the version its key names,
``base_version`` = the version the receiver holds) and decode it against the held bits.
Nothing here is trusted or applied:

* the raw bytes prefetched for one held version are capped at ``fetch.admission_cap``
  (the bound a manifest's chunk bytes must meet: 2 x the dense size of the receiver's
  tensors + 1 MiB), each object's size is read from the listing (``list_sizes``: S3's
  listing carries sizes, and so does a relay's, so a chunk costs one ``GET``; a key
  listed without a size, by a store whose listing has none, costs a ``stat``) and reserved
  against the cap before it is downloaded, at most that many bytes are read, and the
  records decoded are charged to a ``DecodeBudget.for_tensors`` of their own; over the cap
  no new download starts, over the budget nothing more is decoded, for this held version
  (the normal path fetches what is missing once the manifest is there);
* when the manifest arrives, ``take`` waits for the listed chunks already started,
  cancels the listed ones still queued (the normal path fetches them at once, on its own
  threads), and hands over only the prefetched chunks whose key is listed with the same
  size and sha256 digest and whose header agrees with the manifest; ``fetch_chunks``
  charges their records to the version's own budget and fetches every other chunk
  normally; prefetched chunks the manifest does not list are dropped, and the whole state
  is closed with every ``take`` (one manifest consumes it) and before every write of the
  held bits (apply, rollback, catch-up, repair: ``Receiver`` also compares its write
  generation and held version).

The chunks run ahead of the follower: its step only lists and submits, so a manifest is
noticed at the next step whatever is in flight.  A decode reads the held bits, which apply
and rollback overwrite in place; ``close`` therefore marks the state closed (no decode
starts after it) and waits for the decodes running, and the receiver closes the state
before every write: a decode never overlaps a write, and nothing decoded against older
bits is used.  A download running at ``close`` finishes on its thread and is dropped.

Downloads here are plain ``get`` s, not ``fetch_verified``: before the manifest there is no
digest to check, and demoting an upstream on unsigned evidence (a header or an object a
key-less store writer planted at the origin, which every faithful relay would pass on)
would let that writer push receivers off their relays.  The bytes are checked against the
signed digest at ``take``; a mismatch is fetched again through ``fetch_verified``, which
demotes an upstream that serves bad bytes then.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from nemo_dcr.codec import DecodeBudget, DecodedChunk, chunk_digest, decode_chunk, read_chunk_index
from nemo_dcr.errors import DcrError, ValidationError
from nemo_dcr.protocol.manifest import Manifest, version_prefix
from nemo_dcr.receiver.fetch import ChunkTimes, admission_cap
from nemo_dcr.receiver.held import HeldBits
from nemo_dcr.transport.store.base import list_sizes

MAX_STRIDE = 8
"""Candidate versions listed past the last handled one, at most (see ``candidates``)."""
MAX_KEYS = 16384
"""Chunk keys one state looks at, at most: a key-less writer planting empty objects under
``chunks/`` costs the receiver this many requests per held version, then prefetching stops."""
_CHUNK_NAME = re.compile(r"^r[0-9]{3,6}-[0-9]{5,9}\.dcr$")


@dataclass(frozen=True)
class Prefetched:
    """One chunk fetched and decoded before its manifest; unverified until ``take``."""

    key: str
    version: int
    """The version its key names (and its header, checked)."""
    nbytes: int
    digest: str
    """``chunk_digest`` of the bytes that were decoded."""
    chunk: DecodedChunk
    times: ChunkTimes


def candidates(handled: int, stride: int, top: int) -> list[int]:
    """Versions whose ``chunks/`` a receiver lists while idle: ``handled+1 .. handled+stride``
    (versions are optimizer step numbers; ``stride`` is the last gap between the versions it
    answered, 1 until it saw one), and as many past ``top``, the highest version it already
    saw chunks of (a version whose manifest never came is followed by the next one).  A
    stride over ``MAX_STRIDE`` lists the first ``MAX_STRIDE`` and ``handled+stride``; each
    candidate is one ``list`` call per idle poll."""
    stride = max(1, stride)
    near = min(stride, MAX_STRIDE)
    out = list(range(handled + 1, handled + near + 1))
    if stride > near:
        out.append(handled + stride)
    out += [v for v in range(top + 1, top + near + 1) if v > handled + near and v not in out]
    return out


class StreamState:
    """What one receiver prefetched on top of one held version (see the module docstring).
    ``poll``, ``take``, ``drain`` and ``close`` are called from the follower's thread; each
    chunk is downloaded and decoded on the state's own pool (``threads`` workers), and
    ``close`` returns only when no decode is running and none can start."""

    def __init__(self, served, *, run_id: str, model_id: str, base_version: int, generation: int, threads: int):
        self.specs = served.tensor_specs()
        self.held = HeldBits(served)
        """The bits prefetched records were decoded against; valid until the next write."""
        self.budget = DecodeBudget.for_tensors(self.specs)
        self.cap = admission_cap(self.specs)
        self.run_id, self.model_id = run_id, model_id
        self.base_version, self.generation = base_version, generation
        self.threads = max(1, threads)
        self.reserved = 0
        """Raw bytes downloaded (or being downloaded) by this state, kept or not."""
        self.seen: set[str] = set()
        self.ready: dict[str, Prefetched] = {}
        self.top = base_version
        self.listed_at: dict[int, list[float]] = {}
        """version -> [``time.monotonic()`` when a listing first showed one of its chunk keys,
        when one last showed a key not seen before]."""
        self.stopped: str | None = None
        """Why prefetching stopped for this held version (None: it goes on)."""
        self.rejected = 0
        """Chunks dropped at prefetch: malformed, another run, model, version or base."""
        self.failed = 0
        """Chunks the store did not serve (vanished, grew, a store error): left to the normal path."""
        self._lock = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        """key -> its download and decode (``_one``), submitted and not yet collected."""
        self._decoding = 0
        """Decodes running now (they read the held bits)."""
        self._closed = False
        self._over_budget = False

    def matches(self, *, run_id: str, base_version: int, generation: int) -> bool:
        return (self.run_id, self.base_version, self.generation) == (run_id, base_version, generation)

    @property
    def in_flight(self) -> int:
        """Chunks submitted and not yet collected by ``poll``, ``drain`` or ``take``."""
        return len(self._inflight)

    # ------------------------------------------------------------------ poll
    def poll(self, store, versions: Sequence[int]) -> int:
        """List ``versions``' chunk keys and submit the new ones to the state's pool; returns
        how many chunks were decoded since the last call.  Never waits for a chunk.  Store
        errors while listing propagate (``TransportError``); everything about one chunk is
        counted, never raised."""
        if not self.stopped:
            for v in versions:
                prefix = f"{version_prefix(v)}/chunks/"
                for key, size in list_sizes(store, prefix, limit=MAX_KEYS):
                    if key in self.seen or not key.startswith(prefix) or not _CHUNK_NAME.match(key[len(prefix):]):
                        continue
                    if len(self.seen) >= MAX_KEYS:
                        self.stopped = f"more than {MAX_KEYS} chunk keys on top of v{self.base_version}"
                        break
                    self.seen.add(key)
                    now = time.monotonic()
                    self.listed_at.setdefault(v, [now, now])[1] = now
                    self.top = max(self.top, v)
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="dcr-prefetch")
                    self._inflight[key] = self._pool.submit(self._one, store, v, key, size)
                if self.stopped:
                    break
        return self._collect([k for k, f in self._inflight.items() if f.done()])

    def drain(self) -> int:
        """Wait for every chunk submitted; returns how many were decoded since the last call."""
        wait(list(self._inflight.values()))
        return self._collect(list(self._inflight))

    def close(self) -> None:
        """Stop: no decode starts from now on, and this returns once the decodes running have
        ended (after it the held bits may be written).  Queued chunks are cancelled; a
        download running finishes on its thread and is dropped."""
        with self._lock:
            self._closed = True
            while self._decoding:
                self._lock.wait()
        self._inflight.clear()
        if self._pool is not None:  # every future in flight is the pool's: queued ones are cancelled here
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _collect(self, keys: Sequence[str]) -> int:
        return sum(bool(self._inflight.pop(k).result()) for k in keys)

    def _one(self, store, version: int, key: str, size: int | None) -> bool:
        """Download, check and decode one chunk, on a pool thread; True when it is ready."""
        started = time.perf_counter()
        try:
            if size is None:  # listed without a size
                info = store.stat(key)
                if info is None:  # vanished since it was listed
                    with self._lock:
                        self.failed += 1
                    return False
                size = info.size
            with self._lock:  # reserve before downloading: the cap holds whatever is in flight
                if self.stopped or self._closed:
                    return False
                if self.reserved + size > self.cap:
                    self.stopped = (f"prefetched chunk bytes would exceed {self.cap} (twice the dense size "
                                    f"of the tensors held, + 1 MiB)")
                    return False
                self.reserved += size
            blob = store.get(key, max_bytes=size)
        except DcrError:  # vanished (ObjectNotFound), over its listed size, store failed, refused by a failover list
            with self._lock:
                self.failed += 1
            return False
        arrived = time.perf_counter()
        try:
            index = read_chunk_index(blob, expect=self.specs)
            want = {"run_id": self.run_id, "model_id": self.model_id, "version": str(version),
                    "base_version": str(self.base_version)}
            if {k: index.meta.get(k) for k in want} != want:
                raise ValidationError("header names another run, model, version or base")
        except DcrError:
            with self._lock:
                self.rejected += 1
            return False
        with self._lock:
            if self._closed or self._over_budget:
                return False
            try:
                self.budget.charge(index.records)
            except ValidationError:
                self.stopped = "prefetched records would exceed the decode budget of the tensors held"
                self._over_budget = True
                return False
            self._decoding += 1  # from here until the decode ends, close() waits
        got = None
        try:
            t = time.perf_counter()
            chunk = decode_chunk(blob, base=self.held, expect=self.specs)
            got = Prefetched(key=key, version=version, nbytes=len(blob), digest=chunk_digest(blob), chunk=chunk,
                             times=ChunkTimes(started, arrived, time.perf_counter() - t))
        except DcrError:
            pass
        finally:
            with self._lock:
                self._decoding -= 1
                self._lock.notify_all()
                if got is None:
                    self.rejected += 1
                else:
                    self.ready[key] = got
        return got is not None

    # ------------------------------------------------------------------ take
    def take(self, manifest: Manifest, want: Mapping[str, str]) -> tuple[dict[str, Prefetched], dict]:
        """The prefetched chunks ``manifest`` may use (key -> ``Prefetched``): listed, with the
        entry's size and digest, and a header equal to ``want``.  Returns them and the
        stats for the ack; the caller closes this state afterwards.  A listed chunk still
        downloading is waited for if its download has started, and left to the normal path
        (``fetch_chunks``, on its own threads) if it has not."""
        listed = {ref.key: ref for ref in manifest.chunks}
        flying = [k for k in self._inflight if k in listed]
        queued = [k for k in flying if self._inflight[k].cancel()]
        for k in queued:
            del self._inflight[k]
        running = [k for k in flying if k not in queued]
        wait([self._inflight[k] for k in running])
        self._collect(running)
        with self._lock:  # an unlisted chunk may still be decoding into ``ready``
            mine = [p for p in self.ready.values() if p.version == manifest.version]
        use: dict[str, Prefetched] = {}
        unlisted = mismatched = 0
        for p in mine:
            ref = listed.get(p.key)
            if ref is None:
                unlisted += 1
            elif (ref.nbytes, ref.digest) == (p.nbytes, p.digest) and \
                    {k: p.chunk.meta.get(k) for k in want} == dict(want):
                use[p.key] = p
            else:
                mismatched += 1
        stats = {"prefetched_chunks": len(mine), "prefetched_bytes": sum(p.nbytes for p in mine),
                 "prefetch_unlisted": unlisted, "prefetch_mismatched": mismatched,
                 "prefetch_rejected": self.rejected, "prefetch_failed": self.failed,
                 "prefetch_awaited": len(running), "prefetch_not_started": len(queued)}
        if self.stopped:
            stats["prefetch_stopped"] = self.stopped
        if manifest.version in self.listed_at:
            stats["first_chunk_listed_at"], stats["last_chunk_listed_at"] = self.listed_at[manifest.version]
        self.ready.clear()
        return use, stats
