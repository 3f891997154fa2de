"""The store protocol (:class:`ObjectStore`), its errors, :class:`ObjectInfo` and the key
rules every back end applies (``check_key``, ``check_limit``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nemo_dcr.errors import FormatError, TransportError, ValidationError

_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


class StoreError(TransportError):
    """A store call failed; ``str(e)`` is one line naming the store, operation and key."""

    def __init__(self, message: str, *, uri: str | None = None, op: str | None = None,
                 key: str | None = None, attempts: int = 0, elapsed_s: float = 0.0):
        super().__init__(message)
        self.uri, self.op, self.key = uri, op, key
        self.attempts, self.elapsed_s = attempts, elapsed_s

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ObjectNotFound(StoreError, KeyError):
    pass


class SymlinkRefused(StoreError):
    """A local store key whose path crosses a symbolic link below the store's root."""


class ObjectTooLarge(FormatError):
    """An object over the ``max_bytes`` a read allows; its body was not read (beyond
    ``limit + 1`` bytes when it grew during the read).  A format error, not a store
    failure: never retried, never wrapped into :class:`StoreError`."""

    def __init__(self, uri: str, key: str, size: int, limit: int, *, grew: bool = False, at_least: bool = False):
        self.uri, self.key, self.size, self.limit = uri, key, size, limit
        what = (f"grew to at least {size} bytes while read" if grew
                else f"is at least {size} bytes" if at_least else f"is {size} bytes")
        super().__init__(f"{uri}: {key!r} {what}, over the limit of {limit}")


@dataclass(frozen=True)
class ObjectInfo:
    """One version of one object: its size, and a ``tag`` that differs between versions.

    Equal tags mean "the same bytes" as far as the back end can tell; a reader may keep
    what it parsed from a version until the tag changes.  What a tag is made of:

    - local directory: ``inode-size-mtime_ns-ctime_ns``.  A put renames a new file into
      place (new inode and ctime); an in-place rewrite changes ctime, which no writer can
      set (``os.utime`` restores mtime, not ctime).  Blind spot: a rewrite of the same
      inode and size within the file system's ctime tick (a few ms on ext4).
    - S3 (s3fs ``info`` = HEAD): ``ETag`` (MD5 of the bytes for plain uploads),
      ``LastModified`` (1 s resolution), ``VersionId`` on a versioned bucket, size.
    - memory:// : ``created`` (set by every put, microseconds) and size; no ETag.
    - other fsspec back ends: whichever of ``ETag``/``etag``, ``VersionId``,
      ``generation``, ``LastModified``, ``mtime``, ``updated``, ``created`` their ``info``
      gives, and size.
    """

    key: str
    size: int
    tag: str


def check_key(key: str) -> str:
    if not _KEY.match(key) or any(part in {".", ".."} for part in key.split("/")):
        raise ValidationError(f"invalid store key {key!r}")
    return key


MAX_LIST_LIMIT = 1 << 20
"""Largest ``limit`` a bounded ``list`` takes."""


def check_limit(limit: int | None) -> int | None:
    """A ``list`` limit: None (every key) or an int in 1..``MAX_LIST_LIMIT``."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_LIST_LIMIT):
        raise ValidationError(f"list limit must be an int in 1..{MAX_LIST_LIMIT} or None, got {limit!r}")
    return limit


# --- what is worth another attempt -----------------------------------------------------

# Matched by class name along the MRO so that the core imports neither botocore nor
# aiohttp: builtin and botocore ConnectionError / TimeoutError (ReadTimeoutError,
# ConnectTimeoutError, EndpointConnectionError), botocore HTTPClientError
# (ConnectionClosedError), aiohttp's connection and payload errors, and the unparsable
# XML some throttling responses carry (as s3fs does).


@runtime_checkable
class ObjectStore(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None:
        """Atomically create or replace ``key``."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if nothing is there, atomically against every other writer
        of the store (a directory: ``link(2)`` of a written temporary file; S3:
        ``If-None-Match: *``); False, nothing written, when ``key`` exists.  After a retry
        the object may be this call's own first attempt: the caller reads back (the run
        claim, ``protocol/run.py``, compares the run id)."""

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Whole object; ``ObjectNotFound`` if absent; ``ObjectTooLarge`` (body unread)
        if over ``max_bytes``."""

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """``get`` plus the identity of the version read (never newer than the bytes)."""

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and version tag; ``None`` if absent."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """Keys under ``prefix`` (a key prefix ending at a ``/`` boundary), sorted; with
        ``limit``, only the first ``limit`` of them (an object store then lists one bounded
        page instead of every key a store writer may have planted)."""

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""


def put_if_absent(store: ObjectStore, key: str, data: bytes) -> bool:
    """``store.put_if_absent`` where the store has it; otherwise (a wrapper that does not
    forward it) ``stat`` then ``put``, which a concurrent writer can race: callers read
    back what they created."""
    fn = getattr(store, "put_if_absent", None)
    return fn(key, data) if fn is not None else stat_then_put(store, key, data)


def stat_then_put(store: ObjectStore, key: str, data: bytes) -> bool:
    """Create-if-absent where the back end has no conditional create (not atomic)."""
    if store.stat(key) is not None:
        return False
    store.put(key, data)
    return True



def list_sizes(store: ObjectStore, prefix: str, *, limit: int | None = None) -> list[tuple[str, int | None]]:
    """The keys under ``prefix`` in key order, each with its size where the store's listing
    carries it (local directories, fsspec back ends such as S3, failover lists of those:
    ``store.list_sizes``, relays), else None (any store without the method): the
    caller asks ``stat`` for the keys it wants.  A listed size is the bound of a later
    bounded ``get`` of that key, never trusted beyond it."""
    fn = getattr(store, "list_sizes", None)
    return fn(prefix, limit=limit) if fn is not None else [(k, None) for k in store.list(prefix, limit=limit)]
