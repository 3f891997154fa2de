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
* **quiet**: a rejected object (forged, foreign, malformed, oversized) is logged once per
  identity; only its identity is kept, in a bounded LRU, never its bytes.

A store error is reported (once per distinct message) and read as "absent": the caller
polls again, so a failing store delays, never crashes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from nemo_dcr.errors import DcrError, FormatError, TransportError
from nemo_dcr.protocol.manifest import DOC_LIMITS, doc_digest
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, ObjectStore

CACHE_ENTRIES = 1024
"""Identities remembered (accepted and rejected together); the oldest are forgotten."""


@dataclass(frozen=True)
class Opened:
    doc: Any
    digest: str
    """``sha256:`` of the document's bytes as stored (what the next link of the chain names)."""


class DocReader:
    def __init__(self, store: ObjectStore, sealer: Sealer, run_id: str, *, log: Callable[[dict], None],
                 who: dict | None = None):
        self.store = store
        self.sealer = sealer
        self.run_id = run_id
        self._log = log
        self._who = who or {}
        self._cache: OrderedDict[str, tuple[str, Opened | None]] = OrderedDict()
        self._store_errors: set[str] = set()

    def _remember(self, key: str, tag: str, result: Opened | None) -> Opened | None:
        self._cache[key] = (tag, result)
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return result

    def reject(self, key: str, error: str, **extra) -> None:
        """Log a refusal of the object now at ``key`` (the caller's own check failed) once per
        identity, and read it as absent until it changes."""
        hit = self._cache.get(key)
        if hit is not None and hit[1] is not None:
            self._remember(key, hit[0], None)
            self._log({**self._who, "ignored": key, "error": error, **extra})

    def read(self, key: str, cls) -> Opened | None:
        """The sealed ``cls`` document at ``key`` if present, authentic and of this run."""
        try:
            info = self.store.stat(key)
            if info is None:
                return None
            hit = self._cache.get(key)
            if hit is not None and hit[0] == info.tag:
                self._cache.move_to_end(key)
                return hit[1]
            data, info = self.store.get_with_info(key, max_bytes=DOC_LIMITS[cls.KIND])
        except ObjectNotFound:
            return None
        except FormatError as e:  # over the size cap: never read
            size = getattr(e, "size", None)
            self._remember(key, info.tag, None)
            self._log({**self._who, "ignored": key, "error": str(e), "size": size})
            return None
        except TransportError as e:  # a failing or stalled store: look again at the next poll
            msg = str(e)
            if msg not in self._store_errors and len(self._store_errors) < CACHE_ENTRIES:
                self._store_errors.add(msg)
                self._log({**self._who, "store_error": key, "error": msg})
            return None
        try:
            doc = self._open(data, cls)
        except DcrError as e:
            self._log({**self._who, "ignored": key, "error": str(e)})
            second = self._second_opinion(key, cls, info.tag)
            return second if second is not None else self._remember(key, info.tag, None)
        return self._remember(key, info.tag, Opened(doc, doc_digest(data)))

    def _open(self, data: bytes, cls):
        doc = cls.from_json(data, self.sealer)
        if doc.run_id != self.run_id:
            raise FormatError(f"{cls.KIND} of run {doc.run_id}, not {self.run_id}")
        return doc

    def _second_opinion(self, key: str, cls, tag: str) -> Opened | None:
        """Through an upstream list (relays, ``transport/failover.py``): the document the other
        upstreams serve at ``key`` when the current one served one that does not open.  A
        relay that forges or alters a document is demoted like one that serves bad chunk
        bytes, and this receiver reads on from the next upstream.  (A document forged at the
        origin, which every faithful relay passes on, fails everywhere: the upstreams rest
        ``retry_after_s`` and the order comes back; the forgery is ignored as before.)"""
        get_verified = getattr(self.store, "get_verified", None)
        if get_verified is None or len(getattr(self.store, "stores", ())) < 2:
            return None

        def check(blob: bytes) -> str | None:
            try:
                self._open(blob, cls)
            except DcrError as e:
                return str(e)
            return None

        try:
            data = get_verified(key, max_bytes=DOC_LIMITS[cls.KIND], check=check)
        except TransportError:  # VerificationFailed included: no upstream has a genuine one
            return None
        self._log({**self._who, "event": "document read from the next upstream", "key": key})
        # remembered under the rejected copy's tag: a relay echoes its upstream's tags, so a
        # liar may present the genuine one's; either way the tag now means these bytes
        return self._remember(key, tag, Opened(self._open(data, cls), doc_digest(data)))
