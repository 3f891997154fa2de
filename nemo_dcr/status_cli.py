"""``nemo-dcr status --store URI [--key-file K] [--relay URL ...] [--json]``: where a run stands.

From the store's signed documents only (``docs/protocol.md``, "Status"): the run, the committed
version, the version in flight (a manifest newer than the last decision), each receiver's last
ack and the version it holds, the members (joins, evictions, join requests), the snapshots,
and, given relays, each relay's ``/v1/stats``.  ``HEAD.json`` and ``COMMITTED.json`` are shown
as the hints they are, never used.

Every document is opened with the run's key through the protocol's own codec.  One that does
not open with it (unsigned, bad signature) is shown as ``FORGED``, one that cannot be parsed
as ``MALFORMED``, one of another run, receiver, version or manifest as ``REJECTED``: none of
them is trusted or counted as an ack.  Without a key on a signed run every document is
``UNVERIFIED``: shown, never counted.  Without a key on an unsigned run documents are taken as
written (``unsigned``: integrity against accidents only, as the trainer takes them).

Human-readable lines by default, ``--json`` one JSON document.  Errors are one line on stderr:
exit status 2 for bad input (a store that does not exist or holds no run, a key file that does
not load or does not open the run), 1 when a given relay could not be read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nemo_dcr.errors import DcrError, FormatError, ValidationError
from nemo_dcr.protocol.commit import JOIN_SCAN_KEYS
from nemo_dcr.protocol.keys import (
    ACK_PREFIX,
    COMMITTED_KEY,
    HEAD_KEY,
    JOIN_PREFIX,
    RUN_KEY,
    ack_key,
    ack_key_parts,
    decision_key,
    join_key_receiver,
    key_kind,
    key_version,
    manifest_key,
    snapshot_key,
)
from nemo_dcr.protocol.manifest import (
    DOC_LIMITS,
    Ack,
    Committed,
    Decision,
    Head,
    JoinRequest,
    Manifest,
    doc_digest,
)
from nemo_dcr.protocol.signing import UNSIGNED, Sealer, SignatureError, load_key, signature_of
from nemo_dcr.protocol.snapshot import SNAPSHOT_RECORD, SnapshotError, SnapshotRecord, listed_versions, read_record
from nemo_dcr.transport.store import ObjectNotFound

PROG = "nemo-dcr status"
HISTORY = 256
"""Newest version numbers whose decisions are read (the committed version, aborts, joins and
evictions); the output says when older ones were left out."""
ACK_DEPTH = 16
"""Per receiver, newest ack objects read to find its last one that counts."""
SNAPSHOTS = 8
"""Newest snapshot directories looked at."""
RELAY_TIMEOUT_S = 5.0
RELAY_STATS_BYTES = 4 << 20

VERIFIED, UNSIGNED_OK, UNVERIFIED = "verified", "unsigned", "UNVERIFIED"
FORGED, MALFORMED, REJECTED = "FORGED", "MALFORMED", "REJECTED"
TRUSTED = (VERIFIED, UNSIGNED_OK)


class StatusError(ValidationError):
    """A store, key file or relay ``status`` cannot use: one line, exit ``status``."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class Judged:
    """One store document as status judged it: ``trust`` is one of ``verified``, ``unsigned``
    (taken as written: the run is unsigned), ``UNVERIFIED`` (a signed run read without its
    key), ``FORGED``, ``MALFORMED``, ``REJECTED``."""

    key: str
    trust: str
    doc: Any = None
    digest: str = ""
    error: str = ""

    @property
    def trusted(self) -> bool:
        return self.trust in TRUSTED

    def as_dict(self) -> dict:
        return {"key": self.key, "trust": self.trust, **({"error": self.error} if self.error else {})}


class Status:
    """The documents of one run, read once and judged (``collect`` builds the report)."""

    def __init__(self, store, sealer: Sealer, run_signed: bool, run_id: str):
        self.store, self.sealer, self.run_id = store, sealer, run_id
        # a signed run read without its key: nothing can be checked, nothing is trusted
        self.unverified = run_signed and not sealer.signed
        self.suspect: list[Judged] = []
        self._decisions: dict[int, Judged | None] = {}
        self._manifests: dict[int, Judged | None] = {}

    def open(self, key: str, cls) -> Judged | None:
        """The document at ``key`` judged (None: absent).  Bounded by the kind's byte cap."""
        try:
            data = self.store.get(key, max_bytes=DOC_LIMITS[cls.KIND])
        except ObjectNotFound:
            return None
        except DcrError as e:
            if isinstance(e, FormatError):  # over the cap: never read
                return self._suspect(Judged(key, MALFORMED, error=f"{type(e).__name__}: {e}"))
            raise
        try:
            doc = cls.from_json(data, self.sealer)
        except SignatureError as e:
            return self._suspect(Judged(key, FORGED, error=str(e)))
        except DcrError as e:
            return self._suspect(Judged(key, MALFORMED, error=f"{type(e).__name__}: {e}"))
        if doc.run_id != self.run_id:
            why = f"of run {doc.run_id}, not {self.run_id}"
            return self._suspect(Judged(key, REJECTED, doc, doc_digest(data), why))
        if self.unverified:
            trust = FORGED if signature_of(data) == UNSIGNED else UNVERIFIED  # unsigned on a signed run: forged
            judged = Judged(key, trust, doc, doc_digest(data),
                            "unsigned, on a signed run" if trust == FORGED else "not checked: no key given")
            return self._suspect(judged) if trust == FORGED else judged
        return Judged(key, VERIFIED if self.sealer.signed else UNSIGNED_OK, doc, doc_digest(data))

    def reject(self, judged: Judged, why: str) -> Judged:
        judged.trust, judged.error = REJECTED, why
        return self._suspect(judged)

    def _suspect(self, judged: Judged) -> Judged:
        self.suspect.append(judged)
        return judged

    def decision(self, v: int) -> Judged | None:
        return self._of_version(self._decisions, v, decision_key(v), Decision, "decision")

    def manifest(self, v: int) -> Judged | None:
        return self._of_version(self._manifests, v, manifest_key(v), Manifest, "manifest")

    def _of_version(self, cache: dict, v: int, key: str, cls, what: str) -> Judged | None:
        """The document of version ``v`` under ``key``, read once; one of another version
        under that key is REJECTED."""
        if v not in cache:
            got = self.open(key, cls)
            if got is not None and got.doc is not None and got.doc.version != v and got.trust != REJECTED:
                got = self.reject(got, f"a {what} of v{got.doc.version} under v{v}'s key")
            cache[v] = got
        return cache[v]

    def manifest_digest(self, v: int) -> str | None:
        """The digest of the manifest ``v`` was published with, as trusted documents say
        (its decision names it; undecided, the manifest itself); None when unknown."""
        d = self.decision(v)
        if d is not None and d.trusted and d.doc.manifest_digest:
            return d.doc.manifest_digest
        m = self.manifest(v)
        return m.digest if m is not None and m.trusted else None


def _versions(store) -> tuple[list[int], bool]:
    """Version numbers with a manifest or decision key listed (newest first), the newest
    ``HISTORY`` of them; and whether older ones were left out."""
    found = set()
    for key in store.list("v/"):
        v = key_version(key)
        if v is not None and key_kind(key) in ("manifest", "decision"):
            found.add(v)
    ordered = sorted(found, reverse=True)
    return ordered[:HISTORY], len(ordered) > HISTORY


def _ack_keys(store) -> dict[str, list[int]]:
    """receiver -> versions of its ack keys (newest first), as ``keys.ack_key`` writes them."""
    out: dict[str, list[int]] = {}
    for key in store.list(ACK_PREFIX):
        got = ack_key_parts(key)  # None for a join request's key
        if got is not None:
            out.setdefault(got[0], []).append(got[1])
    return {rid: sorted(vs, reverse=True) for rid, vs in sorted(out.items())}


def collect(store, sealer: Sealer, run, run_signed: bool, relays: list[str]) -> dict:
    """The report (the ``--json`` document)."""
    st = Status(store, sealer, run_signed, run.run_id)
    versions, truncated = _versions(store)
    decided: dict[int, Judged] = {}
    claimed = None  # a signed run read without its key: the newest commit the store claims
    for v in versions:
        d = st.decision(v)
        if d is not None and d.trusted:
            decided[v] = d
        elif d is not None and d.trust == UNVERIFIED and d.doc.commit and claimed is None:
            claimed = v
    last_decided = max(decided, default=0)
    commits = [v for v in sorted(decided, reverse=True) if decided[v].doc.commit]
    committed_v = commits[0] if commits else 0
    committed: dict[str, Any] = {"version": committed_v}
    if committed_v:
        dec = decided[committed_v].doc
        committed.update(base_version=dec.base_version, receivers=list(dec.receivers),
                         decision_digest=decided[committed_v].digest)
        man = st.manifest(committed_v)
        if man is not None and man.trusted and man.digest == dec.manifest_digest:
            committed["wire_bytes"] = man.doc.wire_bytes
    if claimed is not None:
        committed["unverified_claim"] = claimed
    aborted = sorted(v for v in decided if not decided[v].doc.commit)

    # in flight: a trusted manifest newer than the last trusted decision
    in_flight = None
    for v in versions:
        if v <= last_decided:
            break
        m = st.manifest(v)
        if m is not None and m.trusted:
            in_flight = {"version": v, "base_version": m.doc.base_version, "wire_bytes": m.doc.wire_bytes,
                         "chunks": len(m.doc.chunks)}
            break

    # members: the newest trusted decision names them (aborts too); joins and evictions
    members = list(decided[last_decided].doc.receivers) if decided else []
    joins = [{"version": v, "receiver": r} for v in sorted(decided) for r in decided[v].doc.joined]
    evictions = [{"version": v, "receiver": r} for v in sorted(decided) for r in decided[v].doc.evicted]
    requests = []
    for key in store.list(JOIN_PREFIX, limit=JOIN_SCAN_KEYS):
        rid = join_key_receiver(key)
        if rid is None:
            continue
        j = st.open(key, JoinRequest)
        if j is None:
            continue
        if j.doc is not None and j.doc.receiver != rid and j.trust != REJECTED:
            st.reject(j, f"names receiver {j.doc.receiver!r}")
        entry = {"receiver": rid, **j.as_dict()}
        if j.doc is not None:
            entry["held_version"] = j.doc.held_version
        requests.append(entry)

    # receivers: each one's newest ack that counts, and the ones above it that do not
    receivers: dict[str, dict] = {}
    for rid, vs in _ack_keys(store).items():
        last, skipped = None, []
        for v in vs[:ACK_DEPTH]:
            a = st.open(ack_key(rid, v), Ack)
            if a is None:
                continue
            if a.doc is not None and a.trust != REJECTED:
                if a.doc.receiver != rid or a.doc.version != v:
                    st.reject(a, f"names receiver {a.doc.receiver!r} version {a.doc.version}")
                elif a.doc.ok and a.trusted and a.doc.manifest_digest != st.manifest_digest(v):
                    st.reject(a, f"acks a manifest other than the one v{v} was published with")
            if a.trusted:
                last = (v, a)
                break
            skipped.append({"version": v, **a.as_dict()})
        entry: dict[str, Any] = {"member": rid in members, "not_counted": skipped}
        if last is not None:
            v, a = last
            d = decided.get(v)
            entry["last_ack"] = {"version": v, "ok": a.doc.ok, "held_version": a.doc.held_version,
                                 "trust": a.trust, "decision": ("commit" if d.doc.commit else "abort") if d else
                                 ("in flight" if in_flight and in_flight["version"] == v else "none"),
                                 **({"error": a.doc.error} if a.doc.error else {})}
            # what it holds: an ok ack of a committed version, that version; of one in flight,
            # that version tentatively; else (a refusal, an abort) what its ack says it held
            if a.doc.ok and d is not None:  # committed: v; aborted: rolled back to the base
                entry["holds"] = v if d.doc.commit else d.doc.base_version
            elif a.doc.ok:
                entry["holds"], entry["tentative"] = v, True
            else:
                entry["holds"] = a.doc.held_version
        else:
            entry["last_ack"] = None
        receivers[rid] = entry
    for rid in members:
        receivers.setdefault(rid, {"member": True, "not_counted": [], "last_ack": None})
    for rid, entry in receivers.items():
        la = entry["last_ack"]
        entry["acked_committed"] = bool(committed_v and la and la["version"] == committed_v and la["ok"])
    if in_flight is not None:
        want = members  # the next decision's members may add joiners: those are shown by their acks
        in_flight["acks"] = sorted(r for r, e in receivers.items()
                                   if e["last_ack"] and e["last_ack"]["version"] == in_flight["version"])
        in_flight["waiting_for"] = sorted(r for r in want if r not in in_flight["acks"])

    # snapshots
    snapshots = []
    for v in listed_versions(store)[:SNAPSHOTS]:
        rec = st.open(snapshot_key(v, SNAPSHOT_RECORD), SnapshotRecord)
        if rec is None:
            snapshots.append({"version": v, "state": "incomplete (no record)"})
            continue
        entry = {"version": v, **rec.as_dict()}
        if rec.trusted:
            try:
                read_record(store, sealer, run.run_id, v)
                entry["state"] = "complete"
                entry["bytes"] = sum(rec.doc.sizes.values())
            except SnapshotError as e:
                st.reject(rec, str(e))
                entry.update(rec.as_dict(), state="refused")
        else:
            entry["state"] = "not trusted"
        snapshots.append(entry)

    # hints
    head = st.open(HEAD_KEY, Head)
    hint = st.open(COMMITTED_KEY, Committed)

    report = {
        "store": store.uri,
        "run": {"run_id": run.run_id, "model_id": run.model_id, "created_unix": run.created_unix,
                "signed": run_signed, "verified": sealer.signed},
        "committed": committed,
        "aborted": aborted,
        "in_flight": in_flight,
        "hints": {"head": head.doc.version if head is not None and head.doc is not None else None,
                  "head_trust": head.trust if head is not None else None,
                  "committed": hint.doc.version if hint is not None and hint.doc is not None else None,
                  "committed_trust": hint.trust if hint is not None else None},
        "receivers": receivers,
        "membership": {"members": members, "joins": joins, "evictions": evictions, "join_requests": requests},
        "snapshots": snapshots,
        "history": {"versions_read": len(versions), "older_left_out": truncated},
        "not_trusted": [j.as_dict() for j in st.suspect],
    }
    if relays:
        report["relays"] = [relay_stats(url) for url in relays]
    return report


# ---------------------------------------------------------------- relays
def relay_base(url: str) -> str:
    """``http(s)://host:port`` of a relay given as ``relay://``, ``http://`` or ``https://``;
    ``StatusError`` (exit 2) otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("relay", "http", "https") or not parts.hostname or parts.port is None:
        raise StatusError(f"--relay {url!r}: give a relay as http://HOST:PORT (or relay://, https://)", 2)
    scheme = "http" if parts.scheme == "relay" else parts.scheme
    return f"{scheme}://{parts.netloc}"


def relay_stats(url: str) -> dict:
    """A relay's ``GET /v1/stats`` (docs/relay.md), or the one-line reason it could not be read."""
    from nemo_dcr.transport.relay.config import API

    try:
        with urllib.request.urlopen(f"{relay_base(url)}{API}/stats", timeout=RELAY_TIMEOUT_S) as resp:
            body = resp.read(RELAY_STATS_BYTES + 1)
        if len(body) > RELAY_STATS_BYTES:
            raise FormatError(f"stats over {RELAY_STATS_BYTES} bytes")
        stats = json.loads(body)
        if not isinstance(stats, dict):
            raise FormatError("stats are not a JSON object")
    except (OSError, ValueError, urllib.error.URLError) as e:
        return {"relay": url, "error": " ".join(f"{type(e).__name__}: {e}".split())}
    return {"relay": url, "stats": stats}


# ---------------------------------------------------------------- text
def _size(n: int | None) -> str:
    from nemo_dcr.events import size_text

    return "?" if n is None else size_text(n)


def render(r: dict) -> str:
    run = r["run"]
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(run["created_unix"]))
    if run["verified"]:
        signing = "signed, verified with the key"
    elif run["signed"]:
        signing = "signed, NOT VERIFIED (no --key-file): nothing below is trusted or counted"
    else:
        signing = "unsigned (integrity against accidents only)"
    rows = [("store", r["store"]),
            ("run", f"{run['run_id']}  model {run['model_id']!r}  created {created} UTC  {signing}")]
    c = r["committed"]
    if c["version"]:
        extra = f"  {_size(c['wire_bytes'])} on the wire" if "wire_bytes" in c else ""
        by = ",".join(c["receivers"]) or "-"
        rows.append(("committed", f"v{c['version']} (base v{c['base_version']}) by {by}{extra}"))
    else:
        claim = f"; the store claims v{c['unverified_claim']} (UNVERIFIED)" if "unverified_claim" in c else ""
        rows.append(("committed", f"v0 (no trusted commit decision){claim}"))
    f = r["in_flight"]
    if f is None:
        rows.append(("in flight", "none"))
    else:
        acked, waiting = ",".join(f["acks"]) or "nobody", ",".join(f["waiting_for"]) or "nobody"
        rows.append(("in flight", f"v{f['version']} (base v{f['base_version']}, {_size(f['wire_bytes'])}): "
                                  f"acked by {acked}; waiting for {waiting}"))
    if r["aborted"]:
        shown = ", ".join(f"v{v}" for v in r["aborted"][-8:])
        rows.append(("aborted", shown + (f" (+{len(r['aborted']) - 8} older)" if len(r["aborted"]) > 8 else "")))
    h = r["hints"]
    rows.append(("hints", f"HEAD v{h['head']} ({h['head_trust']}), COMMITTED v{h['committed']} "
                          f"({h['committed_trust']}); hints only, not used"))
    first = True
    for rid, e in r["receivers"].items():
        la = e["last_ack"]
        if la is None:
            text = "no ack that counts"
        else:
            what = "ok" if la["ok"] else f"REFUSED ({la.get('error', '')})"
            held = f"holds v{e['holds']}{' tentatively' if e.get('tentative') else ''}"
            text = f"acked v{la['version']} {what}, decision {la['decision']}; {held}"
            if la["trust"] == UNSIGNED_OK:
                text += " (unsigned run)"
        member = "" if e["member"] else "  (not a member)"
        rows.append(("receivers" if first else "", f"{rid:<10} {text}{member}"))
        first = False
        for n in e["not_counted"][:3]:
            rows.append(("", f"{'':<10} {n['trust']} ack v{n['version']}: {n.get('error', '')} (not counted)"))
        if len(e["not_counted"]) > 3:
            rows.append(("", f"{'':<10} ... {len(e['not_counted']) - 3} more not counted (--json lists them)"))
    if first:
        rows.append(("receivers", "no acks"))
    m = r["membership"]
    joins = ", ".join(f"{j['receiver']}@v{j['version']}" for j in m["joins"]) or "none"
    evictions = ", ".join(f"{j['receiver']}@v{j['version']}" for j in m["evictions"]) or "none"
    reqs = ", ".join(f"{j['receiver']} ({j['trust']})" for j in m["join_requests"]) or "none"
    rows.append(("members", f"{','.join(m['members']) or '-'}; joined {joins}; evicted {evictions}; "
                            f"join requests {reqs}"))
    snaps = ", ".join(f"v{s['version']} {s['state']}" + (f" {_size(s['bytes'])}" if "bytes" in s else "")
                      for s in r["snapshots"]) or "none"
    rows.append(("snapshots", snaps))
    for i, rel in enumerate(r.get("relays", [])):
        if "error" in rel:
            text = f"{rel['relay']}  UNREACHABLE: {rel['error']}"
        else:
            s = rel["stats"]
            text = (f"{rel['relay']}  served {_size(s.get('served_bytes'))} ({s.get('served_objects')} objects), "
                    f"read {_size(s.get('upstream_fetch_bytes'))} from {s.get('current_upstream')}, "
                    f"versions {s.get('versions')}, failures {s.get('upstream_failures')}, "
                    f"rejected {s.get('rejected')}")
        rows.append(("relays" if i == 0 else "", text))
    for i, j in enumerate(r["not_trusted"]):
        rows.append(("NOT TRUSTED" if i == 0 else "", f"{j['key']}: {j['trust']} ({j.get('error', '')})"))
    if r["history"]["older_left_out"]:
        rows.append(("note", f"only the newest {r['history']['versions_read']} versions were read"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""),
                                 epilog="docs/protocol.md, section 'Status'")
    ap.add_argument("--store", required=True, help="the run's store URI (a directory, s3://..., or a relay)")
    ap.add_argument("--key-file", default=None,
                    help="the run's shared signing key (default: $NEMO_DCR_KEY_FILE); without it a signed run's "
                         "documents are shown UNVERIFIED and no ack is counted")
    ap.add_argument("--relay", action="extend", nargs="+", default=[], metavar="URL",
                    help="relays of the tree (http://HOST:PORT ...; or --relay once per relay): each one's "
                         "/v1/stats are shown")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    return ap


def _open_store(uri: str):
    """The store, as a reader opens it: checked first (``transport/preflight.py``: a directory
    that exists, an S3 bucket that answers), never created."""
    from nemo_dcr.transport.preflight import check_store
    from nemo_dcr.transport.store import open_store

    try:
        check_store(uri, reader=True)
        return open_store(uri, create=False)
    except DcrError as e:
        raise StatusError(f"--store: {e}", 2) from None


def run_status(args) -> tuple[dict, int]:
    from nemo_dcr.protocol.run import open_run
    from nemo_dcr.transport.store import ObjectNotFound

    for url in args.relay:
        relay_base(url)
    store = _open_store(args.store)
    try:
        sealer = Sealer(load_key(args.key_file))
    except DcrError as e:
        raise StatusError(f"--key-file: {e}", 2) from None
    try:
        data = store.get(RUN_KEY, max_bytes=DOC_LIMITS["run"])
    except ObjectNotFound:
        raise StatusError(f"store {store.uri}: no run here ({RUN_KEY} not found); check --store", 2) from None
    except DcrError as e:
        raise StatusError(f"store {store.uri}: {type(e).__name__}: {e}", 1) from None
    try:
        run = open_run(data, sealer, store.uri, allow_unverified=True)
    except DcrError as e:
        raise StatusError(f"{type(e).__name__}: {e}", 2) from None
    run_signed = signature_of(data) != UNSIGNED
    try:
        report = collect(store, sealer, run, run_signed, args.relay)
    except DcrError as e:
        raise StatusError(f"store {store.uri}: {type(e).__name__}: {e}", 1) from None
    failed = [r for r in report.get("relays", []) if "error" in r]
    return report, 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        report, status = run_status(args)
    except StatusError as e:
        print(f"{PROG}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return e.status
    if report["run"]["signed"] and not report["run"]["verified"]:
        print(f"{PROG}: run {report['run']['run_id']} is signed and no key was given (--key-file): documents are "
              "shown UNVERIFIED and no ack is counted", file=sys.stderr, flush=True)
    failed = [f"relay {rel['relay']}: {rel['error']}" for rel in report.get("relays", []) if "error" in rel]
    if failed:  # one line for all of them
        print(f"{PROG}: {'; '.join(failed)}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1) if args.json else render(report), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
