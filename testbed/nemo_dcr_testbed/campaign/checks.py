"""The bit-for-bit checks: integer views of served tensors against the trainer's dense state,
every receiver settled and compared after a decision, and the counts read from the nodes' logs."""
from __future__ import annotations

import os
import uuid

import numpy as np

from .epoch import Epoch
from .procs import _tail
from .records import TrialRecord


def int_view(t) -> np.ndarray:
    from nemo_dcr import dtypes

    return dtypes.int_view(t.detach().contiguous().reshape(-1)).numpy()


def compare_state(served: dict, dense: dict) -> list[str]:
    """Names of the dense (canonical) tensors that ``served`` does not hold bit for bit."""
    bad = []
    for name, ref in dense.items():
        got = served.get(name)
        if got is None or got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape) \
                or not np.array_equal(int_view(got), int_view(ref)):
            bad.append(name)
    return bad


# transport/failover.py's warnings: an upstream left after a failure or bad bytes, and every
# change of the upstream a node reads from (leaving, and coming back once the parent rested)
LEFT_LINE = " left for "


SWITCH_LINE = ": now reading from "


def _node_counts(ep: Epoch, needle: str) -> dict[str, int]:
    """How often ``needle`` is in each node's logs (receivers and relays) so far."""
    if not ep.relays:
        return {}
    nodes = {**ep.receivers, **ep.relays}
    return {name: node.log_count(needle) for name, node in nodes.items()}


def _flips(ep: Epoch) -> int:
    """Chunk objects the relays have served flipped so far (relay_faults.py logs each)."""
    return sum(r.log_count('"relay_flip"') for r in ep.relays.values())


def check_receivers(ep: Epoch, rec: TrialRecord, v: int, expect_committed: int, allowed_tentative: set,
                    planned_kill: set = frozenset(), lag: list | None = None) -> bool:
    """Every receiver of ``ep`` settles after the decision on ``v``; its committed version
    must be ``expect_committed``, it may hold no tentative version outside
    ``allowed_tentative``, and the bits it serves must equal the trainer's dense state of
    the version it holds (integer views).  Violations go to ``rec``; returns whether the
    epoch must end (a receiver that never settled).  With ``lag`` (a list), a receiver
    that is only behind (committed below ``expect_committed``, holding nothing aborted,
    serving exactly the bits of the version it holds) is a liveness matter: it goes to
    ``lag``, not to the violations."""
    from safetensors.torch import load_file

    end_epoch = False
    rec.setdefault("receivers", {})
    dense_cache: dict[int, dict] = {}
    reqs = {rid: f"{v}-{uuid.uuid4().hex[:6]}" for rid in ep.receivers}
    for rid, rx in ep.receivers.items():  # every receiver settles at once
        rx.ask(reqs[rid])
    for rid, rx in list(ep.receivers.items()):
        was_dead = not rx.alive()
        st, restarts = rx.status(reqs[rid], timeout=120)
        dead_restarts = restarts + 0
        if rid in planned_kill:
            rec.planned_restarts += min(dead_restarts, 1)
            dead_restarts -= min(dead_restarts, 1)
        rec.unplanned_restarts += dead_restarts
        if dead_restarts:
            rec.setdefault("crashes", []).append(f"{rid}: {_tail(os.path.join(rx.dir, f'log-{rx.incarnation - 1}.txt'), 3)}")
        if st is None:
            rec.hang = True
            rec.violations.append(f"{rid}: no settled state within 120s (was_dead={was_dead})")
            log = os.path.join(rx.dir, f"log-{rx.incarnation}.txt")
            rec.setdefault("hang_logs", {})[rid] = _tail(log, 6)[-1500:]
            end_epoch = True
            continue
        info = {k: st.get(k) for k in ("committed", "tentative", "awaiting", "handled", "held_version", "member")}
        rec.receivers[rid] = info
        held = st["tentative"] if st["tentative"] is not None else st["committed"]
        if held not in dense_cache:
            dense_cache[held] = ep.dense(held)
        served = load_file(st["dump"])
        os.unlink(st["dump"])
        bad = compare_state(served, dense_cache[held])
        tent = st["tentative"]
        if lag is not None and not bad and st["committed"] < expect_committed \
                and (tent is None or (tent <= expect_committed and tent not in ep.aborted)):
            lag.append(f"{rid}: committed v{st['committed']} (tentative {tent}, awaiting {st.get('awaiting')}), "
                       f"the trainer committed v{expect_committed}")
            continue
        if st["committed"] != expect_committed:
            rec.violations.append(f"{rid}: committed v{st['committed']}, trainer committed v{expect_committed}")
        if st["tentative"] not in allowed_tentative:
            rec.violations.append(f"{rid}: serves tentative v{st['tentative']} after the decision")
        if bad:
            rec.violations.append(f"{rid}: {len(bad)} tensors differ from the dense state of v{held}: {bad[:3]}")
        if st["committed"] != expect_committed or bad:
            # which version's bits does it hold?  (diagnosis only)
            for k in range(max(0, v - 3), v + 1):
                if os.path.exists(os.path.join(ep.dir, "dense", f"v{k}.safetensors")) \
                        and not compare_state(served, ep.dense(k)):
                    info["bits_of"] = k
    return end_epoch
