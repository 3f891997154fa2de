"""The relay's holdings and their accounting: :class:`Entry` (one object), :class:`Cache`."""
from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from nemo_dcr.errors import TransportError
from nemo_dcr.transport.relay.config import RelayConfig
from nemo_dcr.transport.relay.stats import RelayCounters
from nemo_dcr.transport.store.policy import one_line


class NotHeld(TransportError):
    """The upstream has no such object (answered ``404``)."""


class Overloaded(TransportError):
    """The request cannot be admitted under the memory cap right now (``503``)."""


class Entry:
    """One object the relay holds: bytes in memory (``data``) and/or a spool file (``path``).

    ``pins`` counts users that need it to stay (children being served, a flight handing
    it to its waiters, a spool write); nothing is released while pinned.  ``cached``:
    in the immutable cache; ``fresh``: a mutable object within its coalescing window.
    An entry in neither is released when its last pin goes."""

    __slots__ = ("key", "size", "tag", "version", "data", "path", "pins", "cached", "fresh", "served")

    def __init__(self, key: str, data: bytes, tag: str, version: int | None):
        self.key, self.size, self.tag, self.version = key, len(data), tag, version
        self.data: bytes | None = data
        self.path: str | None = None
        self.pins = 0
        self.cached = False
        self.fresh = False
        self.served = False  # asked for by a child at least once (a prefetch evicts only those)


class Cache:
    """What the relay holds: immutable objects (in memory and, with a spool, on disk) under
    the version cap, mutable ones and not-founds for their coalescing window, and the
    accounting that keeps both under ``max_memory_bytes`` / ``max_spool_bytes``.  Owned by
    the relay's event loop (no locks)."""

    def __init__(self, cfg: RelayConfig, counters: RelayCounters, log: Callable[[dict], None]):
        self.cfg, self.counters, self._log = cfg, counters, log
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # immutable objects, least recently used first
        self.versions: dict[int, set[str]] = {}
        self.fresh: dict[str, tuple[float, Entry | None]] = {}  # mutable objects and not-founds: (until, entry)
        self.used: dict[int, int] = {}  # version -> tick of the last child read (the window's LRU order)
        self.confirmed: set[int] = set()  # versions whose manifest or decision a child read
        self.admitted: list[int] = []  # the last 16 versions that entered the window, oldest first
        self.confirmed_log: list[int] = []  # the last 16 versions confirmed, oldest first
        self._tick = 0
        self.mem = self.reserved = self.spool = 0
        self.disk = ThreadPoolExecutor(4, thread_name_prefix="nemo-dcr-relay-spool")
        self.spool_root: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.freed: asyncio.Event | None = None  # set (and replaced) whenever memory may have been freed

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the relay's loop, at start: make the spool (``spool_dir``), if any."""
        self.loop, self.freed = loop, asyncio.Event()
        if self.cfg.spool_dir is not None:
            os.makedirs(self.cfg.spool_dir, exist_ok=True)
            self.spool_root = tempfile.mkdtemp(prefix="relay-spool-", dir=self.cfg.spool_dir)

    def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self.disk.shutdown(wait=False, cancel_futures=True)
        if self.spool_root is not None:
            shutil.rmtree(self.spool_root, ignore_errors=True)

    def drop_all(self) -> None:
        """Everything cached out (children being served keep their pinned copy)."""
        for e in list(self.entries.values()):
            self.uncache(e)
        self.versions.clear()
        self.used.clear()
        self.confirmed.clear()
        for key in list(self.fresh):
            self.unfresh(key)

    def keep_fresh(self, key: str, e: Entry | None, until: float) -> None:
        """``e`` (None: not found) is the answer about mutable ``key`` until ``until``."""
        if key in self.fresh:
            self.unfresh(key)
        if e is not None:
            e.fresh = True
        self.fresh[key] = (until, e)

    def peak(self) -> None:
        self.counters.memory_peak_bytes = max(self.counters.memory_peak_bytes, self.mem + self.reserved)
        self.counters.spool_peak_bytes = max(self.counters.spool_peak_bytes, self.spool)

    def reserve(self, n: int, *, prefetch: bool = False) -> bool:
        """Room for ``n`` more bytes in memory, making it by evicting unpinned cached
        objects (least recently used first: those on the spool only leave memory, the
        others are dropped).  A prefetch drops no object that no child has asked for yet
        (it would evict what it fetched ahead for another prefetch)."""
        cap = self.cfg.max_memory_bytes
        if n > cap:
            return False
        if self.mem + self.reserved + n > cap:
            for e in list(self.entries.values()):
                if self.mem + self.reserved + n <= cap:
                    break
                if e.data is None or e.pins or (prefetch and e.path is None and not e.served):
                    continue
                self.counters.memory_evictions += 1
                if e.path is not None:
                    e.data = None
                    self.mem -= e.size
                else:
                    self.uncache(e)
        if self.mem + self.reserved + n > cap:
            return False
        self.reserved += n
        self.peak()
        return True

    def reserve_spool(self, n: int, *, prefetch: bool = False) -> bool:
        """Room for ``n`` more bytes on the spool (least recently used out first; for a
        prefetched object, only objects a child has read)."""
        cap = self.cfg.max_spool_bytes
        if self.spool_root is None or n > cap:
            return False
        if self.spool + n > cap:
            for e in list(self.entries.values()):
                if self.spool + n <= cap:
                    break
                if e.path is None or e.pins or (prefetch and not e.served):
                    continue
                self.counters.spool_evictions += 1
                if e.data is not None:
                    self.unlink(e)
                else:
                    self.uncache(e)
        if self.spool + n > cap:
            return False
        self.spool += n
        self.peak()
        return True

    def unlink(self, e: Entry) -> None:
        if e.path is not None:
            try:
                os.unlink(e.path)
            except OSError:
                pass
            e.path = None
            self.spool -= e.size

    def uncache(self, e: Entry) -> None:
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if e.version is not None and e.version in self.versions:
            self.versions[e.version].discard(e.key)
        e.cached = False
        self.release(e)

    def unfresh(self, key: str) -> None:
        until, e = self.fresh.pop(key)
        if e is not None:
            e.fresh = False
            self.release(e)

    def release(self, e: Entry) -> None:
        """Free what an entry holds once nothing needs it."""
        if e.pins or e.cached or e.fresh:
            return
        if e.data is not None:
            e.data = None
            self.mem -= e.size
            self.pulse()
        self.unlink(e)

    def unpin(self, e: Entry) -> None:
        e.pins -= 1
        assert e.pins >= 0, e.key
        self.release(e)
        if e.pins == 0:
            self.pulse()  # freed, or evictable now

    def pulse(self) -> None:
        if self.freed is not None:
            self.freed.set()
            self.freed = asyncio.Event()

    async def admit(self, n: int, *, prefetch: bool) -> bool:
        """``reserve``, waiting up to ``admit_wait_s`` (not for a prefetch) for memory that
        fetches in flight or children being served free; never for more than the cap."""
        if self.reserve(n, prefetch=prefetch):
            return True
        if prefetch or n > self.cfg.max_memory_bytes:
            return False
        deadline = self.loop.time() + self.cfg.admit_wait_s
        while (left := deadline - self.loop.time()) > 0:
            try:
                await asyncio.wait_for(self.freed.wait(), left)
            except asyncio.TimeoutError:
                pass
            if self.reserve(n, prefetch=False):
                return True
        return False

    def insert(self, e: Entry, *, prefetch: bool = False) -> None:
        """Put a fetched immutable object in the cache (under the version cap), and start
        writing it to the spool."""
        v = e.version
        if v is not None and v not in self.versions:
            if len(self.versions) >= self.cfg.keep_versions:
                # out goes the version children read least recently (not the lowest number: a
                # key-less writer can plant v/99999999/... and have it read once), among the
                # unconfirmed ones first: a version is confirmed once a child read its
                # manifest or decision, which children read only as a signed HEAD.json or
                # manifest directs them.  So planted versions take at most one confirmed
                # version's slot, the least recently read, and then only replace each other.
                held = list(self.versions)
                pool = [n for n in held if n not in self.confirmed] or held
                self.drop_version(min(pool, key=lambda n: (self.used.get(n, 0), n)))
            self.versions[v] = set()
            self.used[v] = self.touch()
            self.admitted = (self.admitted + [v])[-16:]
            self._log({"relay": "version", "version": v, "held": sorted(self.versions)})
        if v is not None:
            self.versions[v].add(e.key)
        e.cached = True
        self.entries[e.key] = e
        if self.spool_root is not None and self.reserve_spool(e.size, prefetch=prefetch):
            e.pins += 1
            self.spawn(self.write_spool(e))

    def touch(self) -> int:
        self._tick += 1
        return self._tick

    def drop_version(self, v: int) -> None:
        self.used.pop(v, None)
        self.confirmed.discard(v)
        for key in self.versions.pop(v):
            e = self.entries.get(key)
            if e is not None:
                self.uncache(e)
        self.counters.versions_dropped += 1
        self._log({"relay": "version_dropped", "version": v})

    async def write_spool(self, e: Entry) -> None:
        path = os.path.join(self.spool_root, hashlib.sha256(e.key.encode()).hexdigest())
        try:
            await self.loop.run_in_executor(self.disk, write_file, path, e.data)
            e.path = path
            self.counters.spool_writes += 1
        except Exception as exc:  # noqa: BLE001 - the object stays in memory only
            self.spool -= e.size
            self._log({"relay": "spool_write_failed", "key": e.key, "error": one_line(exc)})
        finally:
            self.unpin(e)

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def read_by_child(self, e: Entry) -> None:
        """A child read ``e``: its version is the most recently read, and confirmed when
        ``e`` is the version's manifest or decision (``insert``)."""
        if e.version in self.used:
            self.used[e.version] = self.touch()
            if e.key.endswith(("/MANIFEST.json", "/DECISION.json")) and e.version not in self.confirmed:
                self.confirmed.add(e.version)
                self.confirmed_log = (self.confirmed_log + [e.version])[-16:]


def write_file(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
