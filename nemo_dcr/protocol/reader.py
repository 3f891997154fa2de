"""Reading sealed documents from an untrusted store: bounded, cached by identity, quiet.

Both halves of the protocol poll the same few keys (``HEAD.json``, a manifest, decisions,
acks) many times a second, and anyone who can write to the store can put anything there.
``DocReader.read`` makes every such read cost what a genuine document costs:

* **bounded**: the object's size is checked before its body is read
  (``get(max_bytes=DOC_LIMITS[kind])``), and the bounded parser
  (``protocol/jsondoc.py``) refuses deep nesting, huge numbers and duplicate keys;
* **cached by identity**: ``stat`` first; an object whose identity (size, ETag / inode and
  change time) is the one already read is not read or parsed again -- a 60 MB manifest
  costs one parse, not one per poll;
* **quiet**: a rejected object (forged, foreign, malformed, oversized, or failing the
  caller's own check, e.g. a genuine decision of another version under this version's key)
  is logged once per identity; only its identity is kept, in a bounded LRU, never its bytes;
* **a second opinion** (through an upstream list of relays, ``transport/failover.py``): a
  rejected copy, and a document the caller's signed evidence says exists (``expect=True``:
  the manifest a signed ``HEAD.json`` names, the decision of a version this receiver
  answered) that the current upstream does not serve, is asked of the other upstreams; the
  first genuine copy is used and the upstreams that disagreed are demoted.  Bounded: a new
  rejected identity is asked about at once, and after that a key is asked about at most
  once per ``SECOND_OPINION_REST_S`` (identities already refused cost one ``stat`` each,
  not a read).  An identity is the upstream's uri and its tag, so once a lying relay is
  demoted the key is read again from the next upstream: a rejection it caused is never
  permanent.

A store error is reported (once per distinct message) and read as "absent": the caller
polls again, so a failing store delays, never crashes.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from nemo_dcr.errors import DcrError, FormatError, TransportError
from nemo_dcr.protocol.manifest import DOC_LIMITS, doc_digest
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.failover import FailoverStore, answered_by, second_opinion
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore

CACHE_ENTRIES = 1024
"""Identities remembered (accepted and rejected together); the oldest are forgotten."""
SECOND_OPINION_REST_S = 2.0
"""Shortest interval between two second opinions on one key (after the first, which a new
rejected identity gets at once).  What a lying upstream costs a reader that has another
one: at most this long after the genuine document exists somewhere, plus one read of it
per upstream; what it costs the upstreams: one ``stat`` of the key per upstream per
interval while the lie lasts."""


@dataclass(frozen=True)
class Opened:
    doc: Any
    digest: str
    """``sha256:`` of the document's bytes as stored (what the next link of the chain names)."""


class DocReader:
    def __init__(self, store: ObjectStore, sealer: Sealer, run_id: str, *, log: Callable[[dict], None],
                 who: dict | None = None, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.sealer = sealer
        self.run_id = run_id
        self._log = log
        self._who = who or {}
        self._clock = clock
        self._cache: OrderedDict[str, tuple[str, Opened | None]] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], None] = OrderedDict()  # (key, identity) judged bad
        self._asked: OrderedDict[str, float] = OrderedDict()  # key -> when the others were last asked
        self._store_errors: set[str] = set()
        self._others = isinstance(store, FailoverStore) and len(store.stores) >= 2

    @staticmethod
    def _bounded(d: OrderedDict, k, v) -> None:
        d[k] = v
        d.move_to_end(k)
        while len(d) > CACHE_ENTRIES:
            d.popitem(last=False)

    def _ident(self, tag: str) -> str:
        """An object's identity: the upstream that served it and its tag (a relay echoes its
        upstream's tags, so a liar may present a genuine copy's)."""
        return f"{answered_by(self.store)}|{tag}"

    def _remember(self, key: str, ident: str, result: Opened | None) -> Opened | None:
        self._bounded(self._cache, key, (ident, result))
        if result is None:
            self._bounded(self._refused, (key, ident), None)
        return result

    def reject(self, key: str, error: str, **extra) -> None:
        """Log a refusal of the object now at ``key`` (the caller's own check failed) once per
        identity, and read it as absent until it changes."""
        hit = self._cache.get(key)
        if hit is not None and hit[1] is not None:
            self._remember(key, hit[0], None)
            self._log({**self._who, "ignored": key, "error": error, **extra})

    def read(self, key: str, cls, *, check: Callable[[Any], str | None] | None = None,
             expect: bool = False) -> Opened | None:
        """The sealed ``cls`` document at ``key`` if present, authentic, of this run and passing
        ``check(doc)`` (None = good, else the reason; ``key`` must always get the same check).
        ``expect``: the caller holds signed evidence that it exists, so a not-found gets a
        second opinion too (bounded: module docstring)."""
        ident = ""
        try:
            info = self.store.stat(key)
            if info is None:
                return self._missing(key, cls, check, expect)
            ident = self._ident(info.tag)
            hit = self._cache.get(key)
            if hit is not None and hit[0] == ident:
                self._cache.move_to_end(key)
                if hit[1] is None and self._due(key):  # a rejection: re-asked of the others, bounded
                    return self._ask_others(key, cls, check, ident)
                return hit[1]
            # the bytes under the stat's identity: a put in between gives newer bytes under the
            # older identity, so the next poll sees another identity and reads once too often at
            # worst, never misses a version (as get_with_info, one request fewer on S3)
            who = answered_by(self.store)
            data = self.store.get(key, max_bytes=DOC_LIMITS[cls.KIND])
            if answered_by(self.store) != who:  # another upstream served the bytes: its identity with them
                data, info = self.store.get_with_info(key, max_bytes=DOC_LIMITS[cls.KIND])
                ident = self._ident(info.tag)
        except ObjectNotFound:
            return self._missing(key, cls, check, expect)
        except FormatError as e:  # over the size cap (a 413 from a relay): never read
            self._log({**self._who, "ignored": key, "error": str(e), "size": getattr(e, "size", None)})
            return self._refused_copy(key, cls, check, ident)
        except TransportError as e:  # a failing or stalled store: look again at the next poll
            msg = str(e)
            if msg not in self._store_errors and len(self._store_errors) < CACHE_ENTRIES:
                self._store_errors.add(msg)
                self._log({**self._who, "store_error": key, "error": msg})
            return None
        try:
            doc = self._open(data, cls, check)
        except DcrError as e:
            self._log({**self._who, "ignored": key, "error": str(e)})
            return self._refused_copy(key, cls, check, ident)
        return self._remember(key, ident, Opened(doc, doc_digest(data)))

    def probe(self, key: str, cls, *, check: Callable[[Any], str | None] | None = None) -> Opened | None:
        """Ask the other upstreams for ``key`` now (a genuine copy passing ``check``), however
        the current one answers: the caller suspects a stale or hidden copy (a ``HEAD.json``
        that does not move) and bounds how often it asks.  None with no other upstream."""
        return self._ask_others(key, cls, check, None) if self._others else None

    def _open(self, data: bytes, cls, check: Callable[[Any], str | None] | None = None):
        doc = cls.from_json(data, self.sealer)
        if doc.run_id != self.run_id:
            raise FormatError(f"{cls.KIND} of run {doc.run_id}, not {self.run_id}")
        why = None if check is None else check(doc)
        if why is not None:
            raise FormatError(f"{cls.KIND} {why}")
        return doc

    def _due(self, key: str) -> bool:
        return self._others and self._clock() - self._asked.get(key, float("-inf")) >= SECOND_OPINION_REST_S

    def _missing(self, key: str, cls, check, expect: bool) -> Opened | None:
        if expect and self._due(key):
            return self._ask_others(key, cls, check, None)
        return None

    def _refused_copy(self, key: str, cls, check, ident: str) -> Opened | None:
        """A copy that was refused: remembered by identity; a new identity gets a second
        opinion at once."""
        self._remember(key, ident, None)
        return self._ask_others(key, cls, check, ident) if self._others else None

    def _ask_others(self, key: str, cls, check, ident: str | None) -> Opened | None:
        """The document the upstreams serve at ``key`` (``FailoverStore.second_opinion``): a
        relay that forged, altered, swapped, bloated or hid it is demoted like one that
        serves bad chunk bytes, and this reader reads on from the next upstream.  (A
        document forged at the origin, which every faithful relay passes on, fails
        everywhere: nobody is demoted and the forgery is ignored as before.)"""
        self._bounded(self._asked, key, self._clock())
        asked = answered_by(self.store)  # the upstream whose answer is in doubt

        def bad(blob: bytes) -> str | None:
            try:
                self._open(blob, cls, check)
            except DcrError as e:
                return str(e)
            return None

        data = second_opinion(self.store, key, max_bytes=DOC_LIMITS[cls.KIND], check=bad,
                              skip=lambda uri, tag: (key, f"{uri}|{tag}") in self._refused)
        if data is None:
            return None
        if answered_by(self.store) != asked:  # (the same one: it was written since it was asked)
            self._log({**self._who, "event": "document read from the next upstream", "key": key,
                       "upstream": answered_by(self.store)})
        got = Opened(self._open(data, cls, check), doc_digest(data))
        # under the refused copy's identity, the bytes now meant by it; a not-found is not
        # remembered (the next poll reads from the upstream now current)
        return got if ident is None else self._remember(key, ident, got)
