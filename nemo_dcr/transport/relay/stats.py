"""The relay's counters, one typed field each (``/v1/stats`` serves them with the state
gauges of ``Relay.stats``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class RelayCounters:
    """Monotonic counts since the relay started (``*_peak_bytes``: high-water marks)."""

    requests: int = 0
    served_objects: int = 0
    served_bytes: int = 0
    cache_hits: int = 0
    coalesced: int = 0
    upstream_fetches: int = 0
    upstream_fetch_bytes: int = 0
    upstream_chunk_bytes: int = 0
    upstream_stats: int = 0
    upstream_lists: int = 0
    upstream_puts: int = 0
    upstream_failures: int = 0
    prefetch_started: int = 0
    prefetched: int = 0
    prefetch_failed: int = 0
    rejected: int = 0
    not_found: int = 0
    too_large: int = 0
    bad_requests: int = 0
    acks_forwarded: int = 0
    versions_dropped: int = 0
    memory_evictions: int = 0
    spool_writes: int = 0
    spool_evictions: int = 0
    send_timeouts: int = 0
    memory_peak_bytes: int = 0
    spool_peak_bytes: int = 0
    connections_refused: int = 0
    puts_throttled: int = 0
    lists_too_long: int = 0
    run_changes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
