"""The relay server (``transport/relay/``) and its client store (``relay_client.py``).

In-process relays (``RelayThread``: the relay's own loop in a thread) over a
``LocalDirStore`` origin wrapped in a counting store, so that every claim is proved by
counters (upstream calls, bytes, peaks), not by timing.  The process tests start
``nemo-dcr relay`` itself (the CLI, the listening line, SIGTERM).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import urllib3

from nemo_dcr.transport import relay as relay_mod
from nemo_dcr.transport.relay import MAX_PUT_BYTES, RelayConfig, RelayThread
from nemo_dcr.transport.relay_client import RelayStore
from nemo_dcr.transport.store import LocalDirStore, ObjectNotFound, ObjectTooLarge, StoreError, StorePolicy

CHUNK = "v/00000001/chunks/r000-{:05d}.dcr"


class CountingStore:
    """An origin that counts its calls per (op, key); ``gate`` (an Event) holds every
    get (of the keys in ``gated``, when given) until it is set."""

    def __init__(self, inner):
        self.inner, self.uri = inner, inner.uri
        self.calls: Counter = Counter()
        self.gate: threading.Event | None = None
        self.gated: set[str] | None = None
        self.limits: list[int | None] = []  # the limit of each list call, in order
        self._lock = threading.Lock()

    def _count(self, op, key):
        with self._lock:
            self.calls[op, key] += 1

    def ops(self, op: str) -> int:
        with self._lock:
            return sum(n for (o, _), n in self.calls.items() if o == op)

    def get_with_info(self, key, *, max_bytes=None):
        self._count("get", key)
        if self.gate is not None and (self.gated is None or key in self.gated):
            assert self.gate.wait(30)
        return self.inner.get_with_info(key, max_bytes=max_bytes)

    def get(self, key, *, max_bytes=None):
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def stat(self, key):
        self._count("stat", key)
        return self.inner.stat(key)

    def exists(self, key):
        return self.stat(key) is not None

    def list(self, prefix, *, limit=None):
        self._count("list", prefix)
        self.limits.append(limit)
        return self.inner.list(prefix, limit=limit)

    def put(self, key, data):
        self._count("put", key)
        self.inner.put(key, data)

    def delete(self, key):
        self.inner.delete(key)


@pytest.fixture
def origin(tmp_path):
    return CountingStore(LocalDirStore(str(tmp_path / "origin")))


def client(uri: str, retries: int = 0) -> RelayStore:
    return RelayStore(uri, policy=StorePolicy(timeout_s=10, retries=retries, backoff_s=0.05))


def wait_for(cond, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ---------------------------------------------------------------------------- the basics
def test_read_side_round_trip(origin):
    origin.inner.put("RUN.json", b'{"run": 1}')
    payload = os.urandom(3 << 20)
    origin.inner.put(CHUNK.format(0), payload)
    with RelayThread(origin) as r:
        c = client(r.uri)
        got, info = c.get_with_info(CHUNK.format(0))
        assert got == payload and info.size == len(payload)
        assert info.tag == origin.inner.stat(CHUNK.format(0)).tag  # the upstream's tag, passed through
        assert c.get("RUN.json") == b'{"run": 1}'
        assert c.stat("RUN.json").size == 10 and c.exists("RUN.json")
        assert c.stat("nope.json") is None and not c.exists("nope.json")
        with pytest.raises(ObjectNotFound):
            c.get("nope.json")
        with pytest.raises(ObjectTooLarge) as e:
            c.get(CHUNK.format(0), max_bytes=1000)
        assert e.value.size == len(payload)
        assert c.get(CHUNK.format(0), max_bytes=len(payload)) == payload
        assert c.list("v/00000001/chunks") == [CHUNK.format(0)]
        assert c.list("") == ["RUN.json", CHUNK.format(0)]
        assert c.list("v/00000009/") == []
        origin.inner.put("init/empty.json", b"")
        assert c.get_with_info("init/empty.json")[0] == b"" and c.stat("init/empty.json").size == 0
        assert origin.calls["get", CHUNK.format(0)] == 1  # served three times, fetched once
        s = r.stats()
        assert s["served_bytes"] == 2 * len(payload) + 10
        assert s["upstreams"][0]["chunk_bytes_read"] == len(payload)
        with urllib3.PoolManager() as http:
            assert http.request("GET", r.uri.replace("relay", "http") + "/v1/health").data == b"ok\n"


def test_a_list_carries_sizes_from_the_upstream_listing_or_the_held_copy(origin, tmp_path):
    """A relay's ``list`` gives each key's size: its upstream's, where that listing carries
    sizes (a directory, S3, a relay), else the size of the copy it holds, else None (the
    child asks ``HEAD``).  Through two levels the sizes pass on.  Control: an upstream listing
    without sizes and a key the relay does not hold give None."""
    sizes = (5, 0, 1 << 20)
    for i, n in enumerate(sizes):
        origin.inner.put(CHUNK.format(i), os.urandom(n))
    origin.inner.put("init/a.json", b"{}")
    origin.inner.put("init/b.json", b"[1, 2]")
    with RelayThread(origin) as r:  # origin: a listing without sizes
        c = client(r.uri)
        assert c.list_sizes("init") == [("init/a.json", None), ("init/b.json", None)]
        assert c.get("init/b.json") == b"[1, 2]"  # now held (an immutable key)
        time.sleep(r.relay.cfg.coalesce_ms / 1000 + 0.05)  # past the listing's coalescing window
        assert c.list_sizes("init") == [("init/a.json", None), ("init/b.json", 6)]  # the held copy's
    with RelayThread(origin.inner) as root, RelayThread(client(root.uri)) as leaf:  # a directory: sizes
        want = [(CHUNK.format(i), n) for i, n in enumerate(sizes)]
        assert client(root.uri).list_sizes("v/00000001/chunks") == want
        assert client(leaf.uri).list_sizes("v/00000001/chunks") == want  # passed on by the root
        assert client(leaf.uri).list_sizes("v/00000001/chunks", limit=2) == want[:2]
        assert client(leaf.uri).list("v/00000001/chunks") == [k for k, _ in want]


@pytest.mark.parametrize("body, limit, error", [
    (b'{"keys": ["a", "b"], "sizes": [1]}', None, "one size"),
    (b'{"keys": ["a"], "sizes": [-1]}', None, "one size"),
    (b'{"keys": ["a"], "sizes": [true]}', None, "one size"),
    (b'{"keys": ["a"], "sizes": ["7"]}', None, "one size"),
    (b'{"keys": ["a"], "sizes": {"a": 1}}', None, "one size"),
    (b'{"keys": ["a"], "sizes": [1' + b',1' * 9 + b']}', 1, "over 1 keys"),  # numbers counted before parsing
])
def test_a_list_answer_with_bad_sizes_is_refused(body, limit, error):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    srv = CannedServer(head + body)
    try:
        c = RelayStore(srv.uri, policy=StorePolicy(timeout_s=2, retries=0))
        with pytest.raises(StoreError, match=error):
            c.list_sizes("v/00000001/chunks", limit=limit)
    finally:
        srv.close()
    ok = b'{"keys": ["b", "a"]}'  # control: an answer without sizes (an older relay) is read, sizes None
    srv = CannedServer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok)
    try:
        assert RelayStore(srv.uri, policy=StorePolicy(timeout_s=2, retries=0)).list_sizes("v") == [("a", None),
                                                                                                  ("b", None)]
    finally:
        srv.close()


def test_a_bounded_list_passes_its_limit_upstream(origin):
    """``list(prefix, limit=n)`` through a relay: the relay asks its upstream for n keys (a
    store writer's flood costs one bounded page at every hop), caches it apart from the
    unbounded listing, and refuses a limit that is not an int in range (control: the
    unbounded listing still returns every key)."""
    for i in range(12):
        origin.inner.put(f"acks/join.d/r{i:02d}.json", b"{}")
    with RelayThread(origin) as r:
        c = client(r.uri)
        assert c.list("acks/join.d/", limit=3) == [f"acks/join.d/r{i:02d}.json" for i in range(3)]
        assert origin.limits == [3]
        assert len(c.list("acks/join.d/")) == 12 and origin.limits == [3, None]
        with urllib3.PoolManager() as http:
            base = r.uri.replace("relay", "http") + "/v1/list?prefix=acks/join.d&limit="
            for bad in ("0", "-1", "x", "99999999999"):
                assert http.request("GET", base + bad).status == 400, bad


def test_single_flight(origin):
    """N children asking for one key at once: one upstream fetch, N-1 coalesced."""
    payload = os.urandom(1 << 20)
    origin.inner.put(CHUNK.format(0), payload)
    origin.gate = threading.Event()
    n = 12
    with RelayThread(origin) as r:
        with ThreadPoolExecutor(n) as pool:
            futs = [pool.submit(client(r.uri).get, CHUNK.format(0)) for _ in range(n)]
            wait_for(lambda: r.stats()["coalesced"] == n - 1, "every request to join the one fetch")
            origin.gate.set()
            got = [f.result(30) for f in futs]
        assert all(g == payload for g in got)
        assert origin.calls["get", CHUNK.format(0)] == 1
        assert r.stats()["upstream_fetches"] == 1


def test_cut_through_fetches_listed_chunks_before_any_child_asks(origin):
    payloads = {CHUNK.format(i): os.urandom((1 << 20) + i) for i in range(6)}
    for k, v in payloads.items():
        origin.inner.put(k, v)
    with RelayThread(origin, RelayConfig(prefetch=2)) as r:
        c = client(r.uri)
        assert c.list("v/00000001/chunks/") == sorted(payloads)
        wait_for(lambda: r.stats()["prefetched"] == len(payloads), "the listed chunks to be prefetched")
        assert origin.ops("get") == len(payloads)  # fetched with no child GET yet
        for k, v in payloads.items():
            assert c.get(k) == v
        assert origin.ops("get") == len(payloads)  # the children's GETs fetched nothing more
        s = r.stats()
        assert s["cache_hits"] == len(payloads) and s["prefetch_started"] == len(payloads)
        # a manifest or an unlisted key is not prefetched: only chunk keys are
        origin.inner.put("v/00000001/MANIFEST.json", b"{}")
        c.list("v/00000001/")
        assert r.stats()["prefetch_started"] == len(payloads)


def test_a_child_never_waits_behind_the_prefetch_queue(origin):
    payloads = {CHUNK.format(i): os.urandom(1000 + i) for i in range(4)}
    for k, v in payloads.items():
        origin.inner.put(k, v)
    origin.gate, origin.gated = threading.Event(), {CHUNK.format(0)}
    with RelayThread(origin, RelayConfig(prefetch=1)) as r:
        try:
            client(r.uri).list("v/00000001/chunks/")
            wait_for(lambda: origin.calls["get", CHUNK.format(0)] == 1, "the first prefetch to hold the one slot")
            assert origin.ops("get") == 1  # the others are queued behind it
            with ThreadPoolExecutor(1) as pool:  # a child asks for a queued one: it goes at once
                assert pool.submit(client(r.uri).get, CHUNK.format(3)).result(10) == payloads[CHUNK.format(3)]
            assert origin.calls["get", CHUNK.format(0)] == 1 and origin.calls["get", CHUNK.format(3)] == 1
            assert origin.calls["get", CHUNK.format(1)] == 0  # still queued: the slot is held
        finally:
            origin.gate.set()
        wait_for(lambda: r.stats()["prefetched"] == 4, "the queue to drain")
        assert origin.ops("get") == 4


def test_prefetch_does_not_evict_what_no_child_has_read(origin):
    """Without a spool, cut-through fills memory once and then stops (prefetches that do
    not fit fail) instead of evicting its own unread work: no chunk crosses twice."""
    payloads = {CHUNK.format(i): os.urandom(1 << 20) for i in range(6)}
    for k, v in payloads.items():
        origin.inner.put(k, v)
    cap = (3 << 20) + (1 << 19)
    with RelayThread(origin, RelayConfig(max_memory_bytes=cap, prefetch=1)) as r:
        c = client(r.uri)
        c.list("v/00000001/chunks/")
        wait_for(lambda: r.stats()["prefetched"] + r.stats()["prefetch_failed"] == 6, "the prefetches")
        assert r.stats()["prefetched"] == 3 and r.stats()["prefetch_failed"] == 3
        for k, v in payloads.items():
            assert c.get(k) == v
        assert {origin.calls["get", k] for k in payloads} == {1}
        assert r.stats()["memory_peak_bytes"] <= cap


def test_prefetch_does_not_evict_unread_objects_from_the_spool(origin, tmp_path):
    payloads = {CHUNK.format(i): os.urandom(1 << 20) for i in range(6)}
    for k, v in payloads.items():
        origin.inner.put(k, v)
    cfg = RelayConfig(max_memory_bytes=2 << 20, spool_dir=str(tmp_path / "spool"), max_spool_bytes=3 << 20,
                      prefetch=1)
    with RelayThread(origin, cfg) as r:
        c = client(r.uri)
        c.list("v/00000001/chunks/")
        wait_for(lambda: r.stats()["prefetched"] + r.stats()["prefetch_failed"] == 6 and not r.relay.cache.tasks,
                 "the prefetches and their spool writes")
        s = r.stats()
        # how many prefetches find room depends on how fast the spool writes free memory (5 on
        # an idle machine, 3-4 under load: the rest are refused before any fetch); the spool
        # fills, and no prefetch evicts an object nobody has read yet
        assert s["prefetched"] >= 3 and (s["spool_writes"], s["spool_evictions"]) == (3, 0), s
        spooled = {k for k, e in list(r.relay.cache.entries.items()) if e.path is not None}
        assert len(spooled) == 3
        for k, v in payloads.items():
            assert c.get(k) == v
        # the spooled ones are served from the spool, never fetched again; none twice more
        assert all(origin.calls["get", k] == 1 for k in spooled)
        assert all(1 <= origin.calls["get", k] <= 2 for k in payloads)


def test_two_level_tree_serves_identical_bytes(origin):
    a, b = os.urandom(2 << 20), os.urandom(2 << 20)
    origin.inner.put(CHUNK.format(0), a)
    origin.inner.put(CHUNK.format(1), b)
    with RelayThread(origin) as r0, RelayThread(client(r0.uri, retries=2)) as r1:
        c = client(r1.uri)
        got0, got1 = c.get(CHUNK.format(0)), c.get(CHUNK.format(1))
        assert got0 == a and got1 == b
        assert got0 != got1  # negative control: another object differs
        flipped = bytearray(got0)
        flipped[12345] ^= 1
        assert bytes(flipped) != a
        assert c.get(CHUNK.format(0)) == a
        assert origin.calls["get", CHUNK.format(0)] == 1
        assert r1.stats()["upstreams"][0]["is_relay"] is True
        assert r0.stats()["served_bytes"] == len(a) + len(b)  # each object crossed r0 -> r1 once


# ---------------------------------------------------------------------------- mutable keys
def test_mutable_keys_and_not_found_live_only_for_the_window(origin):
    origin.inner.put("HEAD.json", b'{"v": 1}')
    with RelayThread(origin, RelayConfig(coalesce_ms=300)) as r:
        c = client(r.uri)
        assert c.get("HEAD.json") == b'{"v": 1}'
        with pytest.raises(ObjectNotFound):
            c.get("COMMITTED.json")
        origin.inner.put("HEAD.json", b'{"v": 2}')
        origin.inner.put("COMMITTED.json", b'{"v": 2}')
        time.sleep(0.35)  # past the window (the relay's clock is monotonic)
        assert c.get("HEAD.json") == b'{"v": 2}'
        assert c.get("COMMITTED.json") == b'{"v": 2}'
        assert origin.calls["get", "HEAD.json"] == 2
    origin.calls.clear()
    with RelayThread(origin, RelayConfig(coalesce_ms=60_000)) as r:  # a long window: polls share one fetch
        c = client(r.uri)
        assert [c.get("HEAD.json") for _ in range(5)] == [b'{"v": 2}'] * 5
        origin.inner.put("HEAD.json", b'{"v": 3}')
        assert c.get("HEAD.json") == b'{"v": 2}'  # within the window
        assert origin.calls["get", "HEAD.json"] == 1 and r.stats()["coalesced"] == 5


# ---------------------------------------------------------------------------- caps
def test_memory_cap_evicts_and_refuses(origin):
    cap = 4 << 20
    objs = {CHUNK.format(i): os.urandom(1_500_000) for i in range(5)}
    for k, v in objs.items():
        origin.inner.put(k, v)
    origin.inner.put("v/00000001/chunks/big.dcr", os.urandom(cap + 1))
    with RelayThread(origin, RelayConfig(max_memory_bytes=cap)) as r:
        c = client(r.uri)
        for k, v in objs.items():
            assert c.get(k) == v
        s = r.stats()
        assert s["memory_peak_bytes"] <= cap and s["memory_bytes"] <= cap
        assert s["memory_evictions"] >= 3 and s["cached_objects"] == 2
        with pytest.raises(StoreError, match="HTTP 503"):
            c.get("v/00000001/chunks/big.dcr")  # can never fit: 503, the child moves on
        assert origin.calls["get", "v/00000001/chunks/big.dcr"] == 0  # refused before its body was read
        assert r.stats()["rejected"] == 1 and r.stats()["memory_peak_bytes"] <= cap


def test_a_fetch_waits_for_memory_in_flight_instead_of_503(origin):
    """Memory reserved by a fetch in flight is freed (made evictable) when it ends; a fetch
    that needs it waits for that (up to admit_wait_s) rather than answering 503."""
    a, b = os.urandom(2 << 20), os.urandom(2 << 20)
    origin.inner.put(CHUNK.format(0), a)
    origin.inner.put(CHUNK.format(1), b)
    origin.gate, origin.gated = threading.Event(), {CHUNK.format(0)}
    with RelayThread(origin, RelayConfig(max_memory_bytes=3 << 20, admit_wait_s=30)) as r:
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(client(r.uri).get, CHUNK.format(0))
            wait_for(lambda: r.stats()["memory_reserved_bytes"] == len(a), "a's fetch to reserve its size")
            fb = pool.submit(client(r.uri).get, CHUNK.format(1))
            wait_for(lambda: origin.calls["stat", CHUNK.format(1)] == 1, "b's fetch to wait for memory")
            assert origin.calls["get", CHUNK.format(1)] == 0  # b is not read while a holds the memory
            origin.gate.set()
            assert fa.result(20) == a and fb.result(20) == b
        s = r.stats()
        assert s["rejected"] == 0 and s["memory_peak_bytes"] <= 3 << 20 and s["memory_evictions"] == 1


def test_spool_cap_and_serving_from_spool(origin, tmp_path):
    mem_cap, spool_cap = 3 << 20, 5 << 20
    objs = {CHUNK.format(i): os.urandom(1 << 20) for i in range(8)}
    for k, v in objs.items():
        origin.inner.put(k, v)
    spool = tmp_path / "spool"
    cfg = RelayConfig(max_memory_bytes=mem_cap, spool_dir=str(spool), max_spool_bytes=spool_cap)
    with RelayThread(origin, cfg) as r:
        c = client(r.uri)
        for k, v in objs.items():
            assert c.get(k) == v
            wait_for(lambda: r.stats()["in_flight"] == 0 and not r.relay.cache.tasks, "the spool write")
            on_disk = sum(f.stat().st_size for f in spool.rglob("*") if f.is_file())
            assert on_disk <= spool_cap
        s = r.stats()
        assert s["spool_peak_bytes"] <= spool_cap and s["memory_peak_bytes"] <= mem_cap
        assert s["spool_writes"] == len(objs) and s["spool_evictions"] == 3
        fetched = origin.ops("get")
        # the last five are held (on the spool; only the newest few also in memory): no refetch
        for k in list(objs)[-5:]:
            assert c.get(k) == objs[k]
        assert origin.ops("get") == fetched
        assert c.get(CHUNK.format(0)) == objs[CHUNK.format(0)]  # evicted from both: fetched again
        assert origin.ops("get") == fetched + 1
    assert not any(spool.iterdir())  # the relay's spool is removed at shutdown


def test_keep_versions_drops_the_least_recently_read(origin):
    """Past keep_versions the version children read least recently is dropped (not the
    lowest number): a child catching up on v1 brings it back, and v2, read before v3, goes."""
    keys = [f"v/{v:08d}/chunks/r000-00000.dcr" for v in (1, 2, 3)]
    for i, k in enumerate(keys):
        origin.inner.put(k, bytes([i]) * 1000)
    with RelayThread(origin, RelayConfig(keep_versions=2)) as r:
        c = client(r.uri)
        for k in keys:
            c.get(k)
        s = r.stats()
        assert s["versions"] == [2, 3] and s["versions_dropped"] == 1 and s["cached_objects"] == 2
        c.get(keys[2])  # v3 read again: v2 is now the least recently read
        assert c.get(keys[0]) == bytes([0]) * 1000
        assert origin.calls["get", keys[0]] == 2 and r.stats()["versions"] == [1, 3]
        assert c.get(keys[0]) == bytes([0]) * 1000 and origin.calls["get", keys[0]] == 2  # cached again


def test_planted_far_versions_do_not_evict_the_versions_children_read(origin):
    """A writer without the key plants v/99999990..99 and something reads each once (as the
    fault campaign's driver does through a relay): the real versions children keep reading
    stay cached; 5 chunks x 3 children cost 5 upstream fetches, not 15.  Control: the
    planted versions were admitted (each evicted something), so the window was attacked."""
    real = [f"v/00000007/chunks/r000-{i:05d}.dcr" for i in range(5)]
    for k in real:
        origin.inner.put(k, os.urandom(512))
    far = [f"v/{99999990 + i:08d}/chunks/x" for i in range(10)]
    for k in far:
        origin.inner.put(k, b"junk")
    with RelayThread(origin, RelayConfig(keep_versions=4)) as r:
        children = [client(r.uri) for _ in range(3)]
        for k in real:
            children[0].get(k)
        for k in far:  # interleaved with the children's reads of the real version
            children[0].get(k)
            for ch in children:
                for rk in real:
                    ch.get(rk)
        assert sum(origin.calls["get", k] for k in real) == len(real)
        assert r.stats()["versions_dropped"] >= len(far) - 3  # the planted ones did come in
        assert 7 in r.stats()["versions"]


def test_planted_versions_read_all_at_once_keep_the_confirmed_ones(origin):
    """The fault campaign's planted_keys attack: children read v4..v7 (manifest and chunk
    each), then 10 planted far versions are read at once.  Versions whose manifest a child
    read are confirmed: the planted ones take at most the least recently read confirmed
    version's slot (v4) and then replace each other; v5..v7 stay cached and cost no upstream
    fetch when read again.  Control: with nothing confirmed (chunks read, no manifest) the
    same attack pushes every real version out."""
    for confirm in (True, False):
        inner = origin.inner
        real = {v: (f"v/{v:08d}/MANIFEST.json", f"v/{v:08d}/chunks/r000-00000.dcr") for v in (4, 5, 6, 7)}
        for m, c in real.values():
            inner.put(m, b"{}")
            inner.put(c, os.urandom(256))
        far = [f"v/{99999980 + i:08d}/chunks/x" for i in range(10)]
        for k in far:
            inner.put(k, b"junk")
        with RelayThread(origin, RelayConfig(keep_versions=4)) as r:
            c = client(r.uri)
            for m, ch in real.values():
                if confirm:
                    c.get(m)
                c.get(ch)
            for k in far:
                c.get(k)
            held = r.stats()["versions"]
            if confirm:
                assert [v for v in held if v < 99999980] == [5, 6, 7] and len(held) == 4
                before = origin.ops("get")
                for v in (5, 6, 7):
                    c.get(real[v][1])
                assert origin.ops("get") == before
            else:
                assert all(v >= 99999980 for v in held)  # the control: every real one pushed out


def _stalled_get(address: tuple[str, int], key: str) -> socket.socket:
    """A child that asks for ``key`` and then never reads (a small receive buffer, so
    the kernel cannot absorb the object either)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    s.connect(address)
    s.sendall(f"GET /v1/object/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def test_stalled_child_costs_a_socket_buffer_not_a_copy(origin):
    big = os.urandom(24 << 20)
    origin.inner.put(CHUNK.format(0), big)
    other = os.urandom(14 << 20)  # does not fit beside the pinned 24 MiB under 36 MiB
    origin.inner.put(CHUNK.format(1), other)
    cap = 36 << 20
    with RelayThread(origin, RelayConfig(max_memory_bytes=cap, send_timeout_s=60, admit_wait_s=0.2)) as r:
        stalled = _stalled_get(r.relay.address, CHUNK.format(0))
        try:
            wait_for(lambda: r.stats()["sending"], "the stalled send to start")

            def sent():
                return r.stats()["sending"][0]["sent"]

            before = -1
            while sent() != before:  # until the relay's writes block on the full socket
                before = sent()
                time.sleep(0.3)
            print("stalled child: sent", sent(), "of", len(big))
            assert sent() < len(big) // 2  # aiohttp drained: the rest was not pushed into buffers
            s = r.stats()
            assert s["memory_bytes"] <= len(big) + 64 and s["memory_peak_bytes"] <= cap
            # the pinned copy stays shared: another child is served the same object meanwhile
            assert client(r.uri).get(CHUNK.format(0)) == big
            # and an object that does not fit beside the pinned one is refused, not buffered
            with pytest.raises(StoreError, match="HTTP 503"):
                client(r.uri).get(CHUNK.format(1))
            assert r.stats()["memory_peak_bytes"] <= cap
        finally:
            stalled.close()
        wait_for(lambda: not r.stats()["sending"], "the stalled send to end")
        assert client(r.uri).get(CHUNK.format(1)) == other  # unpinned: evictable, admitted now
        assert r.stats()["memory_peak_bytes"] <= cap


def test_stalled_child_is_cut_off_after_send_timeout(origin):
    origin.inner.put(CHUNK.format(0), os.urandom(16 << 20))
    with RelayThread(origin, RelayConfig(send_timeout_s=0.5)) as r:
        stalled = _stalled_get(r.relay.address, CHUNK.format(0))
        try:
            wait_for(lambda: r.stats()["send_timeouts"] == 1, "the send timeout")
            wait_for(lambda: not r.stats()["sending"], "the send to end")
            e = r.call(lambda: r.relay.cache.entries[CHUNK.format(0)])
            assert e.pins == 0
        finally:
            stalled.close()


# ---------------------------------------------------------------------------- writes and bad input
def test_put_writes_through_only_small_acks(origin):
    with RelayThread(origin) as r0, RelayThread(client(r0.uri)) as r1:
        c = client(r1.uri)
        c.put("acks/rx0/00000001.json", b'{"ok": true}')  # through two relays
        assert origin.inner.get("acks/rx0/00000001.json") == b'{"ok": true}'
        with pytest.raises(StoreError, match="HTTP 403"):
            c.put("HEAD.json", b"{}")
        with pytest.raises(StoreError, match="HTTP 403"):
            c.put("v/00000001/chunks/r000-00000.dcr", b"x")
        with pytest.raises(ObjectTooLarge):
            c.put("acks/rx0/00000002.json", b"x" * (MAX_PUT_BYTES + 1))
        c.put("acks/rx0/00000003.json", b"x" * MAX_PUT_BYTES)  # exactly the limit passes
        for junk in ("acks/rx0/x.json", "acks/rx0/00000001.json/y", "acks/a/b/00000001.json", "acks/join.d/a/b.json"):
            with pytest.raises(StoreError, match="HTTP 403"):  # only the shapes of an ack and a join request
                c.put(junk, b"{}")
        c.put("acks/join.d/rx0.json", b"{}")
        with pytest.raises(StoreError, match="HTTP 403"):
            c.delete("acks/rx0/00000001.json")
        assert not origin.inner.exists("HEAD.json") and not origin.inner.exists("acks/rx0/00000002.json")
        assert origin.inner.exists("acks/rx0/00000003.json") and origin.inner.exists("acks/rx0/00000001.json")
        assert r0.stats()["acks_forwarded"] == 3 and r1.stats()["acks_forwarded"] == 3


def test_writes_through_are_rate_limited(origin):
    """Past the burst (4 x put_rate) a write through is answered 429 (the child writes to
    its next upstream); tokens come back at put_rate.  Control: the burst itself passes."""
    with RelayThread(origin, RelayConfig(put_rate=5.0)) as r:
        c = client(r.uri, retries=0)
        for i in range(20):  # the burst
            c.put(f"acks/rx0/{i:08d}.json", b"{}")
        with pytest.raises(StoreError, match="HTTP 429"):
            c.put("acks/rx0/00000099.json", b"{}")
        assert r.stats()["puts_throttled"] == 1 and not origin.inner.exists("acks/rx0/00000099.json")
        time.sleep(0.5)  # 2.5 tokens back
        c.put("acks/rx0/00000099.json", b"{}")


def test_connections_over_the_cap_are_refused_at_once(origin):
    """max_connections children at once; one more gets a 503 and a closed socket (it cannot
    hold a file descriptor).  Idle connections are closed after idle_timeout_s."""
    import socket

    origin.inner.put("RUN.json", b"{}")
    with RelayThread(origin, RelayConfig(max_connections=8, idle_timeout_s=1.0)) as r:
        idle = [socket.create_connection(r.relay.address, timeout=5) for _ in range(8)]
        time.sleep(0.2)
        extra = socket.create_connection(r.relay.address, timeout=5)
        assert extra.recv(100).startswith(b"HTTP/1.1 503") and extra.recv(100) == b""
        assert r.stats()["connections_refused"] == 1
        time.sleep(1.8)  # the idle ones (no request, or half a header line) are closed
        idle[0].sendall(b"GET /v1/health HTTP/1.1\r\nHo")
        assert all(s.recv(100) == b"" for s in idle)
        assert client(r.uri).get("RUN.json") == b"{}"  # control: a child gets in again
        for s_ in idle + [extra]:
            s_.close()


def test_a_list_over_max_list_keys_is_refused_before_parsing(origin, monkeypatch):
    from nemo_dcr.transport import relay as relay_mod
    from nemo_dcr.transport import relay_client as rc_mod

    for i in range(12):
        origin.inner.put(f"v/00000001/chunks/r000-{i:05d}.dcr", b"x")
    for where in (relay_mod.node, relay_mod.http):  # the cut-through bound and the 413
        monkeypatch.setattr(where, "MAX_LIST_KEYS", 10)
    with RelayThread(origin) as r:
        c = client(r.uri)
        with pytest.raises(ObjectTooLarge):  # the relay: 413, an answer
            c.list("v/00000001/chunks/")
        assert len(c.list("v/00000001/chunks/", limit=5)) == 5 and r.stats()["lists_too_long"] == 1
        for where in (relay_mod.node, relay_mod.http):
            monkeypatch.setattr(where, "MAX_LIST_KEYS", 100)
        monkeypatch.setattr(rc_mod, "MAX_LIST_KEYS", 10)  # a relay that answers more than a child takes
        time.sleep(0.1)
        with pytest.raises(StoreError, match="list answer of over 10 keys"):
            c.list("v/00000001/chunks/")
        monkeypatch.setattr(rc_mod, "MAX_LIST_KEYS", 12)
        assert len(c.list("v/00000001/chunks/")) == 12  # control


def test_a_changed_run_record_drops_the_cache(origin):
    """The prefix is reused by another run (RUN.json replaced): within run_check_s the relay
    drops what it cached and serves the new run's objects.  Control: unchanged, nothing is
    dropped."""
    origin.inner.put("RUN.json", b'{"run": 1}')
    origin.inner.put("init/config.json", b"one")
    with RelayThread(origin, RelayConfig(run_check_s=0.3)) as r:
        c = client(r.uri)
        assert c.get("RUN.json") == b'{"run": 1}' and c.get("init/config.json") == b"one"
        time.sleep(1.5)
        assert r.stats()["run_changes"] == 0 and r.stats()["cached_objects"] == 2
        origin.inner.delete("RUN.json")
        origin.inner.put("init/config.json", b"two")
        origin.inner.put("RUN.json", b'{"run": 2}')
        deadline = time.monotonic() + 10
        while r.stats()["run_changes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get("init/config.json") == b"two" and c.get("RUN.json") == b'{"run": 2}'


@pytest.mark.parametrize("path", [
    "/v1/object/a%20b", "/v1/object/a//b", "/v1/object/", "/v1/object/a/./b", "/v1/object/x%2F..%2Fy",
    "/v1/list?prefix=a%20b", "/v1/object/RUN.json?max_bytes=-1", "/v1/object/RUN.json?max_bytes=x",
])
def test_bad_requests_are_400(origin, path):
    origin.inner.put("RUN.json", b"{}")
    with RelayThread(origin) as r:
        conn = http.client.HTTPConnection(*r.relay.address, timeout=10)  # sends the path as given
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 400, (path, resp.status, body)
        assert body.count(b"\n") == 1
        conn.request("GET", "/v1/object/RUN.json")
        assert conn.getresponse().status == 200
        conn.close()


def test_upstream_failure_is_502_and_transient(tmp_path):
    dead = RelayStore("relay://127.0.0.1:9", policy=StorePolicy(timeout_s=2, retries=0))
    with RelayThread(dead) as r:
        with urllib3.PoolManager() as http:
            resp = http.request("GET", r.uri.replace("relay", "http") + "/v1/object/RUN.json")
        assert resp.status == 502 and b"upstream failed" in resp.data
        with pytest.raises(StoreError, match="after 2 attempts"):  # 5xx: retried by the child's policy
            client(r.uri, retries=1).get("RUN.json")


def test_failover_upstream_list(tmp_path):
    """``--upstream relay://dead,ORIGIN``: the relay reads on from the origin and says so."""
    from nemo_dcr.transport.store import open_store

    origin = LocalDirStore(str(tmp_path / "origin"))
    payload = os.urandom(1 << 20)
    origin.put(CHUNK.format(0), payload)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"relay://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    up = open_store(f"{dead},{origin.uri}", timeout_s=2, retries=0)
    with RelayThread(up) as r:
        assert client(r.uri).get(CHUNK.format(0)) == payload
        s = r.stats()
    assert s["current_upstream"] == origin.uri
    rows = {u["uri"]: u for u in s["upstreams"]}
    assert rows[dead]["failures"] >= 1 and rows[dead]["is_relay"] and rows[dead]["chunk_bytes_read"] == 0
    assert rows[origin.uri]["chunk_bytes_read"] == len(payload)


class CannedServer:
    """A loopback server that answers every request with the same raw bytes (then closes),
    or with nothing at all (``answer=None``: a stalled relay)."""

    def __init__(self, answer: bytes | None, *, delay_s: float = 0.0):
        self.answer, self.requests, self.delay_s = answer, 0, delay_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.uri = f"relay://127.0.0.1:{self.sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    break
                data += piece
            self.requests += 1
            if self.answer is None:
                self._held.append(conn)
                continue
            time.sleep(self.delay_s)
            conn.sendall(self.answer)
            conn.close()

    def close(self):
        self.sock.close()
        for c in self._held:
            c.close()


@pytest.mark.parametrize("answer, error, attempts", [
    (None, "timed out|Timeout", 2),  # stalled: connect succeeds, no answer within timeout_s
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789", "IncompleteRead|Protocol|Content-Length", 2),
    (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\noops\n", "HTTP 500", 2),
    (b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\n\r\n", "HTTP 429", 2),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 4\r\n\r\nbad\n", "HTTP 400: bad", 1),  # not retried
])
def test_client_classifies_failures(answer, error, attempts):
    srv = CannedServer(answer)
    try:
        c = RelayStore(srv.uri, policy=StorePolicy(timeout_s=0.5, retries=1, backoff_s=0.01))
        with pytest.raises(StoreError, match=error) as e:
            c.get("RUN.json")
        assert e.value.attempts == attempts and srv.requests == attempts
    finally:
        srv.close()


def test_client_waits_longer_for_a_bigger_object():
    """A relay answers once it holds the whole object: a get with max_bytes waits
    timeout_s + max_bytes / min_bytes_per_s for the first byte (here 0.3 + 3.0 s for a
    0.8 s wait); without a bound it waits timeout_s (the control: it times out)."""
    # Connection: close -- the server closes after answering; a client that pooled the socket
    # could otherwise reuse it before it saw the close (seen under load: a reset, not a timeout)
    srv = CannedServer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\n0123456789",
                       delay_s=0.8)
    try:
        c = RelayStore(srv.uri, policy=StorePolicy(timeout_s=0.3, retries=0, min_bytes_per_s=1000))
        assert c.get(CHUNK.format(0), max_bytes=3000) == b"0123456789"
        with pytest.raises(StoreError, match="timed out|Timeout"):
            c.get(CHUNK.format(0))
    finally:
        srv.close()


def test_client_refuses_a_body_over_max_bytes():
    """A relay that ignores max_bytes (chunked, no Content-Length) is cut at max_bytes + 1."""
    body = b"x" * 5000
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + \
        f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    srv = CannedServer(chunked)
    try:
        c = RelayStore(srv.uri, policy=StorePolicy(timeout_s=2, retries=0))
        with pytest.raises(ObjectTooLarge, match="grew to at least 101 bytes"):
            c.get("RUN.json", max_bytes=100)
        assert len(c.get("RUN.json")) == len(body)  # negative control: without the cap it reads all
    finally:
        srv.close()


def test_client_uri_forms():
    for bad in ("relay://host", "relay://h:1/path", "ftp://h:1", "relay://u@h:1", "http://h:1?x=1"):
        with pytest.raises(ValueError):
            RelayStore(bad)
    assert RelayStore("https://h:8443").base == "https://h:8443/v1"
    assert RelayStore("relay://[::1]:7000").base == "http://[::1]:7000/v1"
    assert RelayStore("http://h:1").is_relay


@pytest.mark.parametrize("argv", [
    [],
    ["--upstream", "/tmp/x"],
    ["--upstream", "/tmp/x", "--listen", "nope"],
    ["--upstream", "/tmp/x", "--listen", "127.0.0.1:99999"],
    ["--upstream", "a,,b", "--listen", "127.0.0.1:0"],
    ["--upstream", "/tmp/x", "--listen", "127.0.0.1:0", "--max-memory-bytes", "lots"],
    ["--upstream", "/tmp/x", "--listen", "127.0.0.1:0", "--keep-versions", "0"],
    ["--upstream", "/tmp/x", "--listen", "127.0.0.1:0", "--prefetch", "64"],
    ["--upstream", "/tmp/x", "--listen", "127.0.0.1:0", "--progress-s", "-1"],
    ["--upstream", "relay://host-without-port", "--listen", "127.0.0.1:0"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert relay_mod.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("nemo-dcr relay: ")


def test_byte_counts():
    assert relay_mod.byte_count("1024") == 1024
    assert relay_mod.byte_count("512M") == 512 << 20
    assert relay_mod.byte_count("1GiB") == 1 << 30
    assert relay_mod.byte_count("64k") == 64 << 10
    with pytest.raises(ValueError):
        relay_mod.byte_count("1.5G")


# ---------------------------------------------------------------------------- processes
def _start_relay(upstream: str, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli", "relay", "--upstream", upstream,
                             "--listen", "127.0.0.1:0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"relay did not start: {proc.stderr.read()}")
    ready = json.loads(line)
    assert ready["relay"] == "listening" and ready["upstreams"] == upstream.split(",") and ready["ts"] > 0
    return proc, "relay://" + ready["address"]


def test_relay_processes_tree_and_sigterm(tmp_path):
    origin = LocalDirStore(str(tmp_path / "origin"))
    a, b = os.urandom(3 << 20), os.urandom(3 << 20)
    origin.put(CHUNK.format(0), a)
    origin.put(CHUNK.format(1), b)
    t0 = time.time()
    p0, uri0 = _start_relay(origin.uri, "--spool", str(tmp_path / "spool0"), "--progress-s", "0.2")
    try:
        p1, uri1 = _start_relay(uri0, "--max-memory-bytes", "16M")
        try:
            c = client(uri1)
            assert c.list("v/00000001/chunks/") == [CHUNK.format(0), CHUNK.format(1)]
            got = [c.get(CHUNK.format(0)), c.get(CHUNK.format(1))]
            assert got == [a, b] and got[0] != got[1]
            c.put("acks/rx/00000001.json", b"{}")
            assert origin.get("acks/rx/00000001.json") == b"{}"
            with urllib3.PoolManager() as http:
                s0 = json.loads(http.request("GET", uri0.replace("relay", "http") + "/v1/stats").data)
            assert s0["upstream_chunk_bytes"] == len(a) + len(b) and s0["served_bytes"] == len(a) + len(b)
        finally:
            p1.send_signal(signal.SIGTERM)
            assert p1.wait(20) == 0
        stopped = json.loads(p1.stderr.read().strip().splitlines()[-1])
        assert stopped["relay"] == "stopped" and stopped["served_bytes"] == len(a) + len(b)
        time.sleep(1.0)  # a few 0.2 s progress ticks after the bytes moved (SIGTERM may beat the next one)
    finally:
        p0.send_signal(signal.SIGTERM)
        assert p0.wait(20) == 0
    assert not any((tmp_path / "spool0").iterdir())
    events = [json.loads(line) for line in p0.stderr.read().splitlines() if line.startswith("{")]
    stamps = [e["ts"] for e in events]  # wall-clock seconds on every event line, in print order
    assert stamps == sorted(stamps) and t0 - 0.001 <= stamps[0] and stamps[-1] <= time.time() + 0.001
    progress = [e for e in events if e["relay"] == "progress"]
    assert progress and set(relay_mod.cli.PROGRESS_FIELDS) <= set(progress[-1])
    assert 0 < max(e["served_bytes"] for e in progress) <= len(a) + len(b)
    assert events[-1]["relay"] == "stopped"


def test_a_mid_relay_killed_during_a_version_is_routed_around(tmp_path):
    """Three levels: root r0 (in-process, over the counting origin), mid r1 (a ``nemo-dcr
    relay`` process, upstreams ``r0,origin``) and leaf r2 (in-process, upstreams
    ``r1,r0,origin``, as bench_relay_link.py lists them), a reader under r2.  The version's
    last four chunks are held at the origin; the reader reads the first four, r1 is
    SIGKILLed, the origin lets go: r2 fetches the rest from its grandparent r0, which
    serves them from its own flight or cache, so the reader gets every chunk bit for bit
    and the origin is read once per chunk.  Control: leaf r2x, whose only upstream is r1,
    read the first four as well and fails on the rest."""
    from nemo_dcr.transport.store import open_store

    origin = CountingStore(LocalDirStore(str(tmp_path / "origin")))
    keys = [CHUNK.format(i) for i in range(8)]
    payloads = {k: os.urandom(256 << 10) for k in keys}
    for k in keys:
        origin.put(k, payloads[k])
    early, late = keys[:4], keys[4:]
    origin.gate, origin.gated = threading.Event(), set(late)
    with RelayThread(origin) as r0:
        p1, uri1 = _start_relay(f"{r0.uri},{origin.uri}")
        try:
            with RelayThread(open_store(f"{uri1},{r0.uri},{origin.uri}")) as r2, \
                    RelayThread(RelayStore(uri1, policy=StorePolicy(timeout_s=2, retries=0))) as r2x:
                reader, control = client(r2.uri), client(r2x.uri)
                assert reader.list("v/00000001/chunks/") == keys == control.list("v/00000001/chunks/")
                assert [reader.get(k) for k in early] == [payloads[k] for k in early]
                assert [control.get(k) for k in early] == [payloads[k] for k in early]
                wait_for(lambda: all(origin.calls["get", k] == 1 for k in late), "r0 to ask the origin for the rest")
                assert r2.stats()["upstream_chunk_bytes"] == 4 * (256 << 10)  # the rest is in flight, not held
                p1.kill()  # mid-version: r1 and r2 are waiting on r0 for the held chunks
                assert p1.wait(20) == -signal.SIGKILL
                origin.gate.set()
                got = {k: reader.get(k) for k in late}
                with pytest.raises(StoreError):
                    control.get(late[0])
                s0, s2 = r0.stats(), r2.stats()
        finally:
            if p1.poll() is None:
                p1.kill()
            p1.wait(20)
    assert got == {k: payloads[k] for k in late} and len(set(got.values())) == len(late)
    assert {k: origin.calls["get", k] for k in keys} == {k: 1 for k in keys}  # each chunk left the origin once
    assert s0["upstream_chunk_bytes"] == 8 * (256 << 10)
    rows = {u["uri"]: u for u in s2["upstreams"]}
    assert rows[uri1]["failures"] >= 1 and rows[uri1]["chunk_bytes_read"] == 4 * (256 << 10)
    assert rows[r0.uri]["chunk_bytes_read"] == 4 * (256 << 10)  # the rest came from the grandparent
    assert rows[origin.uri]["chunk_bytes_read"] == 0 and s2["current_upstream"] == r0.uri


def test_sigterm_does_not_wait_for_a_stalled_upstream():
    stalled = CannedServer(None)
    try:
        proc, uri = _start_relay(stalled.uri, "--timeout-s", "60", "--retries", "0")
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client(uri).get, "RUN.json")
            wait_for(lambda: stalled.requests == 1, "the relay to ask its stalled upstream")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0  # not the 60 s the upstream call may take
            with pytest.raises(StoreError):
                fut.result(15)
    finally:
        stalled.close()


def test_relay_over_s3(s3_bucket):
    from nemo_dcr.transport.store import open_store

    s3 = open_store(s3_bucket + "/run", timeout_s=10, retries=1)
    payload = os.urandom(1 << 20)
    s3.put(CHUNK.format(0), payload)
    counting = CountingStore(s3)
    with RelayThread(counting) as r:
        c = client(r.uri)
        assert c.list("v/00000001/chunks/") == [CHUNK.format(0)]
        assert c.get(CHUNK.format(0)) == payload
        assert c.get(CHUNK.format(0)) == payload
        c.put("acks/rx/00000001.json", b"{}")
    assert counting.calls["get", CHUNK.format(0)] == 1
    assert s3.get("acks/rx/00000001.json") == b"{}"


# ---------------------------------------------------------------------------- the protocol through a tree
def test_protocol_end_to_end_through_a_relay_tree(tmp_path):
    """A signed run (RefitSender on the origin directory) followed by two receivers, one
    under relay r0 and one under r1 -> r0: every version commits, both end bit-exact
    (integer views, with a control), the acks reached the origin through the relays, and
    every chunk crossed each relay's upstream link exactly once."""
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
    from protocol_helpers import Rx, _sender, _step, bits_of

    from nemo_dcr.protocol.manifest import Manifest, manifest_key
    from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
    from nemo_dcr.transport.store import open_store

    key = new_key_file(str(tmp_path / "key"))
    rng = np.random.default_rng(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, origin = _sender(tmp_path, {"w": w}, key, receivers=("r0", "r1"), chunk_bytes=512)
    with RelayThread(origin) as r0, RelayThread(open_store(f"{r0.uri},{origin.uri}")) as r1:
        rx0 = Rx("r0", open_store(f"{r0.uri},{origin.uri}"), key, sender.run_id, w).start(until=3)
        rx1 = Rx("r1", open_store(f"{r1.uri},{r0.uri},{origin.uri}"), key, sender.run_id, w).start(until=3)
        v1 = None
        for v in (1, 2, 3):
            _step(w, rng)
            assert sender.refit(v).committed
            v1 = bits_of(w) if v == 1 else v1
        rx0.join()
        rx1.join()
        s0, s1 = r0.stats(), r1.stats()
    for rx in (rx0, rx1):
        np.testing.assert_array_equal(rx.w, bits_of(w))
    assert not np.array_equal(v1, bits_of(w))  # control: the versions differ
    sealer = Sealer(load_key(key))
    manifests = [Manifest.from_json(origin.get(manifest_key(v)), sealer) for v in (1, 2, 3)]
    chunk_bytes = sum(c.nbytes for m in manifests for c in m.chunks)
    assert chunk_bytes > 0
    assert s0["upstream_chunk_bytes"] == chunk_bytes  # origin -> r0: once
    assert s1["upstream_chunk_bytes"] == chunk_bytes  # r0 -> r1: once
    assert s0["acks_forwarded"] == 6 and s1["acks_forwarded"] == 3
    assert s0["upstreams"][0]["failures"] == 0 and s1["current_upstream"] == r0.uri


def _trickling_relay(pieces: int, pause_s: float):
    """A fake relay on loopback (a raw socket server: no real relay stalls on purpose) that
    answers every GET with a 200 for 64 KiB and sends the body in ``pieces`` pieces,
    ``pause_s`` apart, then stalls for ever; returns (uri, stop)."""
    import socket

    body = os.urandom(64 << 10)
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Dcr-Tag: t\r\nX-Dcr-Size: %d\r\n\r\n"
                             % (len(body), len(body)))
                step = len(body) // pieces
                for i in range(pieces):
                    if stop.wait(pause_s if i else 0):
                        break
                    conn.sendall(body[i * step:(i + 1) * step if i < pieces - 1 else len(body)])
                stop.wait(60)

    threading.Thread(target=serve, daemon=True).start()
    return f"relay://127.0.0.1:{srv.getsockname()[1]}", body, lambda: (stop.set(), srv.close())


def test_a_body_that_stalls_after_it_began_fails_the_attempt_at_timeout_s():
    """The child allows timeout_s + max_bytes / min_bytes_per_s for the answer to begin (a
    relay answers once it holds the whole object), but once the body flows a stall of
    timeout_s fails the attempt: here within ~3 s, where the budget for a 1 GiB bound is
    over 1000 s.  Control: a body that keeps moving (a piece every 0.6 s, 3 s in all)
    arrives whole under timeout_s=1."""
    uri, body, stop = _trickling_relay(pieces=2, pause_s=3600)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="timed out|Read timed out|ReadTimeout"):
            client_t(uri).get("init/model.safetensors", max_bytes=1 << 30)
        assert time.monotonic() - t0 < 10
    finally:
        stop()
    uri, body, stop = _trickling_relay(pieces=5, pause_s=0.6)
    try:
        assert client_t(uri).get("init/model.safetensors", max_bytes=1 << 30) == body
    finally:
        stop()


def client_t(uri: str) -> RelayStore:
    return RelayStore(uri, policy=StorePolicy(timeout_s=1.0, retries=0))


def test_https_relay_uri(origin, tmp_path, monkeypatch):
    """``https://`` children verify the server's certificate (here a self-signed one made
    trusted through SSL_CERT_FILE; the control: without it the call is refused)."""
    import datetime
    import ssl

    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(k, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    payload = os.urandom(1 << 20)
    origin.inner.put(CHUNK.format(0), payload)
    with RelayThread(origin, ssl_context=ctx, host="localhost") as r:
        uri = f"https://localhost:{r.relay.address[1]}"
        with pytest.raises(StoreError, match="CERTIFICATE_VERIFY_FAILED|SSL") as e:
            client(uri, retries=2).get(CHUNK.format(0))  # control: an untrusted certificate is refused
        assert e.value.attempts == 1  # for good: not retried
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
        assert client(uri).get(CHUNK.format(0)) == payload
