"""Bounded calls: :class:`StorePolicy` (timeouts, retries, backoff), which failures are
transient, the per-attempt watchdog, and :class:`BoundedStore`, the retry loop every back end
runs its attempts in (the package docstring says what bounds an attempt, per back end)."""
from __future__ import annotations

import errno
import logging
import random
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

from nemo_dcr.configs.check import check_number
from nemo_dcr.errors import WrongTypeError
from nemo_dcr.transport.store.base import ObjectNotFound, ObjectTooLarge, StoreError, SymlinkRefused
from nemo_dcr.transport.store.meter import RequestMeter

_log = logging.getLogger("nemo_dcr.transport.store")


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
            check_number(f"store {name}", getattr(self, name), kind=float)
        check_number("store retries", self.retries, kind=int, min=0)
        for name in ("timeout_s", "min_bytes_per_s"):
            check_number(f"store {name}", getattr(self, name), kind=float, positive=True)
        for name in ("backoff_s", "backoff_max_s"):
            check_number(f"store {name}", getattr(self, name), kind=float, min=0)

    def budget_s(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_bytes_per_s

    def backoff(self, failures: int, rng: random.Random) -> float:
        d = min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1))
        return rng.uniform(d / 2, d)


POLICY_FIELDS = frozenset(f.name for f in fields(StorePolicy))


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


def http_status(exc: BaseException) -> int:
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


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- one attempt under a watchdog ------------------------------------------------------


class Attempt:
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


def in_watched_thread(fn: Callable[[Attempt], Any], att: Attempt) -> Any:
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


class BoundedStore:
    """Retry loop and error reporting shared by the back ends; each back end says how
    one attempt is run (``_run_attempt``)."""

    uri: str
    policy: StorePolicy

    @property
    def chunk_bytes_read(self) -> int:
        """Bytes of chunk objects (keys with ``CHUNK_MARK``) this store's ``get`` calls returned,
        from its meter (``get:chunk``): the one count of them (``FailoverStore.upstream_stats``
        reads its members', ``failover.origin_chunk_bytes`` the demo's ``origin_read_bytes``)."""
        return self.meter.snapshot()["calls"].get("get:chunk", {}).get("bytes", 0)

    def _init_policy(self, policy: StorePolicy | None) -> None:
        if policy is not None and not isinstance(policy, StorePolicy):
            raise WrongTypeError(f"policy must be a StorePolicy, got {type(policy).__name__}")
        self.meter = RequestMeter()
        """Every call of this store, by operation and key kind (``transport/store/meter.py``)."""
        self.policy = policy or StorePolicy()
        self._rng = random.Random()

    def _run_attempt(self, op: str, fn: Callable[[Attempt], Any], att: Attempt) -> Any:
        return in_watched_thread(fn, att)

    def _call(self, op: str, key: str, fn: Callable[[Attempt], Any], *, nbytes: int = 0) -> Any:
        p = self.policy
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                out = self._run_attempt(op, fn, Attempt(p, nbytes))
                moved = len(out[0] if isinstance(out, tuple) else out) if op == "get" else nbytes
                self.meter.call(op, key, attempts=attempt, seconds=time.monotonic() - start, nbytes=moved)
                return out
            except Exception as e:  # noqa: BLE001 - classified and reported below
                elapsed = time.monotonic() - start
                if not (transient := is_transient(e)) or attempt > p.retries:
                    self.meter.call(op, key, attempts=attempt, seconds=elapsed)
                where = dict(uri=self.uri, op=op, key=key, attempts=attempt, elapsed_s=elapsed)
                if isinstance(e, FileNotFoundError) and op == "get":
                    raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object", **where) from None
                if isinstance(e, ObjectTooLarge):  # the answer, not a failure of the store
                    raise e
                if isinstance(e, SymlinkRefused):
                    raise SymlinkRefused(f"{self.uri}: {op} {key!r} refused: {e}", **where) from None
                if transient and attempt <= p.retries:
                    delay = p.backoff(attempt, self._rng)
                    _log.warning("%s: %s %r attempt %d/%d failed (%s); retrying in %.2f s", self.uri, op, key,
                                 attempt, p.retries + 1, one_line(e, 160), delay)
                    time.sleep(delay)
                    continue
                plural = "s" if attempt > 1 else ""
                why = "" if transient else " (not retried)"
                raise StoreError(f"{self.uri}: {op} {key!r} failed after {attempt} attempt{plural} in "
                                 f"{elapsed:.1f} s{why}: {one_line(e)}", **where) from e


HOP_POLICY = StorePolicy(timeout_s=5.0, retries=1, backoff_s=0.2, backoff_max_s=1.0)
"""Policy of every upstream of a list but the last (``open_store("A,B,C")`` without a
policy): two attempts of 5 s, so a dead or stalled parent is left within about 10 s."""
