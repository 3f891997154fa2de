"""Trials of a pipelined epoch (``run_pipeline_trial``): the trainer killed in flight and resumed,
a receiver dying or joining, forged joins, a store stalled in flight, planted keys with a resume,
the trainer's exit without ``finish()``."""
from __future__ import annotations

import json
import os
import time

from .checks import check_receivers
from .epoch import Epoch
from .kinds import ELASTIC_CLASSES, EVICT_AFTER, EXIT_SLACK_S, HOSTILE_DOCS
from .pipeline import _decision, _go, _listed_versions, _moment, _new_record, _pstep, _sealer
from .procs import ReceiverProc, _kill
from .records import TrialRecord
from .relay_trials import plant_keys


def run_pipeline_trial(ep: Epoch, plan: dict, seed: int) -> tuple[TrialRecord, bool]:
    """One trial of a pipelined epoch (``--classes pipeline``); it may span several versions.
    Returns (record, epoch_must_end).  ``violations`` are broken safety checks (counted as
    silent corruptions); ``failures`` are liveness checks that did not hold (a resumed run
    or an eviction that did not commit in its bound), recorded apart."""
    rec = _new_record(ep, plan, seed)
    cls = plan["cls"]
    if cls in ELASTIC_CLASSES and not ep.elastic:
        raise ValueError(f"{cls} needs an elastic epoch")
    if cls == "receiver_dies" and len(ep.receivers) < 2:
        # keep at least one member: a death with one live receiver becomes a join
        rec.redrawn_from, cls = cls, "receiver_joins_midversion"
        plan = {**plan, "cls": cls, "faults": [{"kind": "join", "target": "driver", "at": "manifest"}]}
        rec.update(cls=cls, faults=plan["faults"])
    elif cls == "receiver_joins_midversion" and len(ep.receivers) >= 4:
        rec.redrawn_from, cls = cls, "receiver_dies"
        plan = {**plan, "cls": cls, "faults": [{"kind": "receiver_dies", "target": "driver", "at": "manifest",
                                                "pick": 0.5}]}
        rec.update(cls=cls, faults=plan["faults"])
    end = False
    if cls == "none":
        _, row, _ = _pstep(ep, plan, rec)
        if row is not None and not row["committed"]:
            rec.failures.append("the control version did not commit")
        rec.detected = False
    elif cls == "trainer_kill_inflight":
        end = _trial_trainer_kill(ep, plan, rec)
    elif cls == "receiver_dies":
        _trial_receiver_dies(ep, plan, rec)
    elif cls == "receiver_joins_midversion":
        _trial_join(ep, plan, rec)
    elif cls == "join_forged":
        _trial_join_forged(ep, plan, rec)
    elif cls == "store_stall_inflight":
        _trial_stall_inflight(ep, plan, rec)
    elif cls == "planted_keys":
        end = _trial_planted_resume(ep, plan, rec)
    elif cls == "exit_without_finish":
        _trial_exit(ep, plan, rec)
        end = True
    else:
        raise ValueError(f"{cls} does not run in a pipelined epoch")
    rec.duration_s = round(time.time() - rec.t_go, 3)
    rec.silent = bool(rec.violations) and not rec.hang
    rec.setdefault("detected", True)
    end = end or rec.pop("end_epoch", False) or bool(rec.violations) or rec.hang or ep.trainer.poll() is not None
    return rec, end


def _trial_trainer_kill(ep: Epoch, plan: dict, rec: TrialRecord) -> bool:
    """SIGKILL the trainer ranks while version v is in flight, then resume the run from the
    last checkpoint; returns whether the epoch must end (a resume refused as documented)."""
    from nemo_dcr.protocol.manifest import manifest_key

    f = next(x for x in plan["faults"] if x["kind"] == "trainer_sigkill")
    fate: dict = {"at": f["at"]}
    base = ep.committed
    with open(os.path.join(ep.dir, "ckpt", "LATEST")) as fh:
        fate["checkpoint_before"] = json.load(fh)["version"]
    v = _go(ep, plan)
    fate["moment_seen"] = _moment(ep, v, f["at"])
    time.sleep(f["delay_s"])
    fate["row_before_kill"] = ep.row(v) is not None
    fate["alive_at_kill"] = ep.trainer.poll() is None
    survivors = ep.kill_trainer()
    if survivors:
        rec.violations.append(f"trainer ranks {survivors} survived the SIGKILL (the check would be void)")
        rec.end_epoch = True
        return True
    rec.t_kill = time.time()
    d = _decision(ep, v)
    with open(os.path.join(ep.dir, "ckpt", "LATEST")) as fh:
        ckpt = json.load(fh)["version"]
    fate.update(chunks=len(ep.store.list(f"v/{v:08d}/chunks/")), manifest=ep.store.exists(manifest_key(v)),
                decision=None if d is None else ("commit" if d.commit else "abort"), checkpoint=ckpt)
    rec.fate = fate
    if fate["row_before_kill"] and f["at"] != "decision":
        rec.failures.append(f"v{v} was decided before the kill at {f['at']} (the hold did not keep it in flight)")
    # the resumed trainer starts while the receivers settle on what the killed one left
    ep.incarnation += 1
    ep.launch_trainer(resume=True)
    expect = v if d is not None and d.commit else base
    if check_receivers(ep, rec, v, expect, {None} if d is not None else {None, v}):
        rec.end_epoch = True
    fate["receivers_tentative"] = sorted(r for r, i in rec.receivers.items() if i.get("tentative") == v)
    if d is not None and d.commit:
        ep.committed = v
    ready = ep.wait_trainer()
    if "refused" in ready:
        fate["resume"] = "refused"
        fate["refusal"] = ready["refused"]["error"][:300]
        # documented (docs/protocol.md, "Run state"): a checkpoint older than the store's
        # committed version is refused; any other refusal is a failure of the resume
        if not (d is not None and d.commit and ckpt < v):
            rec.failures.append(f"resume from checkpoint v{ckpt} refused: {fate['refusal']}")
        elif f"committed v{v} after it" not in fate["refusal"]:
            rec.failures.append(f"resume refused with an unexpected message: {fate['refusal']}")
        rec.t_decided = rec.t_kill
        return True
    in_use = max([v, *_listed_versions(ep)])
    fate.update(resume="ok", resumed_committed=ready["committed"], next_version=ready["next_version"],
                in_use=in_use)
    if ready["committed"] != ep.committed:
        rec.violations.append(f"resumed at committed v{ready['committed']}, the store's run committed "
                                 f"v{ep.committed}")
    if ready["next_version"] <= in_use:
        rec.violations.append(f"resumed trainer's next version {ready['next_version']} reuses a number in use "
                                 f"(<= {in_use})")
    ep.version = ready["next_version"] - 1
    for _ in range(3):  # the resumed run must commit (an abort under load is retried, bounded)
        w, row, _ = _pstep(ep, {"trial": plan["trial"], "cls": plan["cls"], "faults": []}, rec)
        if row is None or row["committed"] or rec.violations:
            break
    fate["resumed_versions"] = [e["version"] for e in rec.versions]
    if not rec.committed:
        rec.failures.append("the resumed run did not commit within 3 versions")
    return False


def _trial_receiver_dies(ep: Epoch, plan: dict, rec: TrialRecord) -> None:
    """SIGKILL a member for good; it must be evicted after EVICT_AFTER versions without
    its ack, no version it did not ack may commit while it is a member, and the next
    version commits with the rest."""
    from nemo_dcr.protocol.manifest import ack_key

    f = plan["faults"][0]
    live = sorted(ep.receivers)
    target = live[min(int(f["pick"] * len(live)), len(live) - 1)]
    rx = ep.receivers.pop(target)
    ep.dead[target] = rx
    rec.target = target

    def kill(v: int) -> None:
        if f["at"] == "manifest":
            _moment(ep, v, "manifest")
        elif f["at"] == "after_ack":
            deadline = time.monotonic() + 60
            while not ep.store.exists(ack_key(target, v)) and time.monotonic() < deadline:
                time.sleep(0.01)
        _kill(rx.proc)

    if f["at"] == "before_go":
        _kill(rx.proc)
    evicted_at = None
    first = True
    for _ in range(EVICT_AFTER + 2):
        v, row, d = _pstep(ep, plan if first else {**plan, "faults": []}, rec,
                           during=kill if first and f["at"] != "before_go" else None)
        first = False
        if row is None or d is None:
            return
        # (its ack may have landed just before the kill: what counts is whether one is there)
        if target in d.receivers and d.commit and not ep.store.exists(ack_key(target, v)):
            rec.violations.append(f"v{v} committed while {target} was a member and had not acked it")
        if target in d.evicted:
            evicted_at = v
            if target in d.receivers:
                rec.violations.append(f"v{v} evicts {target} and still names it a member")
            break
    rec.evicted_at = evicted_at
    if evicted_at is None:
        rec.failures.append(f"{target} not evicted within {EVICT_AFTER + 2} versions")
        return
    if not rec.committed:  # the eviction version aborted (e.g. another slow ack): one more
        _pstep(ep, {**plan, "faults": []}, rec)
    v, row, d = _pstep(ep, {**plan, "faults": []}, rec)  # a later version commits with the rest
    if row is not None and not row["committed"]:
        rec.failures.append(f"v{v} after the eviction did not commit")
    if d is not None and target in d.receivers:
        rec.violations.append(f"v{v}: evicted {target} is a member again")


def _trial_join(ep: Epoch, plan: dict, rec: TrialRecord) -> None:
    """Start a fresh receiver with --join while version v is in flight; it must be admitted
    at a later version, which commits, and serve that version's bits (checked with the
    others after every version)."""
    f = plan["faults"][0]
    ep.joins += 1
    rid = f"j{ep.joins}"
    rec.target = rid

    started: list[ReceiverProc] = []

    def start(v: int) -> None:
        _moment(ep, v, f["at"])
        rec.started_in_flight = ep.row(v) is None
        started.append(ReceiverProc(ep, rid, join=True))

    v, row, d = _pstep(ep, plan, rec, during=start)
    admitted = None
    if row is not None and started:
        # checked with the others once it is up (its start takes minutes on a loaded machine,
        # longer than a settle may take)
        try:
            Epoch.wait_ready(started[0], time.monotonic(), timeout=300)
        except RuntimeError as e:
            started[0].close()
            rec.failures.append(f"{rid} did not start: {str(e)[:200]}")
            return
        ep.receivers[rid] = started[0]
        for _ in range(4):
            w, row, d = _pstep(ep, {**plan, "faults": []}, rec)
            if row is None or d is None:
                return
            if rid in d.joined:
                admitted = w
                if rid not in d.receivers:
                    rec.violations.append(f"v{w} admits {rid} and does not name it a member")
                if d.commit and row["committed"] is False:
                    rec.violations.append(f"v{w}: decision and row disagree")
                break
    rec.admitted_at = admitted
    if admitted is None:
        rec.failures.append(f"{rid} not admitted within 4 versions after the one it started in")
        return
    if not rec.committed:
        _pstep(ep, {**plan, "faults": []}, rec)
    w, row, d = _pstep(ep, {**plan, "faults": []}, rec)  # its ack counts now: commits with it
    if row is not None and not row["committed"]:
        rec.failures.append(f"v{w} after {rid}'s admission did not commit")
    if d is not None and rid not in d.receivers:
        rec.violations.append(f"v{w}: admitted {rid} is no longer a member")


def _trial_stall_inflight(ep: Epoch, plan: dict, rec: TrialRecord) -> None:
    """Stop the store while version v is in flight (the training loop goes on; the next hook
    call waits in settle); v may commit or abort, never half of each: every live receiver is
    checked bit for bit as after any version.  Then the run must go on: no member evicted by
    one stalled version, and a later version commits with the same members (3 tries)."""
    f = plan["faults"][0]
    stall_s = f["stall_s"] if f["length"] == "short" else ep.ack_timeout_s + f["over_ack_timeout_s"]
    members_before = set(ep.members)
    seen: dict = {}

    def stall(v: int) -> None:
        seen["moment_seen"] = _moment(ep, v, f["at"])
        time.sleep(f["delay_s"])
        seen["decided_before_stall"] = ep.row(v) is not None
        ep.moto.stall(stall_s)

    v, row, d = _pstep(ep, plan, rec, during=stall)
    rec.stall = {"stall_s": round(stall_s, 2), **seen,
                    "outcome": None if row is None else ("commit" if row["committed"] else "abort")}
    if row is None:
        return
    if d is not None and d.evicted:
        rec.failures.append(f"v{v}: one stalled version evicted {list(d.evicted)}")
    for _ in range(3):
        w, row, d = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec.violations:
            break
    if row is not None and not row["committed"]:
        rec.failures.append("no version committed within 3 versions after the stall")
    if d is not None and d.commit and set(d.receivers) != members_before:
        rec.failures.append(f"members changed across the stall: {sorted(members_before)} -> {sorted(d.receivers)}")


def _trial_planted_resume(ep: Epoch, plan: dict, rec: TrialRecord) -> bool:
    """planted_keys in a pipelined epoch: keys planted before the go of v (plant_keys); v
    must commit (or v+1); then the trainer is SIGKILLed between versions (v's checkpoint
    written) and resumed from it: its next version must be one past the last it published
    or, with ahead_junk, past the last bare number planted just above it (counted as a
    killed upload's: ``protocol/history.py`` FLOOR_SLACK); far planted numbers do not raise the
    floor; and it must commit.  Returns whether the
    epoch must end (a refused resume or a raised floor)."""
    rec.planted = plant_keys(ep, ep.version + 1, plan["faults"][0])
    for i in range(2):
        v, row, _ = _pstep(ep, plan if i == 0 else {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec.violations:
            break
    if row is None or rec.violations:
        return True
    if not row["committed"]:
        rec.failures.append(f"neither v{v - 1} nor v{v} committed after the planted keys")
        return True
    survivors = ep.kill_trainer()  # between versions: v decided and checkpointed (its row is written after)
    if survivors:
        rec.violations.append(f"trainer ranks {survivors} survived the SIGKILL")
        return True
    ep.incarnation += 1
    ready = ep.start_trainer(resume=True)
    rec.resume = {k: ready.get(k) for k in ("next_version", "committed", "refused")}
    if "refused" in ready:
        rec.failures.append(f"resume after planted keys refused: {ready['refused']['error'][:300]}")
        return True
    expect = max(ep.version, rec.planted.get("near_to", 0)) + 1
    if ready["next_version"] != expect:
        rec.failures.append(f"resumed trainer's next version is {ready['next_version']}, one past the last "
                               f"published or near bare number is {expect}: planted keys set the floor")
        return True
    ep.version = ready["next_version"] - 1  # the driver's next go is the resumed trainer's next version
    for _ in range(3):
        w, row, _ = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec.violations:
            break
    if not rec.committed:
        rec.failures.append("the resumed run did not commit within 3 versions")
    return False


def _trial_exit(ep: Epoch, plan: dict, rec: TrialRecord) -> None:
    """exit_without_finish: every trainer rank leaves its loop with sys.exit() right after
    the hook call of v (v in flight), calling no finish().  Within the ack timeout plus
    EXIT_SLACK_S of the go the trainer must be gone and v decided (a signed decision on the
    store; none is a failure, a trainer still there a hang); then every receiver must hold
    what was decided (v, or its base after an abort), checked bit for bit."""
    f = plan["faults"][0]
    for _ in range(f.get("before", 0)):  # clean versions first: the exit is not always the run's first
        _, row, _ = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or rec.violations:
            return
    base = ep.committed
    os.makedirs(os.path.join(ep.dir, "exit"), exist_ok=True)
    with open(os.path.join(ep.dir, "exit", str(ep.version + 1)), "w") as fh:
        json.dump({"delay_s": f["delay_s"]}, fh)
    v = _go(ep, plan)
    t0 = time.monotonic()
    bound = ep.ack_timeout_s + EXIT_SLACK_S
    while ep.trainer.poll() is None and time.monotonic() - t0 < bound:
        time.sleep(0.05)
    gone = ep.trainer.poll() is not None
    d = None
    while time.monotonic() - t0 < bound:  # the decision of a settle at exit is on the store
        d = _decision(ep, v)
        if d is not None or gone:
            break
        time.sleep(0.05)
    if d is None:
        d = _decision(ep, v)
    rec.exit = {"trainer_gone": gone, "rc": ep.trainer.returncode, "after_s": round(time.monotonic() - t0, 2),
                   "decision": None if d is None else ("commit" if d.commit else "abort")}
    rec.versions.append({"version": v, "committed": bool(d and d.commit)})
    if not gone:
        rec.hang = True
        rec.violations.append(f"v{v}: the trainer did not end within {bound:.0f}s of its sys.exit()")
        ep.kill_trainer()
    if d is None:
        rec.failures.append(f"v{v}: no signed decision after the trainer exited without finish()")
    elif d.commit:
        ep.committed = v
    else:
        ep.aborted.add(v)
    rec.committed = bool(d and d.commit)
    rec.t_decided = time.time()
    check_receivers(ep, rec, v, v if (d and d.commit) else base, {None} if d is not None else {None, v})


def _trial_join_forged(ep: Epoch, plan: dict, rec: TrialRecord) -> None:
    """A store writer without the key plants a join request; it must admit nobody and change
    nothing: the next two versions name the same members and commit."""
    import secrets as _secrets

    from nemo_dcr.protocol.manifest import INIT_RECORD_KEY, JOIN_PREFIX, JoinRequest, decision_key, doc_digest, \
        join_key
    from nemo_dcr.protocol.signing import Sealer

    f = plan["faults"][0]
    who = f["who"]
    pool = {"ghost": [f"ghost{plan['trial']}"], "evicted": sorted(ep.dead), "member": sorted(ep.members)}[who]
    if not pool:
        who, pool = "ghost", [f"ghost{plan['trial']}"]
    rid = pool[min(int(f["pick"] * len(pool)), len(pool) - 1)]
    members_before = set(ep.members)
    held_key = decision_key(ep.committed) if ep.committed else INIT_RECORD_KEY
    held_digest = doc_digest(ep.store.get(held_key))
    request = JoinRequest(run_id=ep.run_id, receiver=rid, held_version=ep.committed, held_digest=held_digest)
    mode = f["mode"]
    genuine = []  # requests that open with the key (earlier forgeries may sit under join.d/ too)
    for k in ep.store.list(JOIN_PREFIX):
        try:
            if JoinRequest.from_json(ep.store.get(k), _sealer()).receiver != rid:
                genuine.append(k)
        except Exception:  # noqa: BLE001 - a forgery or a hostile document: not genuine
            pass
    if mode == "renamed_genuine" and not genuine:
        mode = "wrong_key"  # no receiver has written a request yet: nothing genuine to rename
    if mode == "wrong_key":
        data = request.to_json(Sealer(_secrets.token_bytes(32)))
    elif mode == "unsigned":
        data = request.to_json(None)
    elif mode == "renamed_genuine":  # another receiver's genuine, signed request under this name
        data = ep.store.get(sorted(genuine)[0])
    elif mode == "hostile":
        data = HOSTILE_DOCS["deep_nesting"]
    else:  # oversize: over the 64 KiB cap
        data = b" " * (65 << 10) + request.to_json(Sealer(_secrets.token_bytes(32)))
    rec.update(target=rid, who=who, mode_used=mode)

    def plant(v: int) -> None:
        _moment(ep, v, f["at"])
        ep.store.put(join_key(rid), data)

    if f["at"] == "before_go":
        ep.store.put(join_key(rid), data)
    for i in range(2):  # a request planted during v is listed at v + 1
        v, row, d = _pstep(ep, plan if i == 0 else {**plan, "faults": []}, rec,
                           during=plant if i == 0 and f["at"] != "before_go" else None)
        if row is None or d is None:
            return
        if rid in d.joined or (rid in d.receivers and rid not in members_before):
            rec.violations.append(f"v{v}: the forged join request admitted {rid}")
        if set(d.receivers) != members_before:
            rec.violations.append(f"v{v}: members {sorted(d.receivers)}, before the forgery "
                                     f"{sorted(members_before)}")
        if not row["committed"]:
            rec.failures.append(f"v{v} did not commit after the forgery")
    rec.detected = not any(e.get("joined") for e in rec.versions)
