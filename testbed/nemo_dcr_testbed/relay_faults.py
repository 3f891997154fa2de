"""Relays of the fault campaign (``nemo_dcr_testbed.campaign``, relay classes): test bed
only, nothing in the product imports it.

``python -m nemo_dcr_testbed.relay_faults --role ra --plan-dir P --upstream URI[,URI...]
--listen HOST:PORT --spool DIR`` runs the product's relay server (``transport/relay/``)
unchanged, over an upstream store that is the product's upstream list
(:func:`open_upstreams`) wrapped in :class:`FlippingStore`.  The wrapper does nothing
unless the plan of a chunk's version (``<plan_dir>/v<version>.json``, written by the
driver before the trainer takes that step) holds a ``relay_flip`` fault whose ``target``
is this relay's role: then the bytes of that version's chunk objects come back from the
upstream with one bit flipped, so the relay caches and serves them to its children as a
relay with a bad disk or a hostile operator would.  The relay itself holds no key and
checks nothing; its children must detect the bytes by the signed manifest's digests and
fetch the chunk from their next upstream.

The lying relay (:class:`LyingStore`, the campaign's relay_doc_lie, relay_hides, ack_drop
and bootstrap_lie classes) answers its children wrongly, per plan, as a relay run by
someone without the key can: an older version's genuine ``DECISION.json`` or
``MANIFEST.json`` (or a decision padded over its size cap, which children get as a 413)
for ONE upstream fetch; "not found" for ``HEAD.json``, the manifest or the decision of a
version, or ``HEAD.json`` frozen at an earlier version; an ack PUT answered and not
forwarded, or forwarded with a bit flipped; ``RUN.json``, ``init/INIT.json`` or the init
model flipped, or the init model stalled.  Each lie is logged as one ``"relay_lie"`` line.

The other relay faults (SIGKILL, SIGSTOP, a restart on the same port with an empty
spool) are done by the driver to this process from outside.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from nemo_dcr_testbed.faults import Plans, key_kind
from nemo_dcr.protocol.manifest import DOC_LIMITS, HEAD_KEY, INIT_RECORD_KEY, RUN_KEY, decision_key, manifest_key
from nemo_dcr.transport.store import ObjectInfo, ObjectNotFound, StorePolicy, open_store

ROLES = ("ra", "rb")
"""The campaign's relays: ``ra`` reads from the origin, ``rb`` from ``ra`` (then the origin)."""


def hop_policy(timeout_s: float) -> StorePolicy:
    """The policy of every upstream of a list but the last: two attempts of ``timeout_s``
    (the product's ``HOP_POLICY`` shape with a shorter attempt, so that a stalled relay is
    left within a trial of the campaign, whose ack timeout is a few seconds)."""
    return StorePolicy(timeout_s=timeout_s, retries=1, backoff_s=0.1, backoff_max_s=0.5)


def open_upstreams(uri: str, *, hop_timeout_s: float | None, retry_after_s: float):
    """``open_store(uri)`` for an ordered upstream list, with :func:`hop_policy` on every
    member but the last when ``hop_timeout_s`` is given (the product's ``HOP_POLICY``
    otherwise) and the given ``retry_after_s``.  The last member (the origin) keeps the
    default policy."""
    parts = [u.strip() for u in uri.split(",")]
    if len(parts) == 1:
        return open_store(uri)
    from nemo_dcr.transport.failover import FailoverStore

    if hop_timeout_s is None:
        return open_store(uri, retry_after_s=retry_after_s)
    hop = hop_policy(hop_timeout_s)
    return FailoverStore([open_store(u, policy=hop if i < len(parts) - 1 else None) for i, u in enumerate(parts)],
                         retry_after_s=retry_after_s)


def flip(data: bytes, at: float, bit: int) -> bytes:
    """``data`` with bit ``bit`` of the byte at fraction ``at`` of its length inverted."""
    b = bytearray(data)
    if b:
        b[min(len(b) - 1, int(len(b) * at))] ^= 1 << bit
    return bytes(b)


class FlippingStore:
    """An ``ObjectStore`` that flips one bit of chunk objects as the plan of their version
    says (``relay_flip`` with this relay as target; ``mode`` ``every_chunk`` or
    ``one_chunk``: only rank 0's first chunk); everything else passes through."""

    def __init__(self, inner, plans: Plans):
        self.inner = inner
        self.uri = inner.uri
        self.plans = plans
        self.flipped = 0

    def _fault(self, key: str) -> dict | None:
        kind, version, _ = key_kind(key)
        if kind != "chunk":
            return None
        plan = self.plans.get(version)
        if plan is None or plan["kind"] != "relay_flip":
            return None
        if plan["mode"] == "one_chunk" and not key.endswith("/r000-00000.dcr"):
            return None
        return plan

    def _maybe_flip(self, key: str, data: bytes) -> bytes:
        plan = self._fault(key)
        if plan is None:
            return data
        self.flipped += 1
        print(json.dumps({"relay_flip": key, "role": self.plans.role}), flush=True)
        return flip(data, plan["offset"], plan["bit"])

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._maybe_flip(key, self.inner.get(key, max_bytes=max_bytes))

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        data, info = self.inner.get_with_info(key, max_bytes=max_bytes)
        return self._maybe_flip(key, data), info

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        return self.inner.list(prefix, limit=limit)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def __getattr__(self, name):
        # the upstream list's counters (upstream_stats, ...) for the relay's /v1/stats; never
        # a verifying read, which would go around the flip
        if name == "get_verified":
            raise AttributeError(name)
        return getattr(self.inner, name)


BOOTSTRAP_KEYS = {"run": RUN_KEY, "init_record": INIT_RECORD_KEY, "init_model": "init/model.safetensors"}
"""bootstrap_lie's objects: what a receiver starting from scratch reads before version 0."""
STALL_S = 3600.0
"""bootstrap_lie ``stall``: how long the relay's upstream read of the init model hangs (for
good, within a trial: the driver restarts the liar after the trial)."""
OVERSIZE_PAD = DOC_LIMITS["decision"] + (1 << 10)
"""doc_lie ``oversize``: whitespace put before a genuine decision, so that it is over the
decision's byte cap and a child asking with that cap gets a 413 from the relay."""


class LyingStore(FlippingStore):
    """:class:`FlippingStore` plus the lies of the plan's ``doc_lie``, ``hide``,
    ``ack_drop`` and ``bootstrap_lie`` faults that target this relay (module docstring).
    A lie about an immutable object is made at the relay's ``stat`` (which it does before
    every fetch) and served by the ``get`` after it, with an ``ObjectInfo`` of its own
    size and tag; the relay then caches it like any fetched object.  A one-shot lie is
    counted across restarts of the relay (``Plans.once``)."""

    def __init__(self, inner, plans: Plans):
        super().__init__(inner, plans)
        self._pending: dict[str, tuple[bytes, ObjectInfo]] = {}
        self._honest_head: bytes | None = None  # the last HEAD.json passed on as it was (frozen HEAD)
        self.lies = 0

    def _log(self, what: str, key: str) -> None:
        self.lies += 1
        print(json.dumps({"relay_lie": what, "key": key, "role": self.plans.role}), flush=True)

    @staticmethod
    def _info(key: str, data: bytes, why: str) -> ObjectInfo:
        return ObjectInfo(key=key, size=len(data), tag=f"{why}-{hashlib.sha256(data).hexdigest()[:16]}")

    def _lie_plan(self, key: str) -> dict | None:
        """The fault of the plan that makes this relay lie about ``key`` (None: honest)."""
        kind, version, _ = key_kind(key)
        if key in BOOTSTRAP_KEYS.values():
            plan = self.plans.latest()
            if plan is not None and plan["kind"] == "bootstrap_lie" and BOOTSTRAP_KEYS[plan["obj"]] == key:
                return plan
            return None
        if kind in ("manifest", "decision"):
            plan = self.plans.get(version)
            if plan is not None and plan["kind"] in ("doc_lie", "hide") and plan["doc"] == kind:
                return plan
        return None

    def _make_lie(self, key: str, plan: dict) -> bytes | None:
        """The wrong bytes for ``key`` (None: nothing to lie with, pass it on)."""
        kind, version, _ = key_kind(key)
        if plan["kind"] == "bootstrap_lie":
            return flip(self.inner.get(key), plan["offset"], plan["bit"])
        if plan["mode"] == "oversize":
            return b" " * OVERSIZE_PAD + self.inner.get(key)
        # "older": the genuine document of an earlier version (the newest one there is)
        older = decision_key if kind == "decision" else manifest_key
        for w in range(version - 1, 0, -1):
            try:
                return self.inner.get(older(w))
            except ObjectNotFound:
                continue
        return b" " * OVERSIZE_PAD + self.inner.get(key) if kind == "decision" else None

    def _head(self) -> tuple[bytes, ObjectInfo] | None:
        """HEAD.json as this relay answers it: hidden or frozen while the plan of the version
        it names says so."""
        data, info = self.inner.get_with_info(HEAD_KEY)
        try:
            version = int(json.loads(data)["version"])
        except (ValueError, KeyError, TypeError):
            return data, info
        plan = self.plans.get(version)
        if plan is None or plan["kind"] != "hide" or plan["doc"] != "head":
            self._honest_head = data
            return data, info
        if plan["mode"] == "frozen" and self._honest_head is not None:
            self._log("frozen_head", HEAD_KEY)
            return self._honest_head, self._info(HEAD_KEY, self._honest_head, "frozen")
        self._log("hidden", HEAD_KEY)
        return None

    def stat(self, key: str) -> ObjectInfo | None:
        if key == HEAD_KEY:
            try:
                got = self._head()
            except ObjectNotFound:
                return None
            return None if got is None else got[1]
        if key in self._pending:
            return self._pending[key][1]
        plan = self._lie_plan(key)
        if plan is None:
            return self.inner.stat(key)
        if plan["kind"] == "hide":
            if self.inner.stat(key) is not None:
                self._log("hidden", key)
            return None
        info = self.inner.stat(key)
        if info is None or plan.get("mode") == "stall" or not self.plans.once(plan, f"lie-{key.replace('/', '_')}"):
            return info
        lie = self._make_lie(key, plan)
        if lie is None:
            return info
        self._log(plan.get("mode") or plan["kind"], key)
        self._pending[key] = (lie, self._info(key, lie, "lie"))
        return self._pending[key][1]

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        if key == HEAD_KEY:
            got = self._head()
            if got is None:
                raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object")
            return got
        if key in self._pending:
            return self._pending.pop(key)
        plan = self._lie_plan(key)
        if plan is not None and plan["kind"] == "hide":
            self._log("hidden", key)
            raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object")
        if plan is not None and plan.get("mode") == "stall":
            self._log("stall", key)
            time.sleep(STALL_S)
        return super().get_with_info(key, max_bytes=max_bytes)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def put(self, key: str, data: bytes) -> None:
        kind, version, rid = key_kind(key)
        plan = self.plans.get(version) if kind == "ack" else None
        if plan is not None and plan["kind"] == "ack_drop" and plan.get("receiver") in (None, rid):
            self._log(f"ack_{plan['mode']}", key)
            if plan["mode"] == "drop":
                return  # answered as written (the relay's 204), never forwarded
            data = flip(data, 0.5, 0)
        self.inner.put(key, data)


def relay_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.relay_faults")
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--upstream", required=True, help="the relay's ordered upstream list, ending with the origin")
    ap.add_argument("--listen", required=True, help="HOST:PORT")
    ap.add_argument("--spool", required=True)
    ap.add_argument("--hop-timeout-s", type=float, default=None)
    ap.add_argument("--retry-after-s", type=float, default=30.0)
    ap.add_argument("--standby", default=None,
                    help="a warm spare: import and open everything, then wait for this file to exist before "
                         "binding (so that the driver's restart of a relay takes a bind, not a process start)")
    args = ap.parse_args(argv)

    import asyncio
    import time

    import aiohttp.web  # noqa: F401 - imported before the standby wait, not after

    from nemo_dcr.transport.relay import Relay, RelayConfig, parse_listen

    host, port = parse_listen(args.listen)
    store = LyingStore(open_upstreams(args.upstream, hop_timeout_s=args.hop_timeout_s,
                                         retry_after_s=args.retry_after_s), Plans(args.plan_dir, args.role))
    if args.standby:
        print(json.dumps({"relay": "standby", "role": args.role}), flush=True)
        while not os.path.exists(args.standby):
            time.sleep(0.02)
    os.makedirs(args.spool, exist_ok=True)

    async def serve() -> None:
        relay = Relay(store, RelayConfig(spool_dir=args.spool, max_memory_bytes=256 << 20))
        bound = await relay.start(host, port)
        print(json.dumps({"relay": "listening", "role": args.role, "address": f"{bound[0]}:{bound[1]}"}), flush=True)
        await asyncio.Event().wait()  # until the driver kills it

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(relay_main())
