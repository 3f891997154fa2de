"""Object storage behind one small protocol, addressed by ``str`` URIs.

A store holds immutable objects under relative ``/``-separated keys.  ``put`` is atomic:
a reader sees either nothing or the whole object (local directories write a temporary
file and rename it; object stores give this for free).  This is what lets a receiver
treat "the manifest exists" as "the version is published".

``open_store(uri)``: a plain path or ``file://`` URI is the embedded default
(``LocalDirStore``); ``relay://host:port`` and ``http(s)://`` are a relay of the relay tree
(``transport/relay_client.py``); any other scheme (``s3://``, ``memory://``, ...) goes
through fsspec; a comma-separated list is an ordered upstream list that fails over
(``transport/failover.py``).  URIs stay strings: ``pathlib.Path`` would mangle ``s3://bucket``.

Bounded calls
-------------
Every call (put / get / stat / exists / list / delete) is bounded by the store's
:class:`StorePolicy`: each attempt has a timeout, transient failures (connection
errors, timeouts, HTTP 5xx and throttling) are retried a bounded number of times with
exponential backoff and jitter, and anything else (not found, permission, validation)
is not retried.  A call that still fails raises :class:`StoreError` with ONE line that
names the store, the operation and the key::

    s3://b/run: get 'v/00000003/MANIFEST.json' failed after 5 attempts in 157.6 s:
    ReadTimeoutError: Read timeout on endpoint URL: "http://..."

What bounds an attempt, per back end (each was checked against a stopped server):

- S3 (s3fs): botocore's ``connect_timeout`` / ``read_timeout`` (= ``timeout_s``) bound
  every wait for a response, per socket read, so a download that keeps moving is never
  cut.  They do NOT bound an upload: aiohttp waits for ``100 Continue`` (and a blocked
  send) without a timeout, so a put also runs under a watchdog (fsspec's ``sync``
  timeout, which cancels the request) of ``timeout_s + len(data) / min_bytes_per_s``.
  botocore's and s3fs's own retries are switched off so that this policy is the only one.
- Local directories, and fsspec back ends without a loop: the attempt runs in a worker
  thread under the same watchdog (``timeout_s``, plus ``min_bytes_per_s`` for the bytes
  it moves once their size is known).  An abandoned local put never renames its
  temporary file into place.
- Other async fsspec back ends: the watchdog bounds the whole attempt at ``timeout_s``
  (plus the put allowance); set ``timeout_s`` above the longest download there.

A timed-out request may still complete on the server later; keys are written once per
version, so a late duplicate of a put carries the same bytes.

Bounded reads and versions
--------------------------
``get(key, max_bytes=N)`` learns the object's size before reading its body (local: the
opened descriptor's ``fstat``; fsspec: ``info``) and refuses an object over ``N`` with
:class:`ObjectTooLarge` without reading it; the read itself stops after ``N + 1`` bytes,
so an object that grows in between is refused too.  ``stat(key)`` gives an
:class:`ObjectInfo` whose ``tag`` changes whenever the object's bytes may have changed
(what each back end offers is listed at :class:`ObjectInfo`), and
``get_with_info`` returns the bytes with the tag of the version they were read from.

The local store follows no symbolic link below its root: a key whose path crosses one
is refused (:class:`SymlinkRefused`), so nothing planted in the directory can make a
put, get, stat, exists or list reach outside it.
"""
from __future__ import annotations

import errno
import heapq
import logging
import os
import random
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Protocol, runtime_checkable

from nemo_dcr.errors import FormatError, TransportError, ValidationError

CHUNK_MARK = "/chunks/"
"""What a chunk object's key contains (``v/<v>/chunks/r<rank>-<seq>.dcr``)."""
_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")
_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StorePolicy:
    """How long a store call may take and how often it is retried.

    The defaults keep a fully stalled store's worst case (5 attempts of 30 s plus
    0.5 + 1 + 2 + 4 s of backoff, about 158 s) below the trainer's 300 s collective
    timeout, so a dead store is reported as the store's failure, not as a gloo timeout.
    """

    timeout_s: float = 30.0
    """Longest one attempt waits for the store without progress (S3: botocore's connect
    and read timeouts; elsewhere a watchdog on the attempt)."""
    retries: int = 4
    """Further attempts after the first one fails transiently (0 = try once)."""
    backoff_s: float = 0.5
    """Delay before the first retry; doubles per retry (capped at ``backoff_max_s``), and
    each delay is drawn uniformly from [d/2, d] (jitter) so that ranks do not retry in step."""
    backoff_max_s: float = 8.0
    """Upper bound on one backoff delay."""
    min_bytes_per_s: float = float(1 << 20)
    """Slowest transfer that still counts as progress: an attempt that moves N bytes may
    take ``timeout_s + N / min_bytes_per_s`` under the watchdog."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "backoff_s", "backoff_max_s", "min_bytes_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"store {name} must be a number, got {v!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int):
            raise TypeError(f"store retries must be an int, got {self.retries!r}")
        if self.timeout_s <= 0 or self.min_bytes_per_s <= 0:
            raise ValidationError(f"store timeout_s and min_bytes_per_s must be > 0, got {self.timeout_s}, "
                                  f"{self.min_bytes_per_s}")
        if self.retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValidationError("store retries, backoff_s and backoff_max_s must be >= 0")

    def budget_s(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_bytes_per_s

    def backoff(self, failures: int, rng: random.Random) -> float:
        d = min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1))
        return rng.uniform(d / 2, d)


POLICY_FIELDS = frozenset(f.name for f in fields(StorePolicy))


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

    def __init__(self, uri: str, key: str, size: int, limit: int, *, grew: bool = False):
        self.uri, self.key, self.size, self.limit = uri, key, size, limit
        what = f"grew to at least {size} bytes while read" if grew else f"is {size} bytes"
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
_TRANSIENT_TYPES = frozenset({
    "TimeoutError", "ConnectionError", "HTTPClientError", "IncompleteReadError",
    "ClientConnectionError", "ClientPayloadError", "ResponseParserError",
})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "InternalError", "ServiceUnavailable",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ETIMEDOUT, errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ECONNRESET,
    errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH,
    errno.ENETDOWN, getattr(errno, "EREMOTEIO", errno.EIO),
})
_PERMANENT = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError,
              FileExistsError, SymlinkRefused, ValueError, TypeError)


def _http_status(exc: BaseException) -> int:
    """The HTTP status of the botocore error behind ``exc`` (0 when there is none)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        e = e.__cause__
    return 0


def is_transient(exc: BaseException) -> bool:
    """True for failures another attempt may cure: connection errors, timeouts, HTTP 5xx
    and throttling; False for not-found, permission and validation errors (and anything
    unrecognised).  Follows ``__cause__`` (s3fs re-raises botocore's ``ClientError`` as
    an ``OSError`` caused by it)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _PERMANENT):
            return False
        response = getattr(e, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return status >= 500 or status == 429 or response["Error"].get("Code") in _TRANSIENT_CODES
        if any(c.__name__ in _TRANSIENT_TYPES for c in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        e = e.__cause__
    return False


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- one attempt under a watchdog ------------------------------------------------------

class _Attempt:
    """One attempt's time budget; the operation extends it once it learns how many
    bytes it moves (a local get after ``fstat``)."""

    def __init__(self, policy: StorePolicy, nbytes: int = 0):
        self.policy = policy
        self.budget_s = policy.budget_s(nbytes)
        self.deadline = time.monotonic() + self.budget_s
        self.abandoned = False

    def add_bytes(self, nbytes: int) -> None:
        extra = nbytes / self.policy.min_bytes_per_s
        self.budget_s += extra
        self.deadline += extra

    def timed_out(self) -> TimeoutError:
        return TimeoutError(f"no answer within {self.budget_s:.1f} s (watchdog)")


def _in_watched_thread(fn: Callable[[_Attempt], Any], att: _Attempt) -> Any:
    """Run ``fn(att)`` in a daemon thread; give up on it at ``att.deadline`` (a thread
    stuck in the kernel cannot be killed: it is left behind, marked abandoned).  At
    interpreter shutdown on Python >= 3.12 (no new threads): on this thread, unwatched."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn(att)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    try:
        threading.Thread(target=target, name="nemo-dcr-store-call", daemon=True).start()
    except RuntimeError:
        # Python >= 3.12 refuses new threads at interpreter shutdown ("can't create new thread
        # at interpreter shutdown"), where the refit's exit settle still reads acks and writes
        # the decision: the attempt runs on the calling thread, bounded by the back end's own
        # timeouts (socket, s3fs) instead of the watchdog; the exit settle bounds its wait
        target()
    while not done.wait(max(0.0, att.deadline - time.monotonic())):
        if time.monotonic() >= att.deadline:
            att.abandoned = True
            raise att.timed_out()
    if "error" in box:
        raise box["error"]
    return box["value"]


class _BoundedStore:
    """Retry loop and error reporting shared by the back ends; each back end says how
    one attempt is run (``_run_attempt``)."""

    uri: str
    policy: StorePolicy
    chunk_bytes_read: int = 0
    """Bytes of chunk objects (keys with ``CHUNK_MARK``) this store's ``get`` calls returned:
    the one count of them (``FailoverStore.upstream_stats`` reads its members',
    ``failover.origin_chunk_bytes`` the demo's ``origin_read_bytes``)."""

    def _init_policy(self, policy: StorePolicy | None) -> None:
        if policy is not None and not isinstance(policy, StorePolicy):
            raise TypeError(f"policy must be a StorePolicy, got {type(policy).__name__}")
        self._reads_lock = threading.Lock()
        self.policy = policy or StorePolicy()
        self._rng = random.Random()

    def _run_attempt(self, op: str, fn: Callable[[_Attempt], Any], att: _Attempt) -> Any:
        return _in_watched_thread(fn, att)

    def _call(self, op: str, key: str, fn: Callable[[_Attempt], Any], *, nbytes: int = 0) -> Any:
        p = self.policy
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                out = self._run_attempt(op, fn, _Attempt(p, nbytes))
                if op == "get" and CHUNK_MARK in key:
                    with self._reads_lock:
                        self.chunk_bytes_read += len(out[0] if isinstance(out, tuple) else out)
                return out
            except Exception as e:  # noqa: BLE001 - classified and reported below
                elapsed = time.monotonic() - start
                where = dict(uri=self.uri, op=op, key=key, attempts=attempt, elapsed_s=elapsed)
                if isinstance(e, FileNotFoundError) and op == "get":
                    raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object", **where) from None
                if isinstance(e, ObjectTooLarge):  # the answer, not a failure of the store
                    raise e
                if isinstance(e, SymlinkRefused):
                    raise SymlinkRefused(f"{self.uri}: {op} {key!r} refused: {e}", **where) from None
                transient = is_transient(e)
                if transient and attempt <= p.retries:
                    delay = p.backoff(attempt, self._rng)
                    _log.warning("%s: %s %r attempt %d/%d failed (%s); retrying in %.2f s", self.uri, op, key,
                                 attempt, p.retries + 1, _one_line(e, 160), delay)
                    time.sleep(delay)
                    continue
                plural = "s" if attempt > 1 else ""
                why = "" if transient else " (not retried)"
                raise StoreError(f"{self.uri}: {op} {key!r} failed after {attempt} attempt{plural} in "
                                 f"{elapsed:.1f} s{why}: {_one_line(e)}", **where) from e


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
    return fn(key, data) if fn is not None else _stat_then_put(store, key, data)


def _stat_then_put(store: ObjectStore, key: str, data: bytes) -> bool:
    """Create-if-absent where the back end has no conditional create (not atomic)."""
    if store.stat(key) is not None:
        return False
    store.put(key, data)
    return True


# --- the embedded default: a directory ------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_PREFIX = ".tmp-"
_BLOCK = 8 << 20


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _local_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


class LocalDirStore(_BoundedStore):
    """The embedded default: a directory on a local or shared file system.

    Paths below the root are walked one component at a time with ``O_NOFOLLOW``
    relative to the parent's descriptor, so a symbolic link anywhere below the root
    (say ``v -> /etc``) is refused rather than followed, with no window between a check
    and the use.  The root itself may be a link.
    """

    def __init__(self, root: str, *, policy: StorePolicy | None = None):
        self._init_policy(policy)
        self.uri = root
        self.root = os.path.abspath(root.removeprefix("file://"))
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{root}: cannot open store: {_one_line(e)}", uri=root, op="open") from None

    def _open_dir(self, parts: list[str], *, create: bool) -> int:
        """Descriptor of the directory ``root/parts...``, reached without following links."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, name in enumerate(parts):
                if create:
                    try:
                        os.mkdir(name, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                        raise SymlinkRefused(f"{'/'.join(parts[:i + 1])!r} is a symbolic link "
                                             f"(the local store follows no link below its root)") from None
                    raise
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def put(self, key: str, data: bytes) -> None:
        self._publish(key, data, exclusive=False)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._publish(key, data, exclusive=True)

    def _publish(self, key: str, data: bytes, *, exclusive: bool) -> bool:
        """Write a temporary file beside ``key``, then rename it over ``key`` or, with
        ``exclusive``, hard-link it to ``key`` (``link(2)`` fails on an existing name:
        the one atomic create-if-absent every POSIX file system has, NFS included)."""
        parts = check_key(key).split("/")
        data = memoryview(data).cast("B")

        def attempt(att: _Attempt) -> bool:
            fd = self._open_dir(parts[:-1], create=True)
            tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                              dir_fd=fd)
                try:
                    for i in range(0, len(data), _BLOCK):
                        view = data[i:i + _BLOCK]
                        while view:
                            view = view[os.write(out, view):]
                finally:
                    os.close(out)
                if att.abandoned:  # the caller gave up on this attempt: publish nothing
                    raise att.timed_out()
                if not exclusive:
                    os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
                    return True
                try:
                    os.link(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp, dir_fd=fd)
                return True
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=fd)
                except OSError:
                    pass
                raise
            finally:
                os.close(fd)

        return self._call("put", key, attempt, nbytes=len(data))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """The size check, the read and the version's identity all come from one opened
        descriptor (``fstat`` before and after the read), so they cannot race a rename.
        An object written in place during the read (its tag or length changes) fails
        the attempt transiently; the next attempt sees the new version."""
        parts = check_key(key).split("/")

        def attempt(att: _Attempt) -> tuple[bytes, ObjectInfo]:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except NotADirectoryError:
                raise FileNotFoundError(key) from None
            try:
                try:
                    f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise SymlinkRefused(f"{key!r} is a symbolic link "
                                             f"(the local store follows no link below its root)") from None
                    raise
            finally:
                os.close(fd)
            with os.fdopen(f, "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError(key)
                if max_bytes is not None and st.st_size > max_bytes:
                    raise ObjectTooLarge(self.uri, key, st.st_size, max_bytes)
                att.add_bytes(st.st_size)
                data = fh.read(st.st_size + 1)  # never more than fstat said, plus one byte to see growth
                tag = _local_tag(st)
                if len(data) != st.st_size or _local_tag(os.fstat(fh.fileno())) != tag:
                    raise OSError(errno.EAGAIN, "the object changed while it was read")
                return data, ObjectInfo(key, st.st_size, tag)

        return self._call("get", key, attempt)

    def _lstat_attempt(self, key: str) -> Callable[[_Attempt], ObjectInfo | None]:
        parts = check_key(key).split("/")

        def attempt(att: _Attempt) -> ObjectInfo | None:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            finally:
                os.close(fd)
            if stat.S_ISLNK(st.st_mode):
                raise SymlinkRefused(f"{key!r} is a symbolic link (the local store follows no link below its root)")
            return ObjectInfo(key, st.st_size, _local_tag(st)) if stat.S_ISREG(st.st_mode) else None

        return attempt

    def stat(self, key: str) -> ObjectInfo | None:
        return self._call("stat", key, self._lstat_attempt(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self._lstat_attempt(key)) is not None

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """A directory is read whole (its cost grows with what was planted in it); at most
        ``limit`` keys are kept and returned."""
        limit = check_limit(limit)
        parts = check_key(prefix.strip("/")).split("/") if prefix.strip("/") else []

        def walk(fd: int, rel: list[str], out: list[str]) -> None:
            with os.scandir(fd) as it:
                entries = list(it)
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    continue
                path = [*rel, entry.name]
                if entry.is_symlink():
                    raise SymlinkRefused(f"{'/'.join(path)!r} is a symbolic link "
                                         f"(the local store follows no link below its root)")
                if entry.is_dir(follow_symlinks=False):
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        walk(sub, path, out)
                    finally:
                        os.close(sub)
                elif entry.is_file(follow_symlinks=False):
                    out.append("/".join(path))

        def attempt(att: _Attempt) -> list[str]:
            try:
                fd = self._open_dir(parts, create=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
            out: list[str] = []
            try:
                walk(fd, parts, out)
            finally:
                os.close(fd)
            return sorted(out) if limit is None else heapq.nsmallest(limit, out)

        return self._call("list", prefix, attempt)

    def delete(self, key: str) -> None:
        parts = check_key(key).split("/")

        def attempt(att: _Attempt) -> None:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                os.unlink(parts[-1], dir_fd=fd)  # a link itself may go: unlinking reaches nothing
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)

        self._call("delete", key, attempt)


# --- everything else: fsspec -----------------------------------------------------------

_S3_PROTOCOLS = ("s3", "s3a")


class FsspecStore(_BoundedStore):
    """Any fsspec file system (``s3://bucket/prefix``, ``memory://x``, ...).

    ``storage_options`` are passed to fsspec as given (e.g. ``endpoint_url`` for an
    S3-compatible server); nothing is read from the environment here.  For S3 the store
    adds, unless given: botocore ``connect_timeout`` / ``read_timeout`` = the policy's
    ``timeout_s`` and no botocore retries (``config_kwargs``), no s3fs retries, no
    listings cache (a cached listing would hide a manifest published after it), and its
    own client (``skip_instance_cache``), since these settings are per store.
    """

    def __init__(self, uri: str, *, policy: StorePolicy | None = None, **storage_options):
        import fsspec

        self._init_policy(policy)
        self.uri = uri
        protocol = uri.split("://", 1)[0].lower()
        self._socket_timeouts = protocol in _S3_PROTOCOLS
        if self._socket_timeouts:
            storage_options = _s3_options(storage_options, self.policy)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(uri, **storage_options)
        except Exception as e:  # noqa: BLE001 - unknown protocol, missing package, bad option
            raise StoreError(f"{uri}: cannot open store: {_one_line(e)}", uri=uri, op="open") from None
        if self._socket_timeouts:
            self.fs.retries = 1  # s3fs's own retry loop: one attempt, ours decide
        self.root = self.root.rstrip("/")
        self._async = bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _fs_call(self, name: str, att: _Attempt, *args, watchdog: bool = True, **kwargs) -> Any:
        """``fs.<name>(*args, **kwargs)`` for one attempt.  On an async file system the
        coroutine runs on fsspec's loop under ``sync(timeout=...)``, which cancels it at the
        deadline; ``watchdog=False`` leaves the bound to the client's socket timeouts."""
        if not self._async:
            return getattr(self.fs, name)(*args, **kwargs)
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        try:
            return sync(self.fs.loop, getattr(self.fs, "_" + name), *args,
                        timeout=att.budget_s if watchdog else None, **kwargs)
        except FSTimeoutError:
            raise att.timed_out() from None

    def _run_attempt(self, op: str, fn: Callable[[_Attempt], Any], att: _Attempt) -> Any:
        return fn(att) if self._async else _in_watched_thread(fn, att)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call("put", key, lambda att: self._fs_call("pipe_file", att, path, data), nbytes=len(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """S3: one ``PutObject`` with ``If-None-Match: *`` (a 412 -> False).  Other fsspec
        file systems offer no conditional create: ``stat``, then ``put`` when absent
        (atomic only within one process; the caller's read-back catches a race)."""
        path = self._path(key)
        if not self._socket_timeouts:
            return _stat_then_put(self, key, data)

        def attempt(att: _Attempt) -> bool:
            try:
                self._fs_call("pipe_file", att, path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:  # a 412 that s3fs did not map (no Condition in the answer)
                if _http_status(e) == 412:
                    return False
                raise
            return True

        return self._call("put", key, attempt, nbytes=len(data))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            return self.get_with_info(key, max_bytes=max_bytes)[0]
        path = self._path(key)
        return self._call("get", key, lambda att: self._fs_call(
            "cat_file", att, path, watchdog=not self._socket_timeouts))

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """``info`` (S3: HEAD) first, then the body: with ``max_bytes`` a ranged read of at
        most ``max_bytes + 1`` bytes, so an object that grew in between is caught too.
        Race: a put between the two calls gives the new bytes with the old version's
        info.  The info is thus never newer than the bytes, and a reader that re-reads
        when ``stat`` shows another tag reads once too often at worst, never misses a
        version."""
        path = self._path(key)

        def attempt(att: _Attempt) -> tuple[bytes, ObjectInfo]:
            info = self._fs_call("info", att, path, watchdog=not self._socket_timeouts)
            if info.get("type") != "file":
                raise FileNotFoundError(path)
            size = int(info["size"])
            if max_bytes is not None and size > max_bytes:
                raise ObjectTooLarge(self.uri, key, size, max_bytes)
            if size == 0:  # that version's bytes; S3 answers a range on an empty object with 416
                return b"", ObjectInfo(key, 0, _fsspec_tag(info))
            att.add_bytes(size)
            ranged = {} if max_bytes is None else {"start": 0, "end": max_bytes + 1}
            data = self._fs_call("cat_file", att, path, watchdog=not self._socket_timeouts, **ranged)
            if max_bytes is not None and len(data) > max_bytes:
                raise ObjectTooLarge(self.uri, key, len(data), max_bytes, grew=True)
            return data, ObjectInfo(key, size, _fsspec_tag(info))

        return self._call("get", key, attempt)

    def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)

        def attempt(att: _Attempt) -> ObjectInfo | None:
            try:
                info = self._fs_call("info", att, path, watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                return None
            return ObjectInfo(key, int(info["size"]), _fsspec_tag(info)) if info.get("type") == "file" else None

        return self._call("stat", key, attempt)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._call("exists", key, lambda att: self._fs_call(
            "exists", att, path, watchdog=not self._socket_timeouts))

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """With ``limit`` on S3 (s3fs): one bounded listing in the store's key order (pages of
        at most ``2 x limit`` keys, stopped after ``limit``), not every key under ``prefix``.
        Other file systems list everything and keep the first ``limit``."""
        limit = check_limit(limit)
        base = self._path(prefix.strip("/")) if prefix.strip("/") else self.root
        bounded = limit is not None and self._async and hasattr(self.fs, "_iterdir")

        def attempt(att: _Attempt) -> list[str]:
            try:
                if bounded:  # s3fs: a recursive listing (no delimiter) of at most `limit` keys
                    found = self._fs_call("lsdir", att, base, max_items=limit, delimiter="",
                                          watchdog=not self._socket_timeouts)
                    return [f["name"] for f in found if f.get("type") != "directory"]
                return self._fs_call("find", att, base, watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                return []

        found = self._call("list", prefix, attempt)
        n = len(self.root) + 1
        keys = sorted(p[n:] if p.startswith(self.root + "/") else p for p in found)
        return keys if limit is None else keys[:limit]

    def delete(self, key: str) -> None:
        path = self._path(key)

        def attempt(att: _Attempt) -> None:
            try:
                self._fs_call("rm_file", att, path, watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                pass

        self._call("delete", key, attempt)


# What identifies a version in the ``info`` of the fsspec back ends (see ObjectInfo).
_VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "LastModified", "mtime", "updated", "created")


def _fsspec_tag(info: dict) -> str:
    return ";".join([f"{k}={info[k]}" for k in _VERSION_FIELDS if info.get(k) not in (None, "")]
                    + [f"size={info['size']}"])


def _s3_options(options: dict, policy: StorePolicy) -> dict:
    options = dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", policy.timeout_s)
    config.setdefault("read_timeout", policy.timeout_s)
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config
    options.setdefault("use_listings_cache", False)
    options.setdefault("skip_instance_cache", True)
    return options


_RELAY_SCHEMES = ("relay", "http", "https")

HOP_POLICY = StorePolicy(timeout_s=5.0, retries=1, backoff_s=0.2, backoff_max_s=1.0)
"""Policy of every upstream of a list but the last (``open_store("A,B,C")`` without a
policy): two attempts of 5 s, so a dead or stalled parent is left within about 10 s."""


def open_store(uri: str, *, policy: StorePolicy | None = None, **options) -> ObjectStore:
    """Open ``uri``: a directory (the embedded default), ``relay://host:port`` /
    ``http(s)://host:port`` (a relay, ``transport/relay_client.py``), any other fsspec URI,
    or a comma-separated ordered list of these (a ``FailoverStore``: the node re-parents
    down the list, ``transport/failover.py``).  ``options`` named like :class:`StorePolicy` fields (``timeout_s``,
    ``retries``, ``backoff_s``, ``backoff_max_s``, ``min_bytes_per_s``) set the store's
    call policy (or pass ``policy=``); the rest are fsspec storage options.  A URI that
    cannot be opened raises :class:`StoreError` naming it."""
    given = {k: options.pop(k) for k in list(options) if k in POLICY_FIELDS}
    if given:
        if policy is not None:
            raise ValidationError(f"pass either policy= or {sorted(given)}, not both")
        policy = StorePolicy(**given)
    if "," in uri:  # an ordered upstream list: re-parenting (transport/failover.py)
        from nemo_dcr.transport.failover import FailoverStore

        parts = [u.strip() for u in uri.split(",")]
        if any(not u for u in parts):
            raise ValidationError(f"empty entry in the upstream list {uri!r}")
        if len(set(parts)) != len(parts):
            raise ValidationError(f"upstream list {uri!r} names a store twice")
        retry_after_s = options.pop("retry_after_s", 30.0)
        # every member but the last has a next one to take over: unless a policy was given,
        # it gets HOP_POLICY (a stalled relay is left in ~10 s, not the default's ~158 s)
        hop = policy or HOP_POLICY
        return FailoverStore([open_store(u, policy=hop if i < len(parts) - 1 else policy, **options)
                              for i, u in enumerate(parts)], retry_after_s=retry_after_s)
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme in _RELAY_SCHEMES:
        if options:
            raise ValidationError(f"storage options {sorted(options)} apply to fsspec URIs only, not {uri!r}")
        from nemo_dcr.transport.relay_client import RelayStore

        return RelayStore(uri, policy=policy)
    if "://" not in uri or uri.startswith("file://"):
        if options:
            raise ValidationError(f"storage options {sorted(options)} apply to fsspec URIs only, not {uri!r}")
        return LocalDirStore(uri, policy=policy)
    return FsspecStore(uri, policy=policy, **options)
