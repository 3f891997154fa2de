"""Steps of a pipelined epoch: the go of a version, the moments of a version on the store, its
signed decision, one version checked (``_pstep``) and a pipelined trial's record."""
from __future__ import annotations

import json
import os
import threading
import time

from .checks import check_receivers
from .epoch import Epoch
from .procs import _tail
from .records import TrialRecord


def _sealer():
    from nemo_dcr.protocol.signing import Sealer, load_key

    return Sealer(load_key(os.environ.get("NEMO_DCR_KEY_FILE")))


def _decision(ep: Epoch, v: int):
    """The signed decision of ``v`` on the store (None: none written)."""
    from nemo_dcr.protocol.manifest import Decision, decision_key

    try:
        return Decision.from_json(ep.store.get(decision_key(v)), _sealer())
    except KeyError:
        return None


def _moment(ep: Epoch, v: int, at: str, timeout: float = 60.0) -> bool:
    """Wait until ``at`` of version ``v`` is on the store (False: the trainer died or it
    never came)."""
    from nemo_dcr.protocol.manifest import ack_key, decision_key, manifest_key

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and ep.trainer.poll() is None:
        try:
            if at == "before_go" \
                    or (at == "chunks" and ep.store.list(f"v/{v:08d}/chunks/")) \
                    or (at == "manifest" and ep.store.exists(manifest_key(v))) \
                    or (at == "acks" and all(ep.store.exists(ack_key(r, v)) for r in ep.receivers)) \
                    or (at == "decision" and ep.store.exists(decision_key(v))):
                return True
        except Exception:  # noqa: BLE001 - the store is not faulted here; look again
            pass
        time.sleep(0.01)
    return False


def _go(ep: Epoch, plan: dict) -> int:
    v = ep.version + 1
    ep.version = v
    with open(os.path.join(ep.plan_dir, f"v{v}.json"), "w") as f:
        json.dump(plan, f)
    open(os.path.join(ep.dir, "go", str(v)), "w").close()
    return v


def _wait_row(ep: Epoch, v: int, timeout: float = 180.0) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = ep.row(v)
        if row is not None or ep.trainer.poll() is not None:
            return row
        time.sleep(0.02)
    return None


def _pstep(ep: Epoch, plan: dict, rec: TrialRecord, during=None) -> tuple[int, dict | None, object]:
    """One version of a pipelined epoch: plan, go, ``during(v)`` (the driver's hand at a
    moment of ``v``, in a thread), the trainer's row once ``v`` is decided, the signed
    decision, then every live receiver checked bit for bit against the version it must
    hold.  Returns (v, row, decision)."""
    v = _go(ep, plan)
    th = None
    if during is not None:
        th = threading.Thread(target=during, args=(v,), daemon=True)
        th.start()
    row = _wait_row(ep, v)
    if th is not None:
        th.join(timeout=300)
    d = _decision(ep, v) if row is not None else None
    entry = {"version": v, "committed": row["committed"] if row else None}
    if d is not None:
        entry.update(members=list(d.receivers), joined=list(d.joined), evicted=list(d.evicted))
    rec.versions.append(entry)
    if row is None:
        rec.hang = ep.trainer.poll() is None
        rec.violations.append(f"v{v}: the trainer {'did not decide within 180s' if rec.hang else 'exited'}: "
                                 + _tail(ep.trainer_log, 3))
        return v, None, None
    if d is None or d.commit != row["committed"]:
        rec.violations.append(f"v{v}: the trainer's row says committed={row['committed']}, the signed decision "
                                 f"{'is missing' if d is None else f'says {d.commit}'}")
    if row["base_version"] != ep.committed:
        rec.violations.append(f"v{v}: trainer base {row['base_version']}, driver expected {ep.committed}")
    if row["committed"]:
        ep.committed = v
    else:
        ep.aborted.add(v)
    if d is not None:
        ep.members = set(d.receivers)
    rec.t_decided = row["t_decided"]
    rec.committed = row["committed"]
    if check_receivers(ep, rec, v, ep.committed, {None}):
        rec.end_epoch = True
    return v, row, d


def _new_record(ep: Epoch, plan: dict, seed: int) -> TrialRecord:
    return TrialRecord.new(trial=plan["trial"], seed=seed, cls=plan["cls"], faults=plan["faults"],
                           topology="pipeline", membership="elastic" if ep.elastic else "static",
                           ack_timeout_s=ep.ack_timeout_s, epoch=ep.index, version=ep.version + 1,
                           base_version=ep.committed, violations=[], failures=[], hang=False,
                           unplanned_restarts=0, planned_restarts=0, versions=[], t_go=time.time(),
                           committed=False, t_decided=time.time())


def _listed_versions(ep: Epoch) -> list[int]:
    """Version numbers listed under ``v/``, without those the driver planted (planted_keys)."""
    return sorted({int(k.split("/")[1]) for k in ep.store.list("v/") if k.count("/") >= 2} - ep.planted)
