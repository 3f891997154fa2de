"""An ordered list of upstreams behind one ``ObjectStore``: re-parenting for relays and
receivers.

A node of the relay tree (``docs/relay.md``) reads from its parent relay, and when the
parent fails, stalls or serves bytes that fail their check, from the next upstream in its
list (the grandparent, ..., the origin store).  ``FailoverStore`` is that list:

* every call goes to the **current** upstream; one that fails there (a ``StoreError``
  after that upstream's own bounded attempts: refused connection, timeouts, 5xx) makes
  the next upstream current and the call runs again there.  Answers are not failures:
  not-found, too-large and invalid keys pass through from the upstream that gave them;
* ``fetch_verified(store, key, max_bytes=, check=)`` fetches an object whose expected
  bytes the caller can check (chunks: size and sha256 from the signed manifest): the first
  copy that passes ``check``, in list order; the upstreams before it that served bad bytes
  are demoted (those that had none, once they still have none ``LAG_GRACE_S`` later).
  With every upstream tried the last reason is raised;
* an upstream left for a failure is not used again for ``retry_after_s``; after that it
  is preferred again (the list's order is the tree's shape), so a tree heals back.  One
  left for *bad bytes* (a lie: corrupt chunks, a forged or hidden document, an ack it did
  not forward) again within ``STRIKE_MEMORY`` rests of the last such demotion rests twice
  as long each time, up to ``MAX_REST_S``: a relay that drops every ack costs one version
  per strike, and strikes come ever rarer (1 + log2(MAX_REST_S / retry_after_s) of them,
  7 at the defaults, before it rests an hour);
* what the node already holds is never fetched again: the store keeps nothing, the
  caller (relay spool, receiver's decoded chunks) does, and only asks for what it lacks.

**Second opinions** (``second_opinion``): a caller that can tell a genuine copy of a
document (it opens with the run's key and says what the caller's signed evidence expects)
asks every upstream in order for one when the upstream it read from rejected, refused
(too large) or did not have it.  Upstreams that disagreed are demoted only when another
one serves a genuine copy: a document that no upstream has (not written yet) or that fails
everywhere (a forgery planted at the origin, which every faithful relay passes on) demotes
nobody.  A bad or oversized copy demotes at once; a *not-found* may be lag (a relay reuses
a not-found for its freshness window, 50 ms by default, and a deeper relay adds its
parent's), so that upstream is asked again ``LAG_GRACE_S`` later and demoted only if it
still has nothing (one ``stat``; the reader meanwhile uses the genuine copy).  ``answered_by()`` names the upstream that answered this thread's last call, so a
reader can key what it caches to the upstream it came from, and ``demote`` lets a caller
leave an upstream on evidence of its own (an ack the trainer never saw).

Writes (``put``: acks through a relay) follow the same order.  Counters per upstream
(``upstream_stats``) tell how many bytes each served, chunk bytes apart: the demo's
``origin_read_bytes`` and the relay benchmark read them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nemo_dcr.errors import FormatError, TransportError, ValidationError
from nemo_dcr.transport.store.base import ObjectInfo, ObjectNotFound, ObjectStore, StoreError, list_sizes, put_if_absent

_log = logging.getLogger(__name__)

LAG_GRACE_S = 2.0
"""How long an upstream may still answer "not found" for a document another upstream
already served genuinely before it is demoted as hiding it (a relay's not-found freshness
is 50 ms by default; two seconds covers a three-level tree under load).  The cost of a
relay that hides documents: this long per document until it is left, then nothing for
``retry_after_s``."""
MAX_REST_S = 3600.0
"""Longest rest of an upstream that keeps lying (see the module docstring)."""
STRIKE_MEMORY = 4
"""A lie counts as a repeat (doubling the rest) when it comes within this many of its
last rest's lengths after that rest ended; later, the rest starts again at
``retry_after_s``."""
SUSPECTS = 256
"""Pending "not found here, genuine elsewhere" re-checks kept (the oldest are dropped)."""


class VerificationFailed(StoreError):
    """Every upstream served bytes that failed the caller's check; the message names the key
    and the last upstream's reason."""


@dataclass
class UpstreamStats:
    uri: str
    is_relay: bool
    bytes_read: int = 0
    failures: int = 0
    bad_bytes: int = 0
    """Objects whose bytes failed the caller's check."""
    down_until: float = 0.0
    rest_s: float = 0.0
    """The length of the last rest after bad bytes (0: none yet, or forgiven)."""


def is_relay(store: ObjectStore) -> bool:
    return bool(getattr(store, "is_relay", False))


class FailoverStore:
    """``ObjectStore`` over ``stores``, tried in order (see the module docstring)."""

    is_relay = False  # a list is a relay's client only through its members

    def __init__(self, stores: Sequence[ObjectStore], *, retry_after_s: float = 30.0,
                 lag_grace_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not stores:
            raise ValidationError("a failover store needs at least one upstream")
        if retry_after_s < 0:
            raise ValidationError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.stores = list(stores)
        self.uri = ",".join(s.uri for s in self.stores)
        self.retry_after_s = retry_after_s
        self.lag_grace_s = LAG_GRACE_S if lag_grace_s is None else lag_grace_s
        self._clock = clock
        self._suspects: dict[tuple[int, str], tuple[float, str]] = {}  # (upstream, key) -> (due, who had it)
        self._lock = threading.Lock()
        self._stats = [UpstreamStats(s.uri, is_relay(s)) for s in self.stores]
        self.switches = 0
        self._last: int | None = None
        self._tls = threading.local()  # .source: uri of the upstream that answered this thread's last call

    # ------------------------------------------------------------------ bookkeeping
    def _order(self) -> list[int]:
        """Upstreams to try, best first: those not resting after a failure in list order,
        then the resting ones (a node whose every upstream failed recently still tries)."""
        now = self._clock()
        if self._suspects:
            self._recheck(now)
        with self._lock:
            up = [i for i, s in enumerate(self._stats) if s.down_until <= now]
            down = sorted((i for i, s in enumerate(self._stats) if s.down_until > now),
                          key=lambda i: self._stats[i].down_until)
        return up + down

    def _served(self, i: int, nbytes: int) -> None:
        with self._lock:
            st = self._stats[i]
            st.bytes_read += nbytes
            if self._last is not None and self._last != i:
                self.switches += 1
                _log.warning("%s: now reading from %s (was %s)", self.uri, st.uri, self._stats[self._last].uri)
            self._last = i
        self._tls.source = st.uri

    def answered_by(self) -> str:
        """The uri of the upstream that answered this thread's last successful call ('' before any)."""
        return getattr(self._tls, "source", "")

    def demote(self, uri: str, why: str) -> bool:
        """Leave the upstream ``uri`` for ``retry_after_s`` on the caller's evidence (e.g. the
        trainer's signed decision says an ack written through it never arrived).  False when
        ``uri`` is not an upstream of this list, or the only one."""
        if len(self.stores) < 2:
            return False
        for i, st in enumerate(self._stats):
            if st.uri == uri:
                self._demote(i, why, bad_bytes=True)
                return True
        return False

    def _suspect(self, i: int, key: str, other: str) -> None:
        """Upstream ``i`` had no ``key`` while ``other`` served a genuine copy: lag or a lie;
        asked again ``lag_grace_s`` from now (:meth:`_recheck`)."""
        with self._lock:
            self._suspects.setdefault((i, key), (self._clock() + self.lag_grace_s, other))
            while len(self._suspects) > SUSPECTS:
                self._suspects.pop(next(iter(self._suspects)))

    def _recheck(self, now: float) -> None:
        """The suspects now due: still nothing at ``key`` -> demoted (it hides the
        document); a copy now -> it was lagging, forgotten.  A failing upstream is
        demoted as any failure is."""
        with self._lock:
            due = [(ik, v) for ik, v in self._suspects.items() if v[0] <= now]
            for ik, _ in due:
                del self._suspects[ik]
        for (i, key), (_, other) in due:
            try:
                there = self.stores[i].stat(key) is not None
            except (ObjectNotFound, FormatError, ValidationError):
                there = False
            except TransportError as e:
                self._demote(i, str(e))
                continue
            if not there:
                self._demote(i, f"{key}: still not found {self.lag_grace_s:g} s after {other} served "
                                f"a genuine copy", bad_bytes=True)

    def _demote(self, i: int, why: str, *, bad_bytes: bool = False) -> None:
        now = self._clock()
        with self._lock:
            st = self._stats[i]
            st.failures += 1
            rest = self.retry_after_s
            if bad_bytes:
                st.bad_bytes += 1
                if st.down_until > now:  # already resting: the same lie seen again, not a new strike
                    return
                repeat = st.rest_s > 0 and now - st.down_until <= STRIKE_MEMORY * st.rest_s
                rest = min(MAX_REST_S, 2 * st.rest_s) if repeat else self.retry_after_s
                st.rest_s = rest
            st.down_until = max(st.down_until, now + rest)
        _log.warning("%s: upstream %s left for %.0f s: %s", self.uri, st.uri, rest, why)

    @property
    def current(self) -> ObjectStore:
        return self.stores[self._order()[0]]

    def upstream_stats(self) -> list[dict]:
        """Per upstream; ``chunk_bytes_read`` is the member store's own count (the store that
        did the get counts chunk bytes, ``BoundedStore.chunk_bytes_read``)."""
        cur = self._order()[0]
        with self._lock:
            return [{"uri": s.uri, "is_relay": s.is_relay, "current": i == cur, "bytes_read": s.bytes_read,
                     "chunk_bytes_read": getattr(store, "chunk_bytes_read", 0), "failures": s.failures,
                     "bad_bytes": s.bad_bytes}
                    for i, (s, store) in enumerate(zip(self._stats, self.stores))]

    def origin_chunk_bytes(self) -> int:
        """Chunk bytes read from upstreams that are not relays (the origin store)."""
        return sum(getattr(s, "chunk_bytes_read", 0) for s in self.stores if not is_relay(s))

    # ------------------------------------------------------------------ the calls
    def _each(self, op: str, key: str, fn: Callable[[ObjectStore], object], size: Callable[[object], int]):
        last: TransportError | None = None
        for i in self._order():
            try:
                out = fn(self.stores[i])
            except (ObjectNotFound, FormatError, ValidationError):
                raise  # an answer (absent, too large, invalid key), not a failing upstream
            except TransportError as e:
                self._demote(i, str(e))
                last = e
                continue
            self._served(i, size(out))
            return out
        raise StoreError(f"{self.uri}: {op} {key!r} failed on every upstream; last: {last}",
                         uri=self.uri, op=op, key=key) from last

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._each("get", key, lambda s: s.get(key, max_bytes=max_bytes), len)

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        return self._each("get", key, lambda s: s.get_with_info(key, max_bytes=max_bytes), lambda r: len(r[0]))

    def stat(self, key: str) -> ObjectInfo | None:
        return self._each("stat", key, lambda s: s.stat(key), lambda r: 0)

    def exists(self, key: str) -> bool:
        return self._each("exists", key, lambda s: s.exists(key), lambda r: 0)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        return self._each("list", prefix, lambda s: s.list(prefix, limit=limit), lambda r: 0)

    def list_sizes(self, prefix: str, *, limit: int | None = None) -> list[tuple[str, int | None]]:
        return self._each("list", prefix, lambda s: list_sizes(s, prefix, limit=limit), lambda r: 0)

    def put(self, key: str, data: bytes) -> None:
        self._each("put", key, lambda s: s.put(key, data), lambda r: 0)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._each("put", key, lambda s: put_if_absent(s, key, data), lambda r: 0)

    def put_everywhere(self, key: str, data: bytes) -> list[str]:
        """``put`` through every upstream of the list, resting ones too: the uris that took
        it.  For a small signed object whose loss on one path costs a version (an ack after
        one was lost: the relay it went through may forward to a liar further up, which only
        the next loss would reveal).  In list order, not preference order: the last upstream
        (the origin, where the trainer reads) is written last, so a relay before it that
        forwards an altered copy does not overwrite the genuine one there.  Raises
        :class:`StoreError` when none took it."""
        took: list[str] = []
        last: TransportError | None = None
        for i in range(len(self.stores)):
            try:
                self.stores[i].put(key, data)
            except TransportError as e:
                self._demote(i, str(e))
                last = e
                continue
            took.append(self._stats[i].uri)
        if not took:
            raise StoreError(f"{self.uri}: put {key!r} failed on every upstream; last: {last}",
                             uri=self.uri, op="put", key=key) from last
        self._tls.source = took[0]
        return took

    def delete(self, key: str) -> None:
        self._each("delete", key, lambda s: s.delete(key), lambda r: 0)

    def get_verified(self, key: str, *, max_bytes: int | None, check: Callable[[bytes], str | None]) -> bytes:
        """``get`` whose bytes must pass ``check`` (None = good, else the reason): the first
        genuine copy any upstream serves, in order (:meth:`_first_genuine`).  Raises
        :class:`VerificationFailed` when no upstream served good bytes."""
        blob, _, reason, last = self._first_genuine(key, max_bytes=max_bytes, check=check)
        if blob is None:
            raise VerificationFailed(f"{self.uri}: {key!r}: no upstream served good bytes; last: {reason}",
                                     uri=self.uri, op="get", key=key) from last
        return blob

    def second_opinion(self, key: str, *, max_bytes: int | None, check: Callable[[bytes], str | None],
                       skip: Callable[[str, str], bool] | None = None) -> tuple[bytes, str] | None:
        """The first genuine copy of ``key`` any upstream serves, in order, with the uri of
        the upstream that served it; None when none does (:meth:`_first_genuine`).
        ``skip(uri, tag)``: an identity this caller already judged bad is not read again
        (one ``stat`` instead of a ``get``)."""
        blob, uri, _, _ = self._first_genuine(key, max_bytes=max_bytes, check=check, skip=skip)
        return None if blob is None else (blob, uri)

    def _first_genuine(self, key: str, *, max_bytes: int | None, check: Callable[[bytes], str | None],
                       skip: Callable[[str, str], bool] | None = None
                       ) -> tuple[bytes | None, str, str, TransportError | None]:
        """One walk down the list for a copy of ``key`` that passes ``check``: (its bytes or
        None, the uri that served it, the last reason an upstream gave, the last transport
        error).  An upstream that fails is demoted as any failing call's is.  The ones that
        had no genuine copy before the one that served it are demoted only once it did: at
        once for bad or oversized bytes, ``lag_grace_s`` later for a not-found that is still
        one then (:meth:`_suspect`: it may lag).  When no upstream serves a genuine copy
        nobody is demoted: the object may not exist yet, or was forged at the origin and
        every faithful relay passes it on."""
        disagreed: list[tuple[int, str | None]] = []  # reason; None: not found there
        reason, last = "no upstream answered", None
        for i in self._order():
            up = self.stores[i]
            try:
                if skip is not None:
                    info = up.stat(key)
                    if info is None:
                        disagreed.append((i, None))
                        continue
                    if skip(up.uri, info.tag):
                        disagreed.append((i, "serves a copy already refused"))
                        continue
                blob = up.get(key, max_bytes=max_bytes)
            except ObjectNotFound as e:
                disagreed.append((i, None))
                reason = str(e)
                continue
            except (FormatError, ValidationError) as e:
                disagreed.append((i, str(e)))
                reason = str(e)
                continue
            except TransportError as e:
                self._demote(i, str(e))
                reason, last = str(e), e
                continue
            why = check(blob)
            if why is not None:
                disagreed.append((i, why))
                reason = f"{up.uri}: {why}"
                continue
            for j, r in disagreed:
                if r is None:
                    self._suspect(j, key, up.uri)
                else:
                    self._demote(j, f"{key}: {r}, while {up.uri} serves a genuine copy", bad_bytes=True)
            self._served(i, len(blob))
            return blob, up.uri, "", None
        return None, "", reason, last


def second_opinion(store: ObjectStore, key: str, *, max_bytes: int | None, check: Callable[[bytes], str | None],
                   skip: Callable[[str, str], bool] | None = None) -> bytes | None:
    """:meth:`FailoverStore.second_opinion` on an upstream list of two or more; None on any
    other store (there is nobody else to ask)."""
    if not isinstance(store, FailoverStore) or len(store.stores) < 2:
        return None
    got = store.second_opinion(key, max_bytes=max_bytes, check=check, skip=skip)
    return None if got is None else got[0]


def answered_by(store: ObjectStore) -> str:
    """Which upstream answered this thread's last call on ``store`` ('' for a plain store)."""
    return store.answered_by() if isinstance(store, FailoverStore) else ""


def fetch_verified(store: ObjectStore, key: str, *, max_bytes: int | None,
                   check: Callable[[bytes], str | None]) -> bytes:
    """The bytes of ``key`` that pass ``check`` (see :meth:`FailoverStore.get_verified`).
    On a single store: one ``get`` and one check; bad bytes raise :class:`VerificationFailed`.
    Not-found and too-large answers of a single store propagate as they are."""
    if isinstance(store, FailoverStore):
        return store.get_verified(key, max_bytes=max_bytes, check=check)
    blob = store.get(key, max_bytes=max_bytes)
    why = check(blob)
    if why is not None:
        raise VerificationFailed(f"{store.uri}: {key!r}: {why}", uri=store.uri, op="get", key=key)
    return blob


def origin_chunk_bytes(store: ObjectStore) -> int | None:
    """Chunk bytes ``store`` read from the origin (non-relay upstreams), when it counts them."""
    if isinstance(store, FailoverStore):
        return store.origin_chunk_bytes()
    if is_relay(store):
        return 0
    return getattr(store, "chunk_bytes_read", None)  # a plain store: all it read came from the origin
