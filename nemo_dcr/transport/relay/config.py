"""The relay's settings (:class:`RelayConfig`) and its HTTP API's fixed bounds.  Which keys it
may cache (immutable ones) or write through (acks and join requests) is the key layout's
(``protocol/keys.py``)."""
from __future__ import annotations

from dataclasses import dataclass

from nemo_dcr.configs.check import check_number
from nemo_dcr.errors import ValidationError

PROG = "nemo-dcr relay"
API = "/v1"
MAX_PUT_BYTES = 64 << 10
"""Largest object a relay writes through: an ack or a join request (a few hundred bytes to
a few KB; an ack's error is one line).  A bigger one is answered 413 and not forwarded:
written through a relay it would cost every hop up to the origin (direct writes are
bounded by the reader's ``DOC_LIMITS`` instead)."""
MAX_LIST_KEYS = 1 << 18
"""Most keys one ``list`` answer holds (a version's chunks are hundreds to a few thousand);
a longer listing (planted keys) is answered 413, and children read no longer one."""
DRAIN_PUT_BYTES = 16 << 20
"""An oversized PUT body is read and dropped up to this much before the 413, so that the
client sees the answer rather than a reset connection."""




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
            check_number(f"relay {name}", getattr(self, name), kind=int, min=1)
        for name in ("coalesce_ms", "admit_wait_s"):
            check_number(f"relay {name}", getattr(self, name), kind=float, min=0)
        for name in ("send_timeout_s", "idle_timeout_s", "put_rate", "run_check_s"):
            check_number(f"relay {name}", getattr(self, name), kind=float, positive=True)
        if self.prefetch > self.fetch_threads:
            raise ValidationError(f"relay prefetch ({self.prefetch}) must not exceed fetch_threads "
                                  f"({self.fetch_threads})")
