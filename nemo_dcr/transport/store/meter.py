"""Request accounting: what a store client asked of its store, by operation and key kind.

Every store call of a ``BoundedStore`` (local directory, fsspec, relay client) is counted
once, whatever its retries, under ``"<op>:<kind>"``: ``op`` is the store operation (``get``,
``put``, ``stat``, ``exists``, ``list``, ``delete``) and ``kind`` what the key names in the
store's layout (``protocol.keys.key_kind``: ``chunk``, ``manifest``, ``head``, ``ack``, ...).
Each entry holds the calls, their attempts, the seconds they took (summed over threads, so
parallel calls add up) and the bytes they moved (read for ``get``, written for ``put``).

On fsspec back ends a store call may be more than one request to the server (S3: a ``get``
of unknown size is a ``HEAD`` then a ``GET``); those requests are counted too, under
``requests`` by their fsspec call (``info``, ``cat_file``, ``pipe_file``, ``lsdir``, ...).

The sender and the receiver report the difference between two snapshots (``diff``) per
version: the trainer's upload, manifest, ack polls and
decision; the receiver's polls, listings and chunk reads since its previous answer.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from nemo_dcr.protocol.keys import key_kind


class RequestMeter:
    """Thread-safe counters of one store client (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, list] = {}  # "op:kind" -> [calls, attempts, seconds, bytes]
        self._requests: dict[str, list] = {}  # fsspec call -> [requests, seconds]

    def call(self, op: str, key: str, *, attempts: int, seconds: float, nbytes: int = 0) -> None:
        name = f"{op}:{key_kind(key)}"
        with self._lock:
            row = self._calls.setdefault(name, [0, 0, 0.0, 0])
            row[0] += 1
            row[1] += attempts
            row[2] += seconds
            row[3] += nbytes

    def request(self, name: str, seconds: float) -> None:
        with self._lock:
            row = self._requests.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += seconds

    def snapshot(self) -> dict:
        """``{"calls": {"op:kind": {"n", "attempts", "s", "bytes"}}, "requests": {name: {"n", "s"}}}``."""
        with self._lock:
            return {"calls": {k: {"n": n, "attempts": a, "s": s, "bytes": b} for k, (n, a, s, b) in self._calls.items()},
                    "requests": {k: {"n": n, "s": s} for k, (n, s) in self._requests.items()}}


def diff(now: Mapping, before: Mapping | None) -> dict:
    """What ``now`` counted after the snapshot ``before`` (None: everything), entries with no
    new call left out; seconds rounded to microseconds."""
    before = before or {}
    out: dict = {}
    for table in ("calls", "requests"):
        old = before.get(table, {})
        rows = {}
        for name, row in now.get(table, {}).items():
            prev = old.get(name, {})
            d = {f: row[f] - prev.get(f, 0) for f in row}
            if d["n"]:
                rows[name] = {f: (round(v, 6) if isinstance(v, float) else v) for f, v in d.items()}
        out[table] = dict(sorted(rows.items()))
    return out


def combined(snapshots: Iterable[Mapping]) -> dict:
    """The sum of several snapshots (a failover list's members, several stores of one side)."""
    out: dict = {"calls": {}, "requests": {}}
    for snap in snapshots:
        for table in ("calls", "requests"):
            for name, row in snap.get(table, {}).items():
                acc = out[table].setdefault(name, {f: 0 for f in row})
                for f, v in row.items():
                    acc[f] = acc.get(f, 0) + v
    return out


def snapshot_of(store) -> dict:
    """A snapshot of ``store``'s counters; a failover list (``stores``) sums its members'."""
    members = getattr(store, "stores", None)
    if members is not None and getattr(store, "meter", None) is None:
        return combined(snapshot_of(s) for s in members)
    meter = getattr(store, "meter", None)
    return meter.snapshot() if meter is not None else {"calls": {}, "requests": {}}
