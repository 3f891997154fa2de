"""The relay node: :class:`Relay` (single-flight and cut-through fetching from its upstream,
the run check, the stats), over a :class:`~nemo_dcr.transport.relay.cache.Cache`."""
from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nemo_dcr.errors import FormatError, ValidationError
from nemo_dcr.events import event_line
from nemo_dcr.transport.relay.cache import Cache, Entry, NotHeld, Overloaded
from nemo_dcr.protocol.keys import RUN_KEY, is_chunk_object, is_immutable, key_version
from nemo_dcr.transport.relay.config import MAX_LIST_KEYS, RelayConfig
from nemo_dcr.transport.relay.http import make_app
from nemo_dcr.transport.relay.stats import RelayCounters
from nemo_dcr.transport.store.base import ObjectInfo, ObjectNotFound, ObjectStore, ObjectTooLarge, StoreError, list_sizes
from nemo_dcr.transport.store.policy import one_line



class Flight:
    __slots__ = ("task", "waiters", "wanted")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.waiters = 0
        self.wanted = asyncio.Event()  # a child waits on it: a queued prefetch goes now


class Relay:
    """One node of the relay tree: its upstream, what it holds (:class:`Cache`) and its
    aiohttp application (``http.py``); see the package docstring."""

    def __init__(self, store: ObjectStore, config: RelayConfig | None = None, *,
                 log: Callable[[dict], None] | None = None):
        self.store = store
        self.cfg = config or RelayConfig()
        self._log = log or stderr_log
        self._window = self.cfg.coalesce_ms / 1000.0
        self.counters = RelayCounters()
        self.cache = Cache(self.cfg, self.counters, self._log)
        self._fresh_stat: dict[str, tuple[float, ObjectInfo | None]] = {}
        self._fresh_list: dict[tuple[str, int | None], tuple[float, list[tuple[str, int | None]]]] = {}  # (prefix, limit)
        self._flights: dict[tuple[str, str], Flight] = {}
        self.sending: dict[int, list] = {}  # id -> [key, size, sent]
        self._pool = ThreadPoolExecutor(self.cfg.fetch_threads, thread_name_prefix="nemo-dcr-relay-upstream")
        self._runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefetch_sem: asyncio.Semaphore | None = None
        self._sweeper: asyncio.Task | None = None
        self.address: tuple[str, int] | None = None

    # ================================================================== lifecycle
    def app(self):
        """The relay's aiohttp application (HTTP API v1, ``http.py``)."""
        return make_app(self)

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, ssl_context=None) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: any free one); returns the bound address.
        ``ssl_context``: serve HTTPS directly (the CLI leaves TLS to a terminating proxy)."""
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._prefetch_sem = asyncio.Semaphore(self.cfg.prefetch)
        self.cache.open(self._loop)
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
                self.counters.connections_refused += 1
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
        for t in [f.task for f in self._flights.values() if f.task is not None]:
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()

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
                    self._log({"relay": "run_check_failed", "error": one_line(exc)})
            for key, (until, entry) in list(self.cache.fresh.items()):
                if until <= now:
                    self.cache.unfresh(key)
            for table in (self._fresh_stat, self._fresh_list):
                for k in [k for k, (until, _) in table.items() if until <= now]:
                    del table[k]

    async def _check_run(self) -> None:
        """The cache holds one run's immutable objects, valid while the upstream's
        ``RUN.json`` is the one cached: a prefix reused by another run (its record deleted or
        replaced) would otherwise be served this run's old ``init/`` and versions.  On a
        change everything cached is dropped (children being served keep their pinned copy)."""
        held = self.cache.entries.get(RUN_KEY)
        if held is None:
            return
        self.counters.upstream_stats += 1
        info = await self._up(self.store.stat, RUN_KEY)
        if info is not None and info.tag == held.tag and info.size == held.size:
            return
        self.counters.run_changes += 1
        self._log({"relay": "run_changed", "was": held.tag, "now": None if info is None else info.tag,
                   "dropped_objects": len(self.cache.entries)})
        self.cache.drop_all()
        self._fresh_stat.clear()
        self._fresh_list.clear()

    # ================================================================== upstream
    async def _up(self, fn: Callable, *args, **kwargs) -> Any:
        try:
            return await self._loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except (ObjectNotFound, FormatError, ValidationError):
            raise
        except StoreError:
            self.counters.upstream_failures += 1
            raise

    def _flight(self, kind: str, key: str, make: Callable[[Flight], Awaitable]) -> Flight:
        fl = self._flights.get((kind, key))
        if fl is not None:
            self.counters.coalesced += 1
            return fl
        fl = self._flights[(kind, key)] = Flight()

        async def run():
            try:
                result = await make(fl)
            finally:
                del self._flights[(kind, key)]  # nobody joins a finished flight
            if isinstance(result, Entry):
                result.pins += fl.waiters  # one pin per waiter, taken before any can run
                self.cache.release(result)
            return result

        fl.task = asyncio.ensure_future(run())
        fl.task.add_done_callback(retrieve)
        return fl

    async def _join(self, fl: Flight) -> Any:
        """The flight's result; an ``Entry`` comes pinned for the caller."""
        fl.waiters += 1
        fl.wanted.set()
        try:
            return await asyncio.shield(fl.task)
        except asyncio.CancelledError:
            t = fl.task
            if t.done() and not t.cancelled() and t.exception() is None:
                if isinstance(t.result(), Entry):
                    self.cache.unpin(t.result())
            else:
                fl.waiters -= 1
            raise

    async def _fetch(self, key: str, *, prefetch: bool = False) -> Entry | None:
        """One object from upstream (``None``: not there): its size first (``stat``), so
        memory is reserved before the body is read; the body with ``max_bytes`` = that.
        A mutable object replaced by a larger one in between is read again (twice at most)."""
        for attempt in range(3):
            self.counters.upstream_stats += 1
            info = await self._up(self.store.stat, key)
            if info is None:
                return self._not_found(key)
            if not await self.cache.admit(info.size, prefetch=prefetch):
                self.counters.rejected += 1
                raise Overloaded(f"{key!r} ({info.size} bytes) does not fit under the memory cap now "
                                  f"({self.cache.mem + self.cache.reserved} of {self.cfg.max_memory_bytes} bytes in use)")
            try:
                self.counters.upstream_fetches += 1
                data, got = await self._up(self.store.get_with_info, key, max_bytes=info.size)
                break
            except ObjectNotFound:
                return self._not_found(key)
            except ObjectTooLarge as e:
                if is_immutable(key) or attempt == 2:
                    raise StoreError(f"{key!r} changed while read: {e}", key=key, op="get") from None
            finally:
                self.cache.reserved -= info.size
                self.cache.pulse()
        e = Entry(key, data, got.tag, key_version(key))
        self.cache.mem += e.size
        self.cache.peak()
        self.counters.upstream_fetch_bytes += e.size
        if is_chunk_object(key):
            self.counters.upstream_chunk_bytes += e.size
        if is_immutable(key):
            self.cache.insert(e, prefetch=prefetch)
        else:
            self.cache.keep_fresh(key, e, self._loop.time() + self._window)
        return e

    def _not_found(self, key: str) -> None:
        self.cache.keep_fresh(key, None, self._loop.time() + self._window)
        return None

    async def acquire(self, key: str) -> Entry:
        """The object ``key``, pinned for the caller (``_unpin`` when served)."""
        now = self._loop.time()
        e = self.cache.entries.get(key)
        if e is not None:
            self.cache.entries.move_to_end(key)
            self.counters.cache_hits += 1
            e.pins += 1
            e.served = True
            self.cache.read_by_child(e)
            return e
        fresh = self.cache.fresh.get(key)
        if fresh is not None and fresh[0] > now:
            self.counters.coalesced += 1
            if fresh[1] is None:
                raise NotHeld(key)
            fresh[1].pins += 1
            return fresh[1]
        e = await self._join(self._flight("get", key, lambda fl: self._fetch(key)))
        if e is None:
            raise NotHeld(key)
        e.served = True
        self.cache.read_by_child(e)
        return e


    async def stat(self, key: str) -> ObjectInfo | None:
        now = self._loop.time()
        e = self.cache.entries.get(key)
        if e is not None:
            return ObjectInfo(key, e.size, e.tag)
        for table in (self.cache.fresh, self._fresh_stat):
            hit = table.get(key)
            if hit is not None and hit[0] > now:
                self.counters.coalesced += 1
                v = hit[1]
                return ObjectInfo(key, v.size, v.tag) if isinstance(v, Entry) else v

        async def fetch():
            self.counters.upstream_stats += 1
            info = await self._up(self.store.stat, key)
            self._fresh_stat[key] = (self._loop.time() + self._window, info)
            return info

        return await self._join(self._flight("stat", key, lambda fl: fetch()))

    async def list(self, prefix: str, limit: int | None = None) -> list[tuple[str, int | None]]:
        """The keys under ``prefix`` in key order, each with its size: from the upstream's
        listing where it carries sizes (S3, a directory, a relay that passes them on:
        ``store.base.list_sizes``), else from the copy this relay holds, else None.  A
        size only bounds the child's later read of the key (as the origin's listing would)."""
        hit = self._fresh_list.get((prefix, limit))
        if hit is not None and hit[0] > self._loop.time():
            self.counters.coalesced += 1
            return hit[1]

        async def fetch():
            self.counters.upstream_lists += 1
            listed = await self._up(list_sizes, self.store, prefix, limit=limit)
            held = self.cache.entries
            listed = [(k, n if n is not None or k not in held else held[k].size) for k, n in listed]
            self._fresh_list[(prefix, limit)] = (self._loop.time() + self._window, listed)
            if len(listed) <= MAX_LIST_KEYS:
                self._cut_through([k for k, _ in listed])
            return listed

        flight_key = prefix if limit is None else f"{prefix}#limit={limit}"
        return await self._join(self._flight("list", flight_key, lambda fl: fetch()))

    def _cut_through(self, keys: list[str]) -> None:
        """Start fetching every chunk a list revealed that the relay neither holds nor is
        fetching (children's GETs of those keys join these flights)."""
        for key in keys:
            if not is_chunk_object(key) or key in self.cache.entries or ("get", key) in self._flights:
                continue
            self.counters.prefetch_started += 1
            self._flight("get", key, functools.partial(self._prefetch, key))

    async def _prefetch(self, key: str, fl: Flight) -> Entry | None:
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
            self.counters.prefetch_failed += 1
            if not isinstance(exc, Overloaded):
                self._log({"relay": "prefetch_failed", "key": key, "error": one_line(exc)})
            raise
        finally:
            if holding:
                self._prefetch_sem.release()
        self.counters.prefetched += 1
        return e

    async def put(self, key: str, data: bytes) -> None:
        self.counters.upstream_puts += 1
        await self._up(self.store.put, key, data)
        self.counters.acks_forwarded += 1
        if key in self.cache.fresh:
            self.cache.unfresh(key)
        self._fresh_stat.pop(key, None)
        for k in [k for k in self._fresh_list if key.startswith(k[0] + "/") or not k[0]]:
            del self._fresh_list[k]

    # ================================================================== stats
    def upstreams(self) -> list[dict]:
        if hasattr(self.store, "upstream_stats"):
            return self.store.upstream_stats()
        return [{"uri": self.store.uri, "is_relay": bool(getattr(self.store, "is_relay", False)), "current": True,
                 "bytes_read": self.counters.upstream_fetch_bytes, "chunk_bytes_read": self.counters.upstream_chunk_bytes,
                 "failures": self.counters.upstream_failures, "bad_bytes": 0}]

    def stats(self) -> dict:
        ups = self.upstreams()
        return {
            **self.counters.as_dict(),
            "memory_bytes": self.cache.mem, "memory_reserved_bytes": self.cache.reserved,
            "max_memory_bytes": self.cfg.max_memory_bytes,
            "spool_bytes": self.cache.spool, "max_spool_bytes": self.cfg.max_spool_bytes if self.cache.spool_root else 0,
            "cached_objects": len(self.cache.entries),
            "versions": sorted(self.cache.versions), "keep_versions": self.cfg.keep_versions,
            "confirmed_versions": sorted(self.cache.confirmed), "recently_admitted": list(self.cache.admitted),
            "recently_confirmed": list(self.cache.confirmed_log),
            "in_flight": len(self._flights),
            "sending": [{"key": k, "size": n, "sent": s} for k, n, s in list(self.sending.values())[:32]],
            "upstreams": ups,
            "current_upstream": next((u["uri"] for u in ups if u.get("current")), None),
            "switches": int(getattr(self.store, "switches", 0)),
        }


def retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a flight nobody waited for: its error is counted and logged elsewhere


def stderr_log(event: dict) -> None:
    print(event_line(event), file=sys.stderr, flush=True)
