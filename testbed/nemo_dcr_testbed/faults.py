"""Fault injection for the fault campaign (``nemo_dcr_testbed.campaign``): test bed only,
nothing in the product imports it.

The campaign driver writes one plan per version, ``<plan_dir>/v<version>.json``, before it
lets the trainer take that step.  Every process of the run (trainer ranks, receivers)
wraps its store in :class:`FaultyStore` and, on a receiver, its served model in
:class:`FaultyServed`; both look up the plan of the version a key (or an apply) belongs
to and act only when the plan names this process (``target``: ``r0``, ``r1``,
``rank0``, ``rank1``); in a relay epoch the receivers read their upstream list without
:class:`FaultyStore` (``--no-store-faults``: the faults are the relays', see
``testbed/nemo_dcr_testbed/relay_faults.py``).  A plan is ``{"trial", "cls", "faults": [{"kind", "target", ...}]}``
(at most one fault per process); the kinds are made in ``nemo_dcr_testbed.campaign.kinds``
(``hold``: a trainer rank sleeps before a put, so a pipelined version stays in flight
while the driver kills the ranks).  ``--join`` makes a receiver ask to become a member
(elastic membership: the product's ``Follower.join``, as ``nemo-dcr receive --join``).

:func:`receiver_main` (``python -m nemo_dcr_testbed.faults``) is ``nemo-dcr receive`` for
the transformers runtime, built by the product's ``build_receiver`` with both wrappers
through its supported injection points (``wrap_served``, ``before_fetch``), and one extra: the driver asks for the served
state by writing ``<dir>/req``; the receiver then steps the protocol until it is idle and
not awaiting a decision (bounded), and writes every parameter and buffer it serves plus
its protocol state (``status.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import signal
import sys
import time

from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.transport.store import ObjectNotFound, StoreError

_VERSIONED = re.compile(r"^v/(\d{8})/(MANIFEST\.json|DECISION\.json|chunks/r(\d{3})-(\d{5})\.dcr)$")
_ACK = re.compile(r"^acks/([A-Za-z0-9_.\-]+)/(\d{8})\.json$")


def key_kind(key: str) -> tuple[str | None, int | None, str | None]:
    """(kind, version, receiver) of a store key: kind in manifest, decision, chunk, ack."""
    m = _VERSIONED.match(key)
    if m:
        kind = {"MANIFEST.json": "manifest", "DECISION.json": "decision"}.get(m.group(2), "chunk")
        return kind, int(m.group(1)), None
    m = _ACK.match(key)
    if m:
        return "ack", int(m.group(2)), m.group(1)
    return None, None, None


class Plans:
    def __init__(self, plan_dir: str, role: str):
        self.dir = plan_dir
        self.role = role
        self._cache: dict[int, dict | None] = {}

    def get(self, version: int | None) -> dict | None:
        """The fault of ``version``'s plan that targets this process (None if none)."""
        if version is None:
            return None
        if version not in self._cache:
            path = os.path.join(self.dir, f"v{version}.json")
            try:
                with open(path) as f:
                    plan = json.load(f)
            except FileNotFoundError:
                return None  # not written yet: look again next time
            mine = [f for f in plan["faults"] if f.get("target") == self.role]
            self._cache[version] = {**mine[0], "trial": plan["trial"]} if mine else None
        return self._cache[version]

    def latest(self) -> dict | None:
        """The fault of the newest plan (the highest ``v<n>.json`` written so far) that
        targets this process: what applies to objects of no version (``RUN.json``,
        ``init/*``), which a node reads when it bootstraps."""
        numbers = [int(n[1:-5]) for n in os.listdir(self.dir) if re.fullmatch(r"v[0-9]+\.json", n)]
        return self.get(max(numbers)) if numbers else None

    def once(self, plan: dict, what: str) -> bool:
        """True the first time ``what`` is asked for this plan (across process restarts)."""
        marker = os.path.join(self.dir, f"done-{plan['trial']}-{self.role}-{what}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _reseal(data: bytes, key: bytes | None, kind: str, **changes) -> bytes:
    doc = json.loads(data)
    doc.pop("signature", None)
    doc.update(changes)
    return Sealer(key).seal(kind, doc)


def tamper_doc(data: bytes, mode: str, kind: str, real_key: bytes | None, store, version: int) -> bytes:
    """A manipulated copy of a sealed document ``data`` of ``kind`` (manifest, ack, decision)."""
    doc = json.loads(data)
    if mode == "corrupt":
        b = bytearray(data)
        i = len(b) // 2
        b[i] = ord("0") if b[i] != ord("0") else ord("1")
        return bytes(b)
    if mode == "truncate":
        return data[: len(data) // 2]
    if mode == "unsigned":
        return _reseal(data, None, kind)
    if mode == "forged":  # a store writer without the key, making the document say what it wants
        changes = {"ok": True, "error": ""} if kind == "ack" else {}
        if kind == "decision":
            changes = {"commit": not doc["commit"]}
        if kind == "manifest":
            changes = {"chunks": doc["chunks"] + doc["chunks"][:1]}
        return _reseal(data, secrets.token_bytes(32), kind, **changes)
    if mode == "foreign_signed":  # another run sharing the key
        return _reseal(data, real_key, kind, run_id=secrets.token_hex(16))
    if mode == "replay_prev":  # the genuine document of the previous version, replayed here
        from nemo_dcr.protocol.manifest import ack_key, decision_key, manifest_key

        prev = version - 1
        key = {"manifest": lambda: manifest_key(prev), "decision": lambda: decision_key(prev),
               "ack": lambda: ack_key(doc["receiver"], prev)}[kind]()
        try:
            return store.get(key)
        except ObjectNotFound:
            return _reseal(data, real_key, kind, version=prev)
    if mode == "wrong_receiver":  # genuine ack fields for another receiver (insider replay)
        other = "r1" if doc.get("receiver") == "r0" else "r0"
        return _reseal(data, real_key, kind, receiver=other)
    if mode == "reorder_signed":  # chunk list reversed, sealed with the key: must still apply exactly
        return _reseal(data, real_key, kind, chunks=doc["chunks"][::-1])
    if mode == "dup_entry_signed":  # a chunk listed twice, sealed with the key: must be refused
        return _reseal(data, real_key, kind, chunks=doc["chunks"] + doc["chunks"][:1])
    raise ValueError(f"unknown document tamper {mode!r}")


def tamper_chunk(data: bytes, mode: str, store, key: str, version: int) -> bytes:
    if mode == "corrupt":
        b = bytearray(data)
        b[len(b) // 2] ^= 0x10
        return bytes(b)
    if mode == "truncate":
        return data[: max(1, len(data) - 7)]
    if mode == "duplicate":
        return data + data
    if mode == "reorder":  # another chunk of the same version served under this key
        prefix = key.rsplit("/", 1)[0] + "/"
        others = [k for k in store.list(prefix) if k != key]
        return store.get(others[0]) if others else data[::-1]
    if mode == "foreign":  # the same chunk position of the previous version (another delta)
        prev = key.replace(f"v/{version:08d}/", f"v/{version - 1:08d}/")
        try:
            return store.get(prev)
        except ObjectNotFound:
            return data.replace(b"run_id", b"run_xx")
    if mode == "missing":
        raise ObjectNotFound(f"(fault) no object {key!r}")
    raise ValueError(f"unknown chunk tamper {mode!r}")


class FaultyStore:
    """An ``ObjectStore`` that misbehaves as the plan of a key's version says."""

    def __init__(self, inner, plans: Plans, key: bytes | None):
        self.inner = inner
        self.uri = inner.uri
        self.plans = plans
        self.key = key
        self._reads: dict[tuple[int, str], int] = {}

    def _count(self, plan: dict, what: str) -> int:
        """How many times ``what`` happened for this plan, this one included, over every
        incarnation of this process (a restarted receiver does not see the fault anew)."""
        k = (plan["trial"], what)
        n = self._reads.get(k)
        if n is None:
            n = sum(1 for f in os.listdir(self.plans.dir) if f.startswith(f"count-{plan['trial']}-{self.plans.role}-{what}-"))
        n += 1
        self._reads[k] = n
        if n <= 16:
            open(os.path.join(self.plans.dir, f"count-{plan['trial']}-{self.plans.role}-{what}-{n}"), "w").close()
        return n

    def put(self, key: str, data: bytes) -> None:
        kind, version, rid = key_kind(key)
        plan = self.plans.get(version)
        if plan is not None:
            k = plan["kind"]
            if k == "kill" and plan["point"] == f"{kind}_put_before" and self.plans.once(plan, "kill"):
                die()
            if k == "hold" and plan["key_kind"] == kind:  # a slow writer: the version stays in flight
                time.sleep(plan["hold_s"])
            if k == "store_error" and plan["op"] == "put" and plan["key_kind"] == kind \
                    and self._count(plan, "put") <= plan["times"]:
                if plan.get("after_write"):
                    self.inner.put(key, data)
                raise StoreError(f"(fault) put {key!r} failed")
        self.inner.put(key, data)
        if plan is not None and plan["kind"] == "kill" and plan["point"] == f"{kind}_put_after" \
                and self.plans.once(plan, "kill"):
            die()

    def stat(self, key: str):
        """The inner object's identity, as a reader would see it under the plan: a tamper that
        lasts for every read is one stable (other) object; one that lasts for the first few
        reads is a new object per read (what a writer replacing it each time would give)."""
        info = self.inner.stat(key)
        kind, version, rid = key_kind(key)
        plan = self.plans.get(version)
        if info is None or plan is None or plan["kind"] != "tamper" or plan["obj"] != kind \
                or plan.get("receiver") not in (None, rid):
            return info
        suffix = "tampered" if plan["reads"] >= 1_000_000 else f"read-{secrets.token_hex(4)}"
        return dataclasses.replace(info, tag=f"{info.tag}-{suffix}")

    def get_with_info(self, key: str, *, max_bytes: int | None = None):
        info = self.stat(key)
        if info is None:
            raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object")
        return self.get(key, max_bytes=max_bytes), info

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        kind, version, rid = key_kind(key)
        plan = self.plans.get(version)
        if plan is None:
            return self.inner.get(key, max_bytes=max_bytes)
        k = plan["kind"]
        if k == "kill" and plan["point"] == f"{kind}_get" and self.plans.once(plan, "kill"):
            die()
        if k == "store_error" and plan["op"] == "get" and plan["key_kind"] == kind \
                and self._count(plan, "get") <= plan["times"]:
            raise StoreError(f"(fault) get {key!r} failed")
        data = self.inner.get(key, max_bytes=max_bytes)
        if k == "tamper" and plan["obj"] == kind and (plan.get("receiver") in (None, rid)) \
                and self._count(plan, "tamper") <= plan["reads"]:
            if kind == "chunk":
                return tamper_chunk(data, plan["mode"], self.inner, key, version)
            return tamper_doc(data, plan["mode"], kind, self.key, self.inner, version)
        return data

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        return self.inner.list(prefix, limit=limit)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


class FaultyServed:
    """A ``ServedModel`` that refuses or fails part-way through an apply, per plan."""

    def __init__(self, inner, plans: Plans):
        self.inner = inner
        self.plans = plans
        self.version: int | None = None  # set by the receiver before each version's apply
        self._armed = False

    def tensor_specs(self):
        return self.inner.tensor_specs()

    def canonical_bits(self, name):
        return self.inner.canonical_bits(name)

    def verify_dense(self, dense):
        return self.inner.verify_dense(dense)

    def sample(self):
        return self.inner.sample()

    def validate(self, deltas):
        plan = self.plans.get(self.version)
        self._armed = True  # the next apply() is the version's own (later ones are repairs)
        if plan is not None and plan["kind"] == "refuse":
            from nemo_dcr.receiver.errors import DeltaValidationError

            raise DeltaValidationError(f"(fault) receiver refuses v{self.version}")
        self.inner.validate(deltas)

    def apply(self, deltas):
        armed, self._armed = self._armed, False
        plan = self.plans.get(self.version) if armed else None
        if plan is not None and plan["kind"] in ("apply_exception", "kill") \
                and (plan["kind"] == "apply_exception" or plan["point"] == "mid_apply"):
            n = min(plan["after_records"], len(deltas))
            if n:
                self.inner.apply(deltas[:n])
            if plan["kind"] == "kill":
                if self.plans.once(plan, "kill"):
                    die()
                return self.inner.apply(deltas[n:])
            raise RuntimeError(f"(fault) apply interrupted after {n} of {len(deltas)} records")
        return self.inner.apply(deltas)


# --------------------------------------------------------------------- receiver entry
def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


BUSY_LOG_S = 30.0


class BusyWatch:
    """A settle request starts at the first follower step that makes no progress.  While
    steps keep progressing it waits; once it has waited ``BUSY_LOG_S`` :meth:`note`
    returns what to log, once per wait (``"settle delayed"`` with the follower's state):
    what the driver's record of a receiver that never settled then shows."""

    def __init__(self, after_s: float = BUSY_LOG_S):
        self.after_s = after_s
        self.since: float | None = None
        self.steps = 0
        self.logged = False

    def note(self, waiting_on_progress: bool, t_step: float, now: float) -> dict | None:
        if not waiting_on_progress:
            self.since, self.steps, self.logged = None, 0, False
            return None
        self.since = t_step if self.since is None else self.since
        self.steps += 1
        if self.logged or now - self.since <= self.after_s:
            return None
        self.logged = True
        return {"busy_s": round(now - self.since, 1), "steps": self.steps, "last_step_s": round(now - t_step, 2)}


def receiver_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.faults")
    ap.add_argument("--store", required=True)
    ap.add_argument("--receiver-id", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--init-dir", required=True)
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--dir", required=True, help="this receiver's directory (req / status / dumps)")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--hop-timeout-s", type=float, default=None,
                    help="for an upstream list (reading through relays): one attempt's timeout on every "
                         "upstream but the last (default: the product's HOP_POLICY)")
    ap.add_argument("--retry-after-s", type=float, default=30.0,
                    help="for an upstream list: how long a failed upstream rests before it is preferred again")
    ap.add_argument("--no-store-faults", action="store_true",
                    help="read the store as opened, without FaultyStore (relay epochs: the faults are the relays', "
                         "and the receiver's chunk reads must reach the upstream list's verified fetch)")
    ap.add_argument("--download-init", action="store_true",
                    help="download version 0 through --store (the product's bootstrap: RUN.json, init/INIT.json, "
                         "the init files, each checked) instead of loading --init-dir (bootstrap_lie trials)")
    ap.add_argument("--join", action="store_true",
                    help="elastic membership: ask to join (the product's Follower.join, as nemo-dcr receive --join)")
    args = ap.parse_args(argv)

    from nemo_dcr.protocol.manifest import HEAD_KEY, Head
    from nemo_dcr.protocol.signing import load_key
    from nemo_dcr.receiver.bootstrap import build_receiver
    from nemo_dcr.receiver.engine import ReceiverConfig
    from nemo_dcr_testbed.relay_faults import open_upstreams

    rid = args.receiver_id
    key = load_key(None)
    sealer = Sealer(key)
    plans = Plans(args.plan_dir, rid)
    store = open_upstreams(args.store, hop_timeout_s=args.hop_timeout_s, retry_after_s=args.retry_after_s)
    if not args.no_store_faults:
        store = FaultyStore(store, plans, key)
    served: FaultyServed | None = None

    def wrap(inner):
        nonlocal served
        served = FaultyServed(inner, plans)
        return served

    def before_fetch(manifest):
        # every apply path (a version, a replayed one, each link of a composed catch-up)
        # fetches its manifest first: the plan that applies is that version's
        served.version = manifest.version

    # the journal on disk (as over persistent weights); one an earlier incarnation left is
    # dropped, since this one reloads version 0
    session = build_receiver(store, sealer, ReceiverConfig(receiver_id=rid, model_id=args.model_id),
                             state_dir=args.state_dir, init_dir=None if args.download_init else args.init_dir,
                             timeout_s=120, durable_journal=True,
                             wrap_served=wrap, before_fetch=before_fetch)
    rx, follower = session.receiver, session.follower
    follower.join = args.join
    run_id = session.run_id
    os.makedirs(args.dir, exist_ok=True)
    print(json.dumps({"receiver": rid, "ready": True, "run_id": run_id}), flush=True)
    req_path, stop_path = os.path.join(args.dir, "req"), os.path.join(args.dir, "stop")
    answered = None
    busy = BusyWatch()
    while not os.path.exists(stop_path):
        try:
            with open(req_path) as f:
                req = f.read().strip()
        except FileNotFoundError:
            req = None
        t_step = time.monotonic()
        progressed = follower.step()
        late = busy.note(bool(req and req != answered and progressed), t_step, time.monotonic())
        if late is not None:  # the driver's settle timeout would otherwise be a hang with nothing to show
            st = follower.state
            print(json.dumps({"receiver": rid, "event": "settle delayed", **late, "committed": st.committed,
                              "handled": st.handled, "awaiting": st.awaiting, "tentative": st.tentative,
                              "member": follower.member}), flush=True)
        if req and req != answered and not progressed:
            # settle what the trainer decided (bounded: a decision may be unreadable for a while)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if follower.step():
                    continue
                st = follower.state
                behind = False
                if st.awaiting is None:  # a restarted receiver: catch up to the trainer's base first
                    # (through the follower's own bounded reader: HEAD.json may hold anything)
                    head = follower.docs.read(HEAD_KEY, Head)
                    behind = head is not None and st.committed < head.doc.base_version
                if st.awaiting is None and not behind:
                    break
                time.sleep(0.02)
            st = follower.state
            dump = os.path.join(args.dir, f"dump-{req}.safetensors")
            session.runtime.dump(dump)
            _write_json(os.path.join(args.dir, "status.json"),
                        {"req": req, "committed": st.committed, "tentative": st.tentative,
                         "awaiting": st.awaiting, "handled": st.handled, "decided": st.decided,
                         "held_version": rx.held_version, "journal_active": rx.journal.active, "dump": dump,
                         "member": follower.member})
            answered = req
            continue
        if not progressed:
            time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(receiver_main())
