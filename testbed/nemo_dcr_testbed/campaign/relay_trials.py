"""Trials of liars, planted keys and the claim race: a relay that lies to its children and the
liveness bound it is held to, a key-less writer's planted keys, processes racing ``claim_store``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

from .epoch import Epoch
from .kinds import (ACK_FLOOD, FAR_VERSIONS, FIRST_READER, LIAR_CLASSES, RELAY_ACK_FLOOD, RELAY_ACK_FLOOD_BYTES,
    liar_bound)
from .pipeline import _sealer
from .procs import Moto, ROOT, _kill, _tail
from .records import TrialRecord
from .store_trials import run_trial


def _lies(ep: Epoch) -> int:
    """Lies the relays have told so far (relay_faults.py's LyingStore logs each)."""
    return sum(r.log_count('"relay_lie"') for r in ep.relays.values())


def plant_keys(ep: Epoch, v: int, f: dict) -> dict:
    """The driver as a store writer WITHOUT the key, before the go of ``v``: bare keys at the
    top of the 8-digit version space (``v/99999999/x``, ``v/9999999<i>/chunks/x``), junk
    under the next versions' prefixes, junk acks.  In a relay epoch the far keys are also
    read through both relays (as a child would, so a relay counts their versions) and a
    few oversized acks are PUT through ``ra``.  Returns what was planted and what a relay
    accepted; planted version numbers go to ``ep.planted`` (never "in use" for the checks)."""
    from nemo_dcr.transport.store import open_store

    out: dict = {"what": f["what"]}
    keys: list[tuple[str, bytes]] = []
    if "far_versions" in f["what"]:
        keys.append(("v/99999999/x", b""))
        keys += [(f"v/{99999999 - 1 - i:08d}/chunks/x", b"junk") for i in range(FAR_VERSIONS)]
        ep.planted.update([99999999] + [99999999 - 1 - i for i in range(FAR_VERSIONS)])
    if "ahead_junk" in f["what"]:
        keys += [(f"v/{v + k:08d}/chunks/x{k}", b"junk") for k in range(f["ahead"])]
        out["near_to"] = v + f["ahead"] - 1  # bare numbers within FLOOR_SLACK: used (a killed upload's)
    if "ack_flood" in f["what"]:
        keys += [(f"acks/flood{i}/{v:08d}.json", b"{}") for i in range(ACK_FLOOD)]
    for k, data in keys:
        ep.store.put(k, data)
    out["planted"] = len(keys)
    if ep.relays:
        far = [k for k, _ in keys if k.startswith("v/9999")]
        for relay in ep.relays.values():
            st = open_store(relay.uri)
            for k in far:
                try:
                    st.get(k)
                except Exception:  # noqa: BLE001 - a relay may refuse it: that is its business
                    pass
        if "ack_flood" in f["what"]:
            accepted = 0
            st = open_store(ep.relays["ra"].uri)
            for i in range(RELAY_ACK_FLOOD):
                try:
                    st.put(f"acks/flood-relay{i}/{v:08d}.json", b" " * RELAY_ACK_FLOOD_BYTES)
                    accepted += 1
                except Exception:  # noqa: BLE001 - refused: what a bounded relay does
                    pass
            out["relay_acks_accepted"] = accepted
    return out


def _relay_versions(ep: Epoch, field: str = "versions") -> dict[str, list[int]]:
    """The versions each relay keeps (its /v1/stats; ``field="recently_admitted"``: the last
    16 that entered its window)."""
    import urllib.request

    out = {}
    for role, relay in ep.relays.items():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{relay.port}/v1/stats", timeout=5) as r:
                out[role] = json.loads(r.read())[field]
        except (OSError, ValueError, KeyError):
            out[role] = None
    return out


def _bootstrap_restart(ep: Epoch, plan: dict, v: int, rec: dict) -> None:
    """bootstrap_lie: the liar restarted on an empty spool (so it fetches RUN.json and init/
    again, and lies about them), then the receiver that reads it first restarted from
    scratch, downloading version 0 through its upstream list.  It must come up (a receiver
    that exits is a failure; then the liar is restarted on an empty spool, since it caches
    the lie as any immutable object, and the receiver started from the driver's copy, so the
    epoch goes on)."""
    f = plan["faults"][0]
    with open(os.path.join(ep.plan_dir, f"v{v}.json"), "w") as fh:  # the liar reads the newest plan
        json.dump(plan, fh)
    relay = ep.relays[f["target"]]
    relay.kill()
    relay.start()
    relay.wait_ready()
    rid = FIRST_READER[f["target"]]
    rx = ep.receivers[rid]
    _kill(rx.proc)
    lies_before = _lies(ep)
    rx.start(download_init=True)
    log = os.path.join(rx.dir, f"log-{rx.incarnation}.txt")
    t0 = time.monotonic()
    boot = {"receiver": rid}

    def fallback() -> None:
        relay.kill()
        relay.start()
        relay.wait_ready()
        rx.start()
        Epoch.wait_ready(rx, time.monotonic())

    while True:
        with open(log, errors="replace") as fh:
            if '"ready": true' in fh.read():
                boot["ready_s"] = round(time.monotonic() - t0, 2)
                break
        if not rx.alive():
            boot["exited"] = rx.proc.returncode
            rec["failures"].append(f"{rid} exited ({rx.proc.returncode}) bootstrapping through lying {f['target']}: "
                                   + _tail(log, 2).strip()[-300:])
            fallback()
            break
        if time.monotonic() - t0 > 300:
            boot["timeout"] = True
            rec["failures"].append(f"{rid} not up within 300s bootstrapping through lying {f['target']}")
            _kill(rx.proc)
            fallback()
            break
        time.sleep(0.1)
    boot["lies"] = _lies(ep) - lies_before
    rec["bootstrap"] = boot


def run_liar_trial(ep: Epoch, moto: Moto, plan: dict, seed: int) -> tuple[TrialRecord, bool]:
    """A liar class (relay epochs) or planted_keys in a store or relay epoch: version v
    with the fault, then, while no version has committed with every receiver on it, the
    next ones (the fault on the first ``LIAR_BOUNDS[cls][0]`` of them) up to v + the
    bound.  Every version is checked bit for bit as any trial (violations); a receiver only
    behind is noted (``lagging``), and no clean commit within the bound is a failure, which
    ends the epoch (its state is not trusted).  The liar relay is restarted after the trial
    (on an empty spool), so that a lie it cached does not outlive the trial."""
    cls = plan["cls"]
    f = plan["faults"][0]
    lies_on, bound = liar_bound(cls, f, ep.ack_timeout_s)
    v0 = ep.version + 1
    head = {"failures": []}
    lies_before = _lies(ep) if ep.relays else 0
    if cls == "planted_keys":
        head["planted"] = plant_keys(ep, v0, f)
    if cls == "bootstrap_lie":
        _bootstrap_restart(ep, plan, v0, head)
    parts = []
    end = False
    while True:
        k = len(parts)
        p = {"trial": plan["trial"], "cls": cls, "faults": plan["faults"] if k < lies_on else []}
        r, end = run_trial(ep, moto, p, seed, liveness=True, wait_quiet=k == 0)
        parts.append(r)
        if end or (r["committed"] and not r["lagging"]) or k >= bound:
            break
    rec = parts[0]
    rec.faults = plan["faults"]
    rec.update(head)
    rec.versions = [{"version": r["version"], "committed": r["committed"], "lagging": r["lagging"]}
                       for r in parts]
    for r in parts[1:]:
        rec.violations += r["violations"]
        rec.hang = rec.hang or r["hang"]
        rec.unplanned_restarts += r["unplanned_restarts"]
        for key in ("reparents", "switches"):
            for n, c in (r.get(key) or {}).items():
                rec.setdefault(key, {})[n] = rec.get(key, {}).get(n, 0) + c
        rec.detected = rec.detected or r["detected"]
    last = parts[-1]
    rec.update(committed=last["committed"], t_decided=last["t_decided"], receivers=last.get("receivers"))
    clean = last["committed"] and not last["lagging"]
    if not clean and not rec.violations:
        rec.failures.append(f"no version within v{v0}..v{v0 + bound} committed with every receiver on it "
                               f"(versions {[(e['version'], e['committed']) for e in rec.versions]}; "
                               f"{'; '.join(last['lagging'])[:300]})")
    if ep.relays:
        rec.lies = _lies(ep) - lies_before
        rec.struck = rec.lies > 0 or cls == "planted_keys"
    if cls == "planted_keys" and ep.relays:
        kept, seen = _relay_versions(ep), _relay_versions(ep, "recently_confirmed")
        rec.relay_versions = kept
        rec.relay_confirmed = seen
        # planted numbers must not push the real versions out: a relay through which a
        # child read the version's manifest or decision must still hold it; one its
        # children bypassed (a liar epoch's relay, left after a lie) may not (planted junk
        # under v/<v>/chunks/ can bring v in unconfirmed, and planted versions replace it)
        for role, vs in kept.items():
            if vs is not None and last["version"] in (seen.get(role) or []) and last["version"] not in vs \
                    and any(w in ep.planted for w in vs):
                rec.failures.append(f"{role} keeps {vs}: planted versions pushed v{last['version']} out")
        if head["planted"].get("relay_acks_accepted"):
            rec.failures.append(f"ra forwarded {head['planted']['relay_acks_accepted']} acks of "
                                   f"{RELAY_ACK_FLOOD_BYTES} bytes to the origin")
    if cls in LIAR_CLASSES and not end:  # the liar forgets what it cached
        relay = ep.relays[f["target"]]
        relay.kill()
        relay.start()
        relay.wait_ready()
        rec.setdefault("healed", []).append(f"{f['target']}: liar restarted on an empty spool")
        ep.quiet_at = time.monotonic() + ep.retry_after_s
    rec.duration_s = round(time.time() - rec.t_go, 3)
    rec.silent = bool(rec.violations) and not rec.hang
    return rec, end or bool(rec.failures) or bool(rec.violations)


CLAIM_SCRIPT = """
import json, os, sys, time
from nemo_dcr.protocol.run import claim_store
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.transport.store import open_store
store, sealer = open_store(sys.argv[1]), Sealer(load_key(None))
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.0005)
try:
    out = {"won": claim_store(store, sealer, "claim-race").run_id}
except Exception as e:
    out = {"lost": type(e).__name__, "error": str(e)[:200]}
print(json.dumps(out), flush=True)
"""


def run_claim_race(ep: Epoch, plan: dict, seed: int) -> TrialRecord:
    """claim_race: N processes call the product's ``claim_store`` (``nemo_dcr.protocol.run``)
    on one fresh prefix at once (the epoch's moto S3 server or a local directory), released
    together by a file once every one has imported and opened its store.  Checked: exactly
    one wins, every other one gets one ``ForeignRunError``, and ``RUN.json`` names the
    winner.  Anything else is a failure (the claim is not atomic)."""
    from nemo_dcr.protocol.run import read_run
    from nemo_dcr.transport.store import open_store

    f = plan["faults"][0]
    t_go = time.time()
    rec = TrialRecord.new(trial=plan["trial"], seed=seed, cls=plan["cls"], faults=plan["faults"],
                          topology="pipeline" if ep.pipeline else "relay" if ep.relays else "store",
                          ack_timeout_s=ep.ack_timeout_s, epoch=ep.index, version=ep.version,
                          base_version=ep.committed, violations=[], failures=[], hang=False, unplanned_restarts=0,
                          planned_restarts=0, t_go=t_go, committed=None, t_decided=t_go, detected=True)
    tag = f"claim-{plan['trial']}-{uuid.uuid4().hex[:8]}"
    uri = f"{ep.uri.rsplit('/', 1)[0]}/{tag}" if f["backend"] == "s3" else os.path.join(ep.dir, "claims", tag)
    go = os.path.join(ep.dir, f"{tag}.go")
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM_SCRIPT, uri, go], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=ep.env, cwd=ROOT, text=True, start_new_session=True)
             for _ in range(f["n"])]
    outs = []
    try:
        for pr in procs:  # every one ready (imports done, store open) before the release
            line = pr.stdout.readline()
            if line.strip() != "ready":
                rec.failures.append(f"a claimant did not start: {line.strip()[:200]}")
        open(go, "w").close()
        for pr in procs:
            try:
                out, _ = pr.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                rec.hang = True
                rec.violations.append("a claimant did not return within 120s")
                continue
            lines = [x for x in out.splitlines() if x.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else {"lost": "no answer", "error": out[-200:]})
    finally:
        for pr in procs:
            _kill(pr)
    winners = [o["won"] for o in outs if "won" in o]
    losers = [o["lost"] for o in outs if "lost" in o]
    rec.claims = {"backend": f["backend"], "n": f["n"], "winners": len(winners), "losers": losers}
    if len(winners) != 1:
        rec.failures.append(f"{len(winners)} of {f['n']} claimants won the prefix")
    if any(x != "ForeignRunError" for x in losers):
        rec.failures.append(f"losers got {losers}, not ForeignRunError each")
    try:
        held = read_run(open_store(uri), _sealer())
        if len(winners) == 1 and (held is None or held.run_id != winners[0]):
            rec.failures.append("RUN.json does not name the winner")
    except Exception as e:  # noqa: BLE001 - recorded
        rec.failures.append(f"RUN.json unreadable after the race: {str(e)[:200]}")
    rec.committed = not rec.failures
    rec.duration_s = round(time.time() - t_go, 3)
    rec.silent = False
    return rec
