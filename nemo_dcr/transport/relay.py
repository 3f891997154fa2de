"""``nemo-dcr relay``: one node of the relay tree (``docs/relay.md``, HTTP API v1).

A relay serves the read side of ONE run's store to its children (receivers or other
relays) over HTTP, and reads each object from its own upstream (an ``ObjectStore``: the
origin directory or ``s3://`` prefix, another relay, or an ordered list of these, a
``FailoverStore``) at most once while it holds it.  It holds no key and checks nothing a
key would be needed for: children verify every byte against the signed manifest.

What it keeps (the caching rules of ``docs/relay.md``):

* **immutable keys** (``v/<n>/chunks/*``, ``v/<n>/MANIFEST.json``, ``v/<n>/DECISION.json``,
  ``init/*``, ``RUN.json``): cached once fetched, in memory and, with ``--spool``, written
  through to the spool directory, so that leaving memory costs nothing; least recently
  used first out of memory (and of the spool when it is full);
* **mutable keys** (``HEAD.json``, ``COMMITTED.json``, anything else), every "not found",
  every ``stat`` and every ``list``: kept only for the coalescing window, so children
  polling at once share one upstream request;
* **single flight**: concurrent requests for one key wait on one upstream call;
* **cut-through**: every chunk key (``v/<n>/chunks/*``) a ``list`` reveals is fetched at
  once, ``prefetch`` at a time, before any child asks for it (a child asking for one still
  queued starts it at once); a prefetch neither waits for memory nor evicts an object no
  child has read, so it stops at the caps instead of fetching twice;
* **bounds**: memory (objects held plus fetches in flight, each reserved at the size the
  upstream's ``stat`` gave before its body is read), spool bytes, and versions
  (``keep_versions``: more versions than that and the oldest ``v/<n>/`` is dropped).  A
  request that cannot be admitted under the memory cap is answered ``503``.

A slow child is served from the one shared copy in pieces through aiohttp's flow control
(``await response.write`` waits while the socket's buffers are full), so it costs the
relay a socket buffer, not a copy; a child that reads nothing for ``send_timeout_s`` is
disconnected, which unpins what it held.

Concurrency: one asyncio loop owns every table and counter below (no locks); blocking
upstream calls run in a bounded thread pool (``fetch_threads``).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

from nemo_dcr.errors import DcrError, FormatError, ProtocolError, TransportError, ValidationError
from nemo_dcr.transport.store import (
    ObjectInfo, ObjectNotFound, ObjectStore, ObjectTooLarge, StoreError, check_key, check_limit,
)

PROG = "nemo-dcr relay"
API = "/v1"
ACK_PREFIX = "acks/"
RUN_KEY = "RUN.json"  # the run record (protocol/manifest.py): what the cache is valid for
MAX_PUT_BYTES = 64 << 10
"""Largest object a relay writes through: an ack or a join request (a few hundred bytes to
a few KB; an ack's error is one line).  A bigger one is answered 413 and not forwarded:
written through a relay it would cost every hop up to the origin (direct writes are
bounded by the reader's ``DOC_LIMITS`` instead)."""
_PUT_KEY = re.compile(r"^acks/(?:[A-Za-z0-9_\-]{1,64}/[0-9]{8}\.json|join\.d/[A-Za-z0-9_\-]{1,64}\.json)$")
"""The keys a relay writes through: an ack (``acks/<receiver>/<v:08d>.json``) or a join
request (``acks/join.d/<receiver>.json``); anything else under ``acks/`` is 403."""
MAX_LIST_KEYS = 1 << 18
"""Most keys one ``list`` answer holds (a version's chunks are hundreds to a few thousand);
a longer listing (planted keys) is answered 413, and children read no longer one."""
_DRAIN_PUT_BYTES = 16 << 20
"""An oversized PUT body is read and dropped up to this much before the 413, so that the
client sees the answer rather than a reset connection."""

_IMMUTABLE = re.compile(r"^(?:v/(?P<v>[0-9]+)/(?:chunks/[^/]+|MANIFEST\.json|DECISION\.json)|init/.+|RUN\.json)$")
_CHUNK = re.compile(r"^v/(?P<v>[0-9]+)/chunks/[^/]+$")


def is_immutable(key: str) -> bool:
    return _IMMUTABLE.match(key) is not None


def key_version(key: str) -> int | None:
    m = _IMMUTABLE.match(key)
    return int(m["v"]) if m and m["v"] is not None else None


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """How much a relay holds and how it talks to its upstream and children."""

    max_memory_bytes: int = 1 << 30
    """Objects held in memory plus fetches in flight.  An object larger than this is never
    admitted (``503``): it must exceed the largest object children read (chunks,
    manifests, and ``init/model.safetensors`` when children boot through the relay)."""
    spool_dir: str | None = None
    """Directory under which the relay makes its own spool (removed at shutdown); None: no
    spool, objects that leave memory are fetched again when asked for."""
    max_spool_bytes: int = 16 << 30
    """Bytes held under the spool."""
    keep_versions: int = 4
    """Versions ``v/<n>/`` held; the oldest is dropped when a newer one arrives."""
    coalesce_ms: float = 50.0
    """How long an answer about a mutable key, a not-found, a stat or a list is reused."""
    fetch_threads: int = 16
    """Upstream calls at once (a thread pool; the store's calls block)."""
    prefetch: int = 4
    """Cut-through fetches at once (counted within ``fetch_threads``)."""
    send_timeout_s: float = 120.0
    """A child that takes no bytes for this long is disconnected."""
    admit_wait_s: float = 2.0
    """How long a child's fetch waits for memory that fetches in flight or children being
    served will free, before it is answered ``503`` (a prefetch never waits).  Keep it
    well under the children's read timeout (``HOP_POLICY``: 5 s)."""
    piece_bytes: int = 1 << 20
    """Bytes handed to the socket per write when serving."""
    max_connections: int = 512
    """Child connections held at once; one more is answered ``503`` and closed at once (so
    a flood of idle sockets cannot exhaust the relay's file descriptors)."""
    idle_timeout_s: float = 30.0
    """A child connection with no request in progress for this long is closed: also the
    bound on a request whose headers never finish (aiohttp's keep-alive timer, 3630 s by
    default)."""
    put_rate: float = 50.0
    """Writes through (acks, join requests) per second, on average; a burst of
    ``4 * put_rate`` is allowed and past it a write is answered ``429`` (the child writes
    to its next upstream)."""
    run_check_s: float = 5.0
    """How often a relay holding ``RUN.json`` checks the upstream's is still the same object;
    a changed or deleted one (the prefix reused by another run) drops everything cached."""

    def __post_init__(self) -> None:
        for name in ("max_memory_bytes", "max_spool_bytes", "keep_versions", "fetch_threads", "prefetch",
                     "piece_bytes", "max_connections"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValidationError(f"relay {name} must be an integer >= 1, got {v!r}")
        for name in ("coalesce_ms", "send_timeout_s", "admit_wait_s", "idle_timeout_s", "put_rate", "run_check_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValidationError(f"relay {name} must be a number >= 0, got {v!r}")
        for name in ("send_timeout_s", "idle_timeout_s", "put_rate", "run_check_s"):
            if getattr(self, name) <= 0:
                raise ValidationError(f"relay {name} must be > 0, got {getattr(self, name)}")
        if self.prefetch > self.fetch_threads:
            raise ValidationError(f"relay prefetch ({self.prefetch}) must not exceed fetch_threads "
                                  f"({self.fetch_threads})")


class _Entry:
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


class _NotFound(TransportError):
    pass


class _Overloaded(TransportError):
    """The request cannot be admitted under the memory cap right now (``503``)."""


class _Flight:
    __slots__ = ("task", "waiters", "wanted")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.waiters = 0
        self.wanted = asyncio.Event()  # a child waits on it: a queued prefetch goes now


class Relay:
    """The relay's state and its aiohttp application (see the module docstring)."""

    def __init__(self, store: ObjectStore, config: RelayConfig | None = None, *,
                 log: Callable[[dict], None] | None = None):
        self.store = store
        self.cfg = config or RelayConfig()
        self._log = log or _stderr_log
        self._window = self.cfg.coalesce_ms / 1000.0
        self._cache: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._versions: dict[int, set[str]] = {}
        self._fresh: dict[str, tuple[float, _Entry | None]] = {}  # mutable objects and not-founds
        self._fresh_stat: dict[str, tuple[float, ObjectInfo | None]] = {}
        self._fresh_list: dict[tuple[str, int | None], tuple[float, list[str]]] = {}  # (prefix, limit)
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._sending: dict[int, list] = {}  # id -> [key, size, sent]
        self.mem = self.reserved = self.spool = 0
        self.c: dict[str, int] = dict.fromkeys((
            "requests", "served_objects", "served_bytes", "cache_hits", "coalesced", "upstream_fetches",
            "upstream_fetch_bytes", "upstream_chunk_bytes", "upstream_stats", "upstream_lists", "upstream_puts",
            "upstream_failures", "prefetch_started", "prefetched", "prefetch_failed", "rejected", "not_found",
            "too_large", "bad_requests", "acks_forwarded", "versions_dropped", "memory_evictions",
            "spool_writes", "spool_evictions", "send_timeouts", "memory_peak_bytes", "spool_peak_bytes",
            "connections_refused", "puts_throttled", "lists_too_long", "run_changes"), 0)
        self._used: dict[int, int] = {}  # version -> tick of the last child read (the window's LRU order)
        self._confirmed: set[int] = set()  # versions whose manifest or decision a child read
        self._admitted: list[int] = []  # the last 16 versions that entered the window, oldest first
        self._confirmed_log: list[int] = []  # the last 16 versions confirmed, oldest first
        self._tick = 0
        self._puts = (0.0, 0.0)  # token bucket of writes through: (tokens, loop time)
        self._pool = ThreadPoolExecutor(self.cfg.fetch_threads, thread_name_prefix="nemo-dcr-relay-upstream")
        self._disk = ThreadPoolExecutor(4, thread_name_prefix="nemo-dcr-relay-spool")
        self._spool_root: str | None = None
        self._runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefetch_sem: asyncio.Semaphore | None = None
        self._sweeper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._freed: asyncio.Event | None = None  # set (and replaced) whenever memory may have been freed
        self.address: tuple[str, int] | None = None

    # ================================================================== lifecycle
    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=MAX_PUT_BYTES)
        r = app.router
        r.add_route("GET", f"{API}/object/{{key:.*}}", self._h_get)
        r.add_route("HEAD", f"{API}/object/{{key:.*}}", self._h_head)
        r.add_route("PUT", f"{API}/object/{{key:.*}}", self._h_put)
        r.add_route("DELETE", f"{API}/object/{{key:.*}}", self._h_delete)
        r.add_route("GET", f"{API}/list", self._h_list)
        r.add_route("GET", f"{API}/stats", self._h_stats)
        r.add_route("GET", f"{API}/health", self._h_health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, ssl_context=None) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: any free one); returns the bound address.
        ``ssl_context``: serve HTTPS directly (the CLI leaves TLS to a terminating proxy)."""
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._prefetch_sem = asyncio.Semaphore(self.cfg.prefetch)
        self._freed = asyncio.Event()
        if self.cfg.spool_dir is not None:
            os.makedirs(self.cfg.spool_dir, exist_ok=True)
            self._spool_root = tempfile.mkdtemp(prefix="relay-spool-", dir=self.cfg.spool_dir)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0,
                                     keepalive_timeout=self.cfg.idle_timeout_s)
        await self._runner.setup()
        self._cap_connections(self._runner.server)
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        self.address = tuple(self._runner.addresses[0][:2])
        self._sweeper = asyncio.ensure_future(self._sweep())
        return self.address

    def _cap_connections(self, server) -> None:
        """At most ``max_connections`` children at once: one more is answered 503 and its
        socket closed before aiohttp takes it (its keep-alive timer would hold it open)."""
        made = server.connection_made
        cap = self.cfg.max_connections

        def connection_made(handler, transport) -> None:
            if len(server.connections) >= cap:
                self.c["connections_refused"] += 1
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
                transport.close()
                return
            made(handler, transport)

        server.connection_made = connection_made

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for t in list(self._tasks) + [f.task for f in self._flights.values() if f.task is not None]:
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._disk.shutdown(wait=False, cancel_futures=True)
        if self._spool_root is not None:
            shutil.rmtree(self._spool_root, ignore_errors=True)

    async def _sweep(self) -> None:
        """Drop what outlived its coalescing window (lookups also check the expiry), and
        every ``run_check_s`` check the run (``_check_run``)."""
        next_run_check = self._loop.time() + self.cfg.run_check_s
        while True:
            await asyncio.sleep(min(max(1.0, self._window), self.cfg.run_check_s))
            now = self._loop.time()
            if now >= next_run_check:
                next_run_check = now + self.cfg.run_check_s
                try:
                    await self._check_run()
                except Exception as exc:  # noqa: BLE001 - an upstream failure: checked again next time
                    self._log({"relay": "run_check_failed", "error": _one_line(exc)})
            for key, (until, entry) in list(self._fresh.items()):
                if until <= now:
                    self._unfresh(key)
            for table in (self._fresh_stat, self._fresh_list):
                for k in [k for k, (until, _) in table.items() if until <= now]:
                    del table[k]

    async def _check_run(self) -> None:
        """The cache holds one run's immutable objects, valid while the upstream's
        ``RUN.json`` is the one cached: a prefix reused by another run (its record deleted or
        replaced) would otherwise be served this run's old ``init/`` and versions.  On a
        change everything cached is dropped (children being served keep their pinned copy)."""
        held = self._cache.get(RUN_KEY)
        if held is None:
            return
        self.c["upstream_stats"] += 1
        info = await self._up(self.store.stat, RUN_KEY)
        if info is not None and info.tag == held.tag and info.size == held.size:
            return
        self.c["run_changes"] += 1
        self._log({"relay": "run_changed", "was": held.tag, "now": None if info is None else info.tag,
                   "dropped_objects": len(self._cache)})
        for e in list(self._cache.values()):
            self._uncache(e)
        self._versions.clear()
        self._used.clear()
        self._confirmed.clear()
        for key in list(self._fresh):
            self._unfresh(key)
        self._fresh_stat.clear()
        self._fresh_list.clear()

    # ================================================================== accounting
    def _peak(self) -> None:
        self.c["memory_peak_bytes"] = max(self.c["memory_peak_bytes"], self.mem + self.reserved)
        self.c["spool_peak_bytes"] = max(self.c["spool_peak_bytes"], self.spool)

    def _reserve(self, n: int, *, prefetch: bool = False) -> bool:
        """Room for ``n`` more bytes in memory, making it by evicting unpinned cached
        objects (least recently used first: those on the spool only leave memory, the
        others are dropped).  A prefetch drops no object that no child has asked for yet
        (it would evict what it fetched ahead for another prefetch)."""
        cap = self.cfg.max_memory_bytes
        if n > cap:
            return False
        if self.mem + self.reserved + n > cap:
            for e in list(self._cache.values()):
                if self.mem + self.reserved + n <= cap:
                    break
                if e.data is None or e.pins or (prefetch and e.path is None and not e.served):
                    continue
                self.c["memory_evictions"] += 1
                if e.path is not None:
                    e.data = None
                    self.mem -= e.size
                else:
                    self._uncache(e)
        if self.mem + self.reserved + n > cap:
            return False
        self.reserved += n
        self._peak()
        return True

    def _reserve_spool(self, n: int, *, prefetch: bool = False) -> bool:
        """Room for ``n`` more bytes on the spool (least recently used out first; for a
        prefetched object, only objects a child has read)."""
        cap = self.cfg.max_spool_bytes
        if self._spool_root is None or n > cap:
            return False
        if self.spool + n > cap:
            for e in list(self._cache.values()):
                if self.spool + n <= cap:
                    break
                if e.path is None or e.pins or (prefetch and not e.served):
                    continue
                self.c["spool_evictions"] += 1
                if e.data is not None:
                    self._unlink(e)
                else:
                    self._uncache(e)
        if self.spool + n > cap:
            return False
        self.spool += n
        self._peak()
        return True

    def _unlink(self, e: _Entry) -> None:
        if e.path is not None:
            try:
                os.unlink(e.path)
            except OSError:
                pass
            e.path = None
            self.spool -= e.size

    def _uncache(self, e: _Entry) -> None:
        if self._cache.get(e.key) is e:
            del self._cache[e.key]
        if e.version is not None and e.version in self._versions:
            self._versions[e.version].discard(e.key)
        e.cached = False
        self._release(e)

    def _unfresh(self, key: str) -> None:
        until, e = self._fresh.pop(key)
        if e is not None:
            e.fresh = False
            self._release(e)

    def _release(self, e: _Entry) -> None:
        """Free what an entry holds once nothing needs it."""
        if e.pins or e.cached or e.fresh:
            return
        if e.data is not None:
            e.data = None
            self.mem -= e.size
            self._pulse()
        self._unlink(e)

    def _unpin(self, e: _Entry) -> None:
        e.pins -= 1
        assert e.pins >= 0, e.key
        self._release(e)
        if e.pins == 0:
            self._pulse()  # freed, or evictable now

    def _pulse(self) -> None:
        if self._freed is not None:
            self._freed.set()
            self._freed = asyncio.Event()

    async def _admit(self, n: int, *, prefetch: bool) -> bool:
        """``_reserve``, waiting up to ``admit_wait_s`` (not for a prefetch) for memory that
        fetches in flight or children being served free; never for more than the cap."""
        if self._reserve(n, prefetch=prefetch):
            return True
        if prefetch or n > self.cfg.max_memory_bytes:
            return False
        deadline = self._loop.time() + self.cfg.admit_wait_s
        while (left := deadline - self._loop.time()) > 0:
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                pass
            if self._reserve(n, prefetch=False):
                return True
        return False

    def _insert(self, e: _Entry, *, prefetch: bool = False) -> None:
        """Put a fetched immutable object in the cache (under the version cap), and start
        writing it to the spool."""
        v = e.version
        if v is not None and v not in self._versions:
            if len(self._versions) >= self.cfg.keep_versions:
                # out goes the version children read least recently (not the lowest number: a
                # key-less writer can plant v/99999999/... and have it read once), among the
                # unconfirmed ones first: a version is confirmed once a child read its
                # manifest or decision, which children read only as a signed HEAD.json or
                # manifest directs them.  So planted versions take at most one confirmed
                # version's slot, the least recently read, and then only replace each other.
                held = list(self._versions)
                pool = [n for n in held if n not in self._confirmed] or held
                self._drop_version(min(pool, key=lambda n: (self._used.get(n, 0), n)))
            self._versions[v] = set()
            self._used[v] = self._touch()
            self._admitted = (self._admitted + [v])[-16:]
            self._log({"relay": "version", "version": v, "held": sorted(self._versions)})
        if v is not None:
            self._versions[v].add(e.key)
        e.cached = True
        self._cache[e.key] = e
        if self._spool_root is not None and self._reserve_spool(e.size, prefetch=prefetch):
            e.pins += 1
            self._spawn(self._write_spool(e))

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    def _drop_version(self, v: int) -> None:
        self._used.pop(v, None)
        self._confirmed.discard(v)
        for key in self._versions.pop(v):
            e = self._cache.get(key)
            if e is not None:
                self._uncache(e)
        self.c["versions_dropped"] += 1
        self._log({"relay": "version_dropped", "version": v})

    async def _write_spool(self, e: _Entry) -> None:
        path = os.path.join(self._spool_root, hashlib.sha256(e.key.encode()).hexdigest())
        try:
            await self._loop.run_in_executor(self._disk, _write_file, path, e.data)
            e.path = path
            self.c["spool_writes"] += 1
        except Exception as exc:  # noqa: BLE001 - the object stays in memory only
            self.spool -= e.size
            self._log({"relay": "spool_write_failed", "key": e.key, "error": _one_line(exc)})
        finally:
            self._unpin(e)

    def _spawn(self, coro: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ================================================================== upstream
    async def _up(self, fn: Callable, *args, **kwargs) -> Any:
        try:
            return await self._loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except (ObjectNotFound, FormatError, ValidationError):
            raise
        except StoreError:
            self.c["upstream_failures"] += 1
            raise

    def _flight(self, kind: str, key: str, make: Callable[[_Flight], Awaitable]) -> _Flight:
        fl = self._flights.get((kind, key))
        if fl is not None:
            self.c["coalesced"] += 1
            return fl
        fl = self._flights[(kind, key)] = _Flight()

        async def run():
            try:
                result = await make(fl)
            finally:
                del self._flights[(kind, key)]  # nobody joins a finished flight
            if isinstance(result, _Entry):
                result.pins += fl.waiters  # one pin per waiter, taken before any can run
                self._release(result)
            return result

        fl.task = asyncio.ensure_future(run())
        fl.task.add_done_callback(_retrieve)
        return fl

    async def _join(self, fl: _Flight) -> Any:
        """The flight's result; an ``_Entry`` comes pinned for the caller."""
        fl.waiters += 1
        fl.wanted.set()
        try:
            return await asyncio.shield(fl.task)
        except asyncio.CancelledError:
            t = fl.task
            if t.done() and not t.cancelled() and t.exception() is None:
                if isinstance(t.result(), _Entry):
                    self._unpin(t.result())
            else:
                fl.waiters -= 1
            raise

    async def _fetch(self, key: str, *, prefetch: bool = False) -> _Entry | None:
        """One object from upstream (``None``: not there): its size first (``stat``), so
        memory is reserved before the body is read; the body with ``max_bytes`` = that.
        A mutable object replaced by a larger one in between is read again (twice at most)."""
        for attempt in range(3):
            self.c["upstream_stats"] += 1
            info = await self._up(self.store.stat, key)
            if info is None:
                return self._not_found(key)
            if not await self._admit(info.size, prefetch=prefetch):
                self.c["rejected"] += 1
                raise _Overloaded(f"{key!r} ({info.size} bytes) does not fit under the memory cap now "
                                  f"({self.mem + self.reserved} of {self.cfg.max_memory_bytes} bytes in use)")
            try:
                self.c["upstream_fetches"] += 1
                data, got = await self._up(self.store.get_with_info, key, max_bytes=info.size)
                break
            except ObjectNotFound:
                return self._not_found(key)
            except ObjectTooLarge as e:
                if is_immutable(key) or attempt == 2:
                    raise StoreError(f"{key!r} changed while read: {e}", key=key, op="get") from None
            finally:
                self.reserved -= info.size
                self._pulse()
        e = _Entry(key, data, got.tag, key_version(key))
        self.mem += e.size
        self._peak()
        self.c["upstream_fetch_bytes"] += e.size
        if _CHUNK.match(key):
            self.c["upstream_chunk_bytes"] += e.size
        if is_immutable(key):
            self._insert(e, prefetch=prefetch)
        else:
            if key in self._fresh:
                self._unfresh(key)
            e.fresh = True
            self._fresh[key] = (self._loop.time() + self._window, e)
        return e

    def _not_found(self, key: str) -> None:
        if key in self._fresh:
            self._unfresh(key)
        self._fresh[key] = (self._loop.time() + self._window, None)
        return None

    async def acquire(self, key: str) -> _Entry:
        """The object ``key``, pinned for the caller (``_unpin`` when served)."""
        now = self._loop.time()
        e = self._cache.get(key)
        if e is not None:
            self._cache.move_to_end(key)
            self.c["cache_hits"] += 1
            e.pins += 1
            e.served = True
            self._read_by_child(e)
            return e
        fresh = self._fresh.get(key)
        if fresh is not None and fresh[0] > now:
            self.c["coalesced"] += 1
            if fresh[1] is None:
                raise _NotFound(key)
            fresh[1].pins += 1
            return fresh[1]
        e = await self._join(self._flight("get", key, lambda fl: self._fetch(key)))
        if e is None:
            raise _NotFound(key)
        e.served = True
        self._read_by_child(e)
        return e

    def _read_by_child(self, e: _Entry) -> None:
        """A child read ``e``: its version is the most recently read, and confirmed when
        ``e`` is the version's manifest or decision (``_insert``)."""
        if e.version in self._used:
            self._used[e.version] = self._touch()
            if e.key.endswith(("/MANIFEST.json", "/DECISION.json")) and e.version not in self._confirmed:
                self._confirmed.add(e.version)
                self._confirmed_log = (self._confirmed_log + [e.version])[-16:]

    async def stat(self, key: str) -> ObjectInfo | None:
        now = self._loop.time()
        e = self._cache.get(key)
        if e is not None:
            return ObjectInfo(key, e.size, e.tag)
        for table in (self._fresh, self._fresh_stat):
            hit = table.get(key)
            if hit is not None and hit[0] > now:
                self.c["coalesced"] += 1
                v = hit[1]
                return ObjectInfo(key, v.size, v.tag) if isinstance(v, _Entry) else v

        async def fetch():
            self.c["upstream_stats"] += 1
            info = await self._up(self.store.stat, key)
            self._fresh_stat[key] = (self._loop.time() + self._window, info)
            return info

        return await self._join(self._flight("stat", key, lambda fl: fetch()))

    async def list(self, prefix: str, limit: int | None = None) -> list[str]:
        hit = self._fresh_list.get((prefix, limit))
        if hit is not None and hit[0] > self._loop.time():
            self.c["coalesced"] += 1
            return hit[1]

        async def fetch():
            self.c["upstream_lists"] += 1
            keys = await self._up(self.store.list, prefix, limit=limit)
            self._fresh_list[(prefix, limit)] = (self._loop.time() + self._window, keys)
            if len(keys) <= MAX_LIST_KEYS:
                self._cut_through(keys)
            return keys

        flight_key = prefix if limit is None else f"{prefix}#limit={limit}"
        return await self._join(self._flight("list", flight_key, lambda fl: fetch()))

    def _cut_through(self, keys: list[str]) -> None:
        """Start fetching every chunk a list revealed that the relay neither holds nor is
        fetching (children's GETs of those keys join these flights)."""
        for key in keys:
            m = _CHUNK.match(key)
            if m is None or key in self._cache or ("get", key) in self._flights:
                continue
            self.c["prefetch_started"] += 1
            self._flight("get", key, functools.partial(self._prefetch, key))

    async def _prefetch(self, key: str, fl: _Flight) -> _Entry | None:
        """A cut-through fetch: ``prefetch`` at a time, unless a child asks for the key
        while it is queued (then it goes at once: a child never waits behind the queue)."""
        slot = asyncio.ensure_future(self._prefetch_sem.acquire())
        wanted = asyncio.ensure_future(fl.wanted.wait())
        try:
            await asyncio.wait({slot, wanted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wanted.cancel()
            if not slot.done():
                slot.cancel()
        holding = slot.done() and not slot.cancelled()
        try:
            e = await self._fetch(key, prefetch=not fl.waiters)
        except Exception as exc:  # noqa: BLE001 - counted; a child's GET tries again
            self.c["prefetch_failed"] += 1
            if not isinstance(exc, _Overloaded):
                self._log({"relay": "prefetch_failed", "key": key, "error": _one_line(exc)})
            raise
        finally:
            if holding:
                self._prefetch_sem.release()
        self.c["prefetched"] += 1
        return e

    async def put(self, key: str, data: bytes) -> None:
        self.c["upstream_puts"] += 1
        await self._up(self.store.put, key, data)
        self.c["acks_forwarded"] += 1
        if key in self._fresh:
            self._unfresh(key)
        self._fresh_stat.pop(key, None)
        for k in [k for k in self._fresh_list if key.startswith(k[0] + "/") or not k[0]]:
            del self._fresh_list[k]

    # ================================================================== stats
    def upstreams(self) -> list[dict]:
        if hasattr(self.store, "upstream_stats"):
            return self.store.upstream_stats()
        return [{"uri": self.store.uri, "is_relay": bool(getattr(self.store, "is_relay", False)), "current": True,
                 "bytes_read": self.c["upstream_fetch_bytes"], "chunk_bytes_read": self.c["upstream_chunk_bytes"],
                 "failures": self.c["upstream_failures"], "bad_bytes": 0}]

    def stats(self) -> dict:
        ups = self.upstreams()
        return {
            **self.c,
            "memory_bytes": self.mem, "memory_reserved_bytes": self.reserved,
            "max_memory_bytes": self.cfg.max_memory_bytes,
            "spool_bytes": self.spool, "max_spool_bytes": self.cfg.max_spool_bytes if self._spool_root else 0,
            "cached_objects": len(self._cache),
            "versions": sorted(self._versions), "keep_versions": self.cfg.keep_versions,
            "confirmed_versions": sorted(self._confirmed), "recently_admitted": list(self._admitted),
            "recently_confirmed": list(self._confirmed_log),
            "in_flight": len(self._flights),
            "sending": [{"key": k, "size": n, "sent": s} for k, n, s in list(self._sending.values())[:32]],
            "upstreams": ups,
            "current_upstream": next((u["uri"] for u in ups if u.get("current")), None),
            "switches": int(getattr(self.store, "switches", 0)),
        }

    # ================================================================== HTTP handlers
    async def _h_get(self, request):
        from aiohttp import web

        self.c["requests"] += 1
        try:
            key = self._key(request)
            max_bytes = _max_bytes(request)
            e = await self.acquire(key)
        except _Answer as a:
            return a.response(self)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self, exc)
        try:
            headers = {"X-Dcr-Tag": e.tag, "X-Dcr-Size": str(e.size)}
            if max_bytes is not None and e.size > max_bytes:
                self.c["too_large"] += 1
                return web.Response(status=413, headers=headers,
                                    text=f"{key!r} is {e.size} bytes, over the limit of {max_bytes}\n")
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_length = e.size
            resp.content_type = "application/octet-stream"
            try:
                await self._send(request, resp, e)
            except (ConnectionError, asyncio.CancelledError):
                pass  # the child went away (or was cut off): nothing more to say to it
            return resp
        finally:
            self._unpin(e)

    async def _send(self, request, resp, e: _Entry) -> None:
        """The object's bytes in pieces from the shared copy (memory or spool); each
        write waits while the child's socket is full (aiohttp drains)."""
        await resp.prepare(request)
        slot = id(resp)
        self._sending[slot] = state = [e.key, e.size, 0]
        step = self.cfg.piece_bytes
        try:
            if e.data is not None:
                view = memoryview(e.data)
                for i in range(0, e.size, step):
                    await self._write(request, resp, view[i:i + step])
                    state[2] += min(step, e.size - i)
                    self.c["served_bytes"] += min(step, e.size - i)
            else:
                with open(e.path, "rb") as fh:
                    sent = 0
                    while sent < e.size:
                        piece = await self._loop.run_in_executor(self._disk, fh.read, min(step, e.size - sent))
                        if not piece:
                            raise OSError(f"spool file of {e.key!r} ended at {sent} of {e.size} bytes")
                        await self._write(request, resp, piece)
                        sent += len(piece)
                        state[2] = sent
                        self.c["served_bytes"] += len(piece)
            await resp.write_eof()
            self.c["served_objects"] += 1
        finally:
            del self._sending[slot]

    async def _write(self, request, resp, piece) -> None:
        try:
            await asyncio.wait_for(resp.write(piece), self.cfg.send_timeout_s)
        except asyncio.TimeoutError:
            self.c["send_timeouts"] += 1
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(f"child took no bytes for {self.cfg.send_timeout_s} s") from None

    async def _h_head(self, request):
        from aiohttp import web

        self.c["requests"] += 1
        try:
            key = self._key(request)
            info = await self.stat(key)
        except _Answer as a:
            return a.response(self)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self, exc)
        if info is None:
            self.c["not_found"] += 1
            return web.Response(status=404)
        return web.Response(status=200, headers={"X-Dcr-Size": str(info.size), "X-Dcr-Tag": info.tag})

    async def _h_list(self, request):
        from aiohttp import web

        self.c["requests"] += 1
        prefix = request.query.get("prefix", "").strip("/")
        try:
            if prefix:
                _check(prefix)
            limit = _list_limit(request.query.get("limit"))
            keys = await self.list(prefix, limit)
        except _Answer as a:
            return a.response(self)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self, exc)
        if len(keys) > MAX_LIST_KEYS:
            self.c["lists_too_long"] += 1
            return _text(413, f"{prefix!r}: {len(keys)} keys, over {MAX_LIST_KEYS} (ask with a limit)",
                         {"X-Dcr-Limit": str(MAX_LIST_KEYS)})
        return web.json_response({"keys": keys})

    async def _h_put(self, request):
        from aiohttp import web

        self.c["requests"] += 1
        try:
            key = self._key(request)
        except _Answer as a:
            return a.response(self)
        if not _PUT_KEY.match(key):
            return _text(403, f"{key!r}: a relay writes through only acks (acks/<receiver>/<v:08d>.json) and "
                              "join requests (acks/join.d/<receiver>.json)")
        if not self._put_allowed():
            self.c["puts_throttled"] += 1
            return _text(429, f"{key!r}: over {self.cfg.put_rate:g} writes through per second; write to the "
                              "next upstream")
        too_big = _text(413, f"{key!r}: over {MAX_PUT_BYTES} bytes", {"X-Dcr-Limit": str(MAX_PUT_BYTES)})
        if request.content_length is not None and request.content_length > MAX_PUT_BYTES:
            if request.content_length <= _DRAIN_PUT_BYTES:
                await request.content.read()  # let the client finish sending and read the answer
            self.c["too_large"] += 1
            return too_big
        body = bytearray()
        while len(body) <= MAX_PUT_BYTES:
            piece = await request.content.read(MAX_PUT_BYTES + 1 - len(body))
            if not piece:
                break
            body += piece
        if len(body) > MAX_PUT_BYTES:
            self.c["too_large"] += 1
            return too_big
        try:
            await self.put(key, bytes(body))
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self, exc)
        return web.Response(status=204)

    def _put_allowed(self) -> bool:
        """The token bucket of writes through (``put_rate``, burst ``4 * put_rate``)."""
        now = self._loop.time()
        tokens, then = self._puts
        burst = 4 * self.cfg.put_rate
        tokens = burst if then == 0.0 else min(burst, tokens + (now - then) * self.cfg.put_rate)
        if tokens < 1:
            self._puts = (tokens, now)
            return False
        self._puts = (tokens - 1, now)
        return True

    async def _h_delete(self, request):
        self.c["requests"] += 1
        return _text(403, "a relay never deletes")

    async def _h_stats(self, request):
        from aiohttp import web

        return web.json_response(self.stats())

    async def _h_health(self, request):
        return _text(200, "ok")

    def _key(self, request) -> str:
        """The key exactly as sent: the raw path, neither percent-decoded nor
        dot-segment-normalized (``a/./b`` is refused, not read as ``a/b``)."""
        raw = request.raw_path.split("?", 1)[0]
        prefix = f"{API}/object/"
        return _check(raw[len(prefix):] if raw.startswith(prefix) else "")


# ====================================================================== helpers
class _Answer(ProtocolError):
    """An HTTP answer other than the object (a status and its one-line text)."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status

    def response(self, relay: Relay):
        if self.status == 400:
            relay.c["bad_requests"] += 1
        return _text(self.status, str(self))


def _check(key: str) -> str:
    try:
        return check_key(key)
    except ValidationError as e:
        raise _Answer(400, str(e)) from None


def _max_bytes(request) -> int | None:
    raw = request.query.get("max_bytes")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 20:
        raise _Answer(400, f"max_bytes must be an integer >= 0, got {raw[:40]!r}")
    return int(raw)


def _list_limit(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return check_limit(int(raw) if raw.isdigit() and len(raw) <= 8 else raw)
    except ValidationError as e:
        raise _Answer(400, str(e)) from None


def _text(status: int, text: str, headers: dict | None = None):
    from aiohttp import web

    return web.Response(status=status, text=" ".join(text.split()) + "\n", headers=headers)


def _error_response(relay: Relay, exc: BaseException):
    if isinstance(exc, _NotFound):
        relay.c["not_found"] += 1
        return _text(404, f"{exc.args[0]!r}: no such object")
    if isinstance(exc, _Overloaded):
        return _text(503, str(exc))
    if isinstance(exc, ObjectNotFound):
        relay.c["not_found"] += 1
        return _text(404, str(exc))
    if isinstance(exc, ObjectTooLarge):
        relay.c["too_large"] += 1
        return _text(413, str(exc), {"X-Dcr-Size": str(exc.size)})
    if isinstance(exc, ValidationError):
        relay.c["bad_requests"] += 1
        return _text(400, str(exc))
    if isinstance(exc, (DcrError, OSError)):
        relay._log({"relay": "upstream_failed", "error": _one_line(exc)})
        return _text(502, f"upstream failed: {_one_line(exc)}")
    raise exc


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a flight nobody waited for: its error is counted and logged elsewhere


def _write_file(path: str, data: bytes) -> None:
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


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _stderr_log(event: dict) -> None:
    print(json.dumps(event), file=sys.stderr, flush=True)


# ====================================================================== in a thread
class RelayThread:
    """A relay on its own event loop in a daemon thread (tests, benchmarks, one-process
    tools): ``with RelayThread(store, cfg) as r: r.uri``."""

    def __init__(self, store: ObjectStore, config: RelayConfig | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[dict], None] | None = None, ssl_context=None):
        self.relay = Relay(store, config, log=log or (lambda e: None))
        self._host, self._port, self._ssl = host, port, ssl_context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nemo-dcr-relay", daemon=True)

    def start(self) -> "RelayThread":
        self._thread.start()
        host, port = asyncio.run_coroutine_threadsafe(self.relay.start(self._host, self._port, ssl_context=self._ssl),
                                                      self._loop).result(30)
        self.uri = f"{'https' if self._ssl else 'relay'}://{host}:{port}"
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the relay's loop (to read its state consistently)."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stats(self) -> dict:
        return self.call(self.relay.stats)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.relay.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> "RelayThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ====================================================================== CLI
class _BadInput(ValidationError):
    pass


_SIZE = re.compile(r"^([0-9]+)\s*([kmgt]?)(i?b)?$", re.IGNORECASE)


def byte_count(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``64k``: binary multiples."""
    m = _SIZE.match(text.strip())
    if m is None:
        raise ValidationError(f"not a byte count: {text!r} (e.g. 1073741824, 512M, 1GiB)")
    return int(m[1]) << (10 * " kmgt".index(m[2].lower() or " "))


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValidationError(f"--listen must be HOST:PORT (port 0: any free port), got {text!r}")
    return host.strip("[]"), int(port)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="serve one run's store to the relay tree's children "
                                                        "(docs/relay.md)")
    ap.add_argument("--upstream", required=True,
                    help="store URI to read from: a directory, s3://..., relay://HOST:PORT, or a comma-separated "
                         "ordered list of these (failover)")
    ap.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: any free port; the bound "
                                                    "address is printed on stdout)")
    d = RelayConfig()
    ap.add_argument("--spool", default=None, help="directory for the on-disk cache (default: memory only)")
    ap.add_argument("--max-spool-bytes", type=byte_count, default=d.max_spool_bytes,
                    help="bytes held under --spool (default 16G)")
    ap.add_argument("--max-memory-bytes", type=byte_count, default=d.max_memory_bytes,
                    help="objects held in memory plus fetches in flight (default 1G); larger objects get 503")
    ap.add_argument("--keep-versions", type=int, default=d.keep_versions,
                    help="versions v/<n>/ held; the oldest is dropped first (default 4)")
    ap.add_argument("--coalesce-ms", type=float, default=d.coalesce_ms,
                    help="how long answers about mutable keys, not-founds, stats and lists are reused (default 50)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="upstream: each attempt's connect/read timeout (StorePolicy.timeout_s; default: "
                         "open_store's, 30 s, and 5 s for every member of a list but the last)")
    ap.add_argument("--retries", type=int, default=None,
                    help="upstream: further attempts after a transient failure (StorePolicy.retries; default: "
                         "open_store's, 4, and 1 for every member of a list but the last)")
    ap.add_argument("--fetch-threads", type=int, default=d.fetch_threads,
                    help="upstream calls at once (default 16)")
    ap.add_argument("--prefetch", type=int, default=d.prefetch,
                    help="cut-through fetches of listed chunks at once (default 4)")
    ap.add_argument("--send-timeout-s", type=float, default=d.send_timeout_s,
                    help="disconnect a child that takes no bytes for this long (default 120)")
    ap.add_argument("--progress-s", type=float, default=30.0,
                    help="a progress line on stderr this often while anything moved (0: none; default 30)")
    ap.add_argument("--admit-wait-s", type=float, default=d.admit_wait_s,
                    help="how long a child's fetch waits for memory to be freed before its 503 (default 2)")
    ap.add_argument("--max-connections", type=int, default=d.max_connections,
                    help=f"child connections at once; one more is answered 503 (default {d.max_connections})")
    ap.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                    help=f"close a child connection idle (or sending headers) this long (default {d.idle_timeout_s:g})")
    ap.add_argument("--put-rate", type=float, default=d.put_rate,
                    help=f"acks / join requests written through per second, burst 4x (default {d.put_rate:g})")

    def one_line(message: str):
        raise _BadInput(f"{message} (see --help)")

    ap.error = one_line
    return ap


def check_input(args) -> tuple[ObjectStore, RelayConfig, tuple[str, int]]:
    from nemo_dcr.transport.store import open_store

    try:
        listen = parse_listen(args.listen)
        cfg = RelayConfig(max_memory_bytes=args.max_memory_bytes, spool_dir=args.spool,
                          max_spool_bytes=args.max_spool_bytes, keep_versions=args.keep_versions,
                          coalesce_ms=args.coalesce_ms, fetch_threads=args.fetch_threads, prefetch=args.prefetch,
                          send_timeout_s=args.send_timeout_s, admit_wait_s=args.admit_wait_s,
                          max_connections=args.max_connections, idle_timeout_s=args.idle_timeout_s,
                          put_rate=args.put_rate)
        if args.progress_s < 0:
            raise ValidationError(f"--progress-s must be >= 0, got {args.progress_s}")
        if args.spool is not None and os.path.exists(args.spool) and not os.path.isdir(args.spool):
            raise ValidationError(f"--spool {args.spool!r} is not a directory")
    except (DcrError, ValueError) as e:
        raise _BadInput(str(e)) from None
    try:
        given = {k: v for k, v in (("timeout_s", args.timeout_s), ("retries", args.retries)) if v is not None}
        store = open_store(args.upstream, **given)
    except (DcrError, ValueError, TypeError, ImportError) as e:
        raise _BadInput(f"--upstream: {type(e).__name__}: {e}") from None
    return store, cfg, listen, args.progress_s


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        store, cfg, (host, port), progress_s = check_input(args)
    except _BadInput as e:
        return _fail(str(e), 2)
    try:
        status = asyncio.run(_serve(store, cfg, host, port, progress_s))
    except OSError as e:  # the address is taken, the spool cannot be made
        return _fail(f"{type(e).__name__}: {e}", 1)
    # Shut down: the server is closed and the spool removed.  An upstream call still
    # running in the pool (a stalled upstream) would hold the interpreter's exit for up to
    # its policy's bound; nothing waits for its answer, so the process exits now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


_PROGRESS = ("served_bytes", "served_objects", "upstream_fetches", "upstream_fetch_bytes", "coalesced", "cache_hits",
             "prefetched", "rejected", "upstream_failures", "memory_bytes", "spool_bytes", "versions",
             "current_upstream")


async def _progress(relay: Relay, every_s: float) -> None:
    last = None
    while True:
        await asyncio.sleep(every_s)
        s = relay.stats()
        now = {k: s[k] for k in _PROGRESS}
        if now != last:
            _stderr_log({"relay": "progress", **now})
            last = now


async def _serve(store: ObjectStore, cfg: RelayConfig, host: str, port: int, progress_s: float = 0.0) -> int:
    relay = Relay(store, cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = await relay.start(host, port)
    shown = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
    print(json.dumps({"relay": "listening", "address": shown, "upstreams": [u["uri"] for u in relay.upstreams()],
                      "config": {k: v for k, v in asdict(cfg).items()}}), flush=True)
    ticker = asyncio.ensure_future(_progress(relay, progress_s)) if progress_s > 0 else None
    try:
        await stop.wait()
    finally:
        if ticker is not None:
            ticker.cancel()
        s = relay.stats()
        await relay.close()
        _stderr_log({"relay": "stopped", **{k: s[k] for k in ("served_bytes", "served_objects", "upstream_fetches",
                                                                "upstream_fetch_bytes", "coalesced", "prefetched")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
