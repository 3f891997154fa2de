"""One trial of a store or relay epoch (``run_trial``): plan, go, the trainer's decision, every
receiver settled and checked, the trial's record finished."""
from __future__ import annotations

import json
import os
import threading
import time

from .checks import LEFT_LINE, SWITCH_LINE, _flips, _node_counts, check_receivers
from .epoch import Epoch
from .injectors import RelayFaulter, StoreAttacker
from .kinds import RELAY_TREE_CLASSES
from .procs import Moto, _tail
from .records import TrialRecord


def run_trial(ep: Epoch, moto: Moto, plan: dict, seed: int, liveness: bool = False,
              wait_quiet: bool = True) -> tuple[TrialRecord, bool]:
    """Returns (record, epoch_must_end).  ``liveness``: a receiver that lags (its committed
    version below the trainer's, serving exactly the bits of the version it holds) goes to
    the record's ``lagging``, not to its violations (see :func:`check_receivers`).
    ``wait_quiet=False``: start at once, even while nodes rest an upstream they left (a liar
    trial's later versions: they must be routed around the liar while it is demoted)."""
    from nemo_dcr.protocol.manifest import Decision, decision_key
    from nemo_dcr.protocol.signing import Sealer, load_key

    if wait_quiet:
        time.sleep(max(0.0, ep.quiet_at - time.monotonic()))
    v = ep.version + 1
    ep.version = v
    base = ep.committed
    ignored_before = sum(rx.log_count('"ignored"') for rx in ep.receivers.values())
    refused_before = sum(rx.log_count('"ok": false') for rx in ep.receivers.values())
    left_before, switches_before = _node_counts(ep, LEFT_LINE), _node_counts(ep, SWITCH_LINE)
    flips_before = _flips(ep)
    with open(os.path.join(ep.plan_dir, f"v{v}.json"), "w") as f:
        json.dump(plan, f)
    rec = TrialRecord.new(trial=plan["trial"], seed=seed, cls=plan["cls"], faults=plan["faults"],
                          topology="relay" if ep.relays else "store", ack_timeout_s=ep.ack_timeout_s,
                          epoch=ep.index, version=v, base_version=base, violations=[], hang=False,
                          unplanned_restarts=0, planned_restarts=0)
    if plan["cls"] in RELAY_TREE_CLASSES and not ep.relays:
        raise ValueError(f"{plan['cls']} needs a relay epoch (--classes relay)")
    attacker = StoreAttacker(ep, v, plan)
    attacker.before_go()
    relay_faulter = RelayFaulter(ep, v, plan)
    t_go = time.time()
    open(os.path.join(ep.dir, "go", str(v)), "w").close()
    attacker.start()
    relay_faulter.start()
    stall = next((f for f in plan["faults"] if f["kind"] == "stall"), None)
    staller = None
    if stall:
        def do_stall():
            time.sleep(stall["delay_s"])
            moto.stall(stall["stall_s"])
        staller = threading.Thread(target=do_stall)
        staller.start()
    trainer_kill = plan["cls"] == "trainer_kill"
    row = None
    deadline = time.monotonic() + 180
    while row is None:
        row = ep.row(v)
        if row is not None or ep.trainer.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if staller:
        staller.join()
    attacker.join()
    relay_faulter.join()
    rec.attack = attacker.done or relay_faulter.done
    if ep.relays:
        # decided: the tree starts healing now, while the receivers settle (a relay stopped for
        # good is killed and restarted, a killed one restarted); an unplanned relay death is counted
        planned = {f["target"] for f in plan["faults"] if f["kind"] in RelayFaulter.KINDS}
        rec.relay_crashes = [r for r, relay in ep.relays.items() if not relay.alive() and r not in planned]
        rec.healed = ep.heal()
    rec.t_go = t_go
    end_epoch = False
    if row is None:
        if ep.trainer.poll() is None:  # hung: the trainer neither decided nor died
            rec.hang = True
            rec.violations.append("trainer did not decide within 180s")
            return rec, True
        end_epoch = True
        if not trainer_kill:
            rec.violations.append(f"trainer exited ({ep.trainer.returncode}) without a fault planned: "
                                     + _tail(ep.trainer_log, 5))
        # what was decided about v, if anything, is on the store
        sealer = Sealer(load_key(os.environ.get("NEMO_DCR_KEY_FILE")))
        try:
            d = Decision.from_json(ep.store.get(decision_key(v)), sealer)
        except KeyError:
            d = None
        rec.t_decided = time.time()
        rec.committed = bool(d and d.commit)
        rec.decision_written = d is not None
        rec.reason = "trainer rank killed"
        expect_committed = v if (d and d.commit) else base
        allowed_tentative = {None} if d is not None else {None, v}
    else:
        rec.t_decided = row["t_decided"]
        rec.committed = row["committed"]
        rec.reason = row["reason"][:300]
        rec.changed, rec.chunks = row["changed"], row["chunks"]
        if row["base_version"] != base:
            rec.violations.append(f"trainer base {row['base_version']}, driver expected {base}")
        expect_committed = v if row["committed"] else base
        allowed_tentative = {None}
    if rec.committed:
        ep.committed = v
    else:
        ep.aborted.add(v)
    # ---- every receiver settles, then its served bits are compared
    planned_kill = {f["target"] for f in plan["faults"] if f["kind"] == "kill"}
    if liveness:
        rec.lagging = []
    end_epoch = check_receivers(ep, rec, v, expect_committed, allowed_tentative, planned_kill,
                                lag=rec.get("lagging")) or end_epoch
    return _finish_trial(ep, rec, v, end_epoch, ignored_before, refused_before, left_before, switches_before,
                         flips_before)


def _finish_trial(ep: Epoch, rec: TrialRecord, v: int, end_epoch: bool, ignored_before: int, refused_before: int,
                  left_before: dict, switches_before: dict, flips_before: int) -> tuple[TrialRecord, bool]:
    if ep.relays:
        t_heal = time.monotonic()
        ep.wait_healed()  # the next trial starts on the whole tree
        rec.heal_wait_s = round(time.monotonic() - t_heal, 3)
        # a node "re-parents" when it leaves a failed upstream for the next one (FailoverStore's
        # warning); switching back to a healed parent is counted apart
        left, switches = _node_counts(ep, LEFT_LINE), _node_counts(ep, SWITCH_LINE)
        rec.reparents = {n: left[n] - left_before.get(n, 0) for n in left if left[n] > left_before.get(n, 0)}
        rec.switches = {n: switches[n] - switches_before.get(n, 0) for n in switches
                           if switches[n] > switches_before.get(n, 0)}
        rec.flipped_chunks = _flips(ep) - flips_before
        if rec.reparents or rec.healed:
            # the next trial starts once every node prefers its first upstream again (a left
            # upstream rests retry_after_s), so that its fault meets the tree's real shape
            ep.quiet_at = time.monotonic() + ep.retry_after_s
    ignored_after = sum(rx.log_count('"ignored"') for rx in ep.receivers.values())
    refused_after = sum(rx.log_count('"ok": false') for rx in ep.receivers.values())
    rec.receiver_ignored = ignored_after - ignored_before
    if rec.receiver_ignored > 40:  # each planted object is logged once per identity, not per poll
        rec.violations.append(f"log flood: {rec.receiver_ignored} ignored-object lines in one trial")
    try:
        ep.heads[v] = ep.store.get("HEAD.json")  # what a later pointer_attack may replay
    except KeyError:
        pass
    rec.receiver_refused = refused_after - refused_before
    rec.detected = bool(not rec.committed or rec.receiver_ignored or rec.receiver_refused
                           or rec.planned_restarts or rec.unplanned_restarts or end_epoch
                           or rec.get("reparents"))
    rec.duration_s = round(time.time() - rec.t_go, 3)
    rec.silent = bool(rec.violations) and not rec.hang
    # after a violation the run's state is not trusted: the next trial starts a fresh run
    return rec, end_epoch or bool(rec.violations)
