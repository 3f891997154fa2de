"""The driver's own hand in a trial: a store writer without the key (``StoreAttacker``:
pointer_attack, hostile_doc) and the relay faulter (``RelayFaulter``: kill, stop, restart a relay).
The in-process injectors are in ``nemo_dcr_testbed.faults`` / ``relay_faults``."""
from __future__ import annotations

import random
import signal
import threading
import time

from .epoch import Epoch
from .kinds import HOSTILE_DOCS
from .procs import _kill


class StoreAttacker:
    """The driver as a store writer WITHOUT the key (pointer_attack, hostile_doc): it can
    replay, delete and plant objects.  ``before_go`` acts before the trainer takes the step,
    the thread (``start``/``join``) once the step's manifest is published."""

    def __init__(self, ep: "Epoch", version: int, plan: dict):
        self.ep, self.v = ep, version
        self.fault = next((f for f in plan["faults"] if f["kind"] in ("pointer", "hostile")), None)
        self.thread: threading.Thread | None = None
        self.done = ""

    def before_go(self) -> None:
        f, ep, v = self.fault, self.ep, self.v
        if f is None:
            return
        from nemo_dcr.protocol.manifest import COMMITTED_KEY, HEAD_KEY, ack_key, decision_key

        if f["kind"] == "hostile" and f["at"] in ("ack", "decision"):
            key = ack_key(f["receiver"], v) if f["at"] == "ack" else decision_key(v)
            ep.store.put(key, HOSTILE_DOCS[f["mode"]])  # the real object replaces it later
            self.done = f"planted {f['mode']} at {key}"
        elif f["kind"] == "pointer" and f["mode"] == "replay_committed" and ep.heads:
            try:
                ep.store.put(COMMITTED_KEY, ep.store.get(COMMITTED_KEY))  # rewrite (new identity)
                self.done = "rewrote COMMITTED.json"
            except KeyError:
                ep.store.delete(COMMITTED_KEY)
                self.done = "deleted COMMITTED.json"
        elif f["kind"] == "pointer" and f["mode"] == "aborted_head_restart":
            aborted = [w for w in sorted(ep.heads) if w in ep.aborted]
            if not aborted:
                return
            w = aborted[-1]
            ep.store.delete(decision_key(w))
            ep.store.put(HEAD_KEY, ep.heads[w])
            rx = ep.receivers[f["receiver"]]
            before = rx.log_count(f'"version": {w}, "ok": true')
            _kill(rx.proc)
            rx.start()  # from scratch: catches up, then applies the replayed aborted version
            deadline = time.monotonic() + 90
            while rx.log_count(f'"version": {w}, "ok": true') <= before and time.monotonic() < deadline:
                time.sleep(0.1)
            applied = rx.log_count(f'"version": {w}, "ok": true') > before
            self.done = f"HEAD of aborted v{w} restored, its decision deleted, {f['receiver']} restarted " \
                        f"({'applied it' if applied else 'did not apply it'})"

    def start(self) -> None:
        f = self.fault
        if f is None or not ((f["kind"] == "hostile" and f["at"] == "head")
                             or (f["kind"] == "pointer" and f["mode"] in ("replay_head", "delete_pointers"))):
            return
        self.thread = threading.Thread(target=self._after_publish, daemon=True)
        self.thread.start()

    def _after_publish(self) -> None:
        from nemo_dcr.protocol.manifest import COMMITTED_KEY, HEAD_KEY, manifest_key

        f, ep, v = self.fault, self.ep, self.v
        deadline = time.monotonic() + 30
        while not ep.store.exists(manifest_key(v)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        time.sleep(0.01)  # the trainer writes HEAD right after the manifest
        if f["kind"] == "hostile":
            ep.store.put(HEAD_KEY, HOSTILE_DOCS[f["mode"]])
            self.done = f"planted {f['mode']} at {HEAD_KEY}"
        elif f["mode"] == "delete_pointers":
            ep.store.delete(HEAD_KEY)
            ep.store.delete(COMMITTED_KEY)
            self.done = "deleted HEAD.json and COMMITTED.json"
        elif ep.heads:
            old = random.Random(v).choice(sorted(ep.heads))
            ep.store.put(HEAD_KEY, ep.heads[old])
            self.done = f"replayed HEAD.json of v{old}"

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=60)


class RelayFaulter:
    """The driver's hand on the relay tree (relay_kill, relay_stop, relay_restart_empty):
    waits for the plan's moment of the version (``at``, then ``delay_s``), then signals the
    relay process from outside.  relay_flip needs no hand: the relay's launcher reads the
    plan itself."""

    KINDS = ("relay_kill", "relay_stop", "relay_restart_empty")

    def __init__(self, ep: Epoch, version: int, plan: dict):
        self.ep, self.v = ep, version
        self.fault = next((f for f in plan["faults"] if f["kind"] in self.KINDS), None)
        self.thread: threading.Thread | None = None
        self.done = ""

    def start(self) -> None:
        if self.fault is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _moment(self) -> bool:
        from nemo_dcr.protocol.manifest import manifest_key

        f, ep, v = self.fault, self.ep, self.v
        deadline = time.monotonic() + 30
        while f["at"] != "go":
            try:
                if f["at"] == "manifest" and ep.store.exists(manifest_key(v)):
                    break
                if f["at"] == "chunks" and ep.store.list(f"v/{v:08d}/chunks/"):
                    break
            except Exception:  # noqa: BLE001 - the origin is not faulted here; keep looking
                pass
            if time.monotonic() > deadline or ep.trainer.poll() is not None:
                self.done = f"{f['at']} never came"
                return False
            time.sleep(0.01)
        time.sleep(f["delay_s"])
        return True

    def _run(self) -> None:
        f = self.fault
        relay = self.ep.relays[f["target"]]
        if not self._moment():
            return
        t0 = time.monotonic()
        if f["kind"] == "relay_kill":
            relay.kill()
            self.done = f"killed {f['target']}"
        elif f["kind"] == "relay_stop":
            relay.signal(signal.SIGSTOP)
            self.done = f"stopped {f['target']}"
            if f["cont_after_s"] is not None:
                time.sleep(f["cont_after_s"])
                relay.signal(signal.SIGCONT)
                self.done += f", continued after {time.monotonic() - t0:.2f}s"
        else:  # relay_restart_empty
            relay.kill()
            time.sleep(f["down_s"])
            relay.start()  # every start is on a new, empty spool
            self.done = f"killed {f['target']}, restarted on an empty spool after {time.monotonic() - t0:.2f}s"

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=60)
