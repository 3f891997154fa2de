"""Fault campaign: randomized faults against the real refit pipeline, checked bit for bit.

    .venv/bin/python scripts/fault_campaign.py --trials 500 --seed 0 \\
        --results benchmarks/results/fault_campaign.jsonl --out benchmarks/results/fault_campaign.json

Setup (one "epoch"; a new one only after a trainer rank was killed or something broke):
a moto S3 server on 127.0.0.1, a fresh bucket, one shared signing key, the trainer
(``nemo_dcr_testbed.campaign_trainer``: megatron-core, 1 layer, hidden 64, TP=2 under
torchrun/gloo, the product's ``MegatronRefitHook``, ack timeout 3 s, ``on_refusal=retry``)
and two receivers (``nemo_dcr_testbed.faults``: the product's ``Receiver`` + ``Follower``
on the transformers runtime).  Every process wraps its store (and a receiver its served
model) in the injectors of ``testbed/nemo_dcr_testbed/faults.py``.

One trial = one trainer step = one version ``v``: the driver draws a fault from
``(seed, trial)``, writes the plan of ``v``, lets the trainer step (``go/<v>``), waits for
the trainer's decision, restarts any receiver that died (from scratch: it loads version 0
and catches up by replaying committed versions), then asks each receiver to settle and dump
every parameter and buffer it serves.  Checks, with integer views against the trainer's
own canonical state of each version (``dense/v<k>.safetensors``):

* every receiver's committed version is the trainer's committed version (``v`` after a
  commit, its base after an abort), no tentative version is held after the decision, and
  the served bits equal the dense state of that version (nothing uncommitted is served,
  no committed version lost);
* after a trainer rank is killed: a receiver holds the last committed version, or the
  version it was told (tentative, no decision written), and serves exactly its bits.

Relay epochs (``--classes relay``: the "none" control and the relay classes): between the
origin store and the receivers runs a chain of two real relays (``nemo-dcr relay``'s
``Relay``, launched by ``nemo_dcr_testbed.relay_faults``): ``ra`` reads the origin, ``rb``
reads ``ra`` then the origin, receiver ``r0`` reads ``rb, ra, origin`` and ``r1`` reads
``ra, origin`` (every list ends with the origin).  The driver SIGKILLs a relay
(``relay_kill``), SIGSTOPs it and SIGCONTs it within the trial or never (``relay_stop``),
kills it and restarts it on the same port with an empty spool (``relay_restart_empty``),
each right after the go, once the version's first chunk is on the origin or once its
manifest is; or the relay's launcher serves the version's chunks with a bit flipped
(``relay_flip``).  After the decision the tree is healed (a relay stopped for good is
killed, a dead one restarted) while the receivers settle.  The same bit-for-bit checks
follow; a receiver restart would be a reload (counted), and re-parenting is counted from
the failover warnings in every node's log.  Receivers of a relay epoch read the upstream
list as it is (no store injectors), so only ``none``, ``apply_exception`` and
``one_refuses`` of the store classes run there.

Pipelined epochs (``--classes pipeline``: the "none" control and the classes below): the
trainer runs ``refit.pipeline=true`` with ``refit.membership=elastic`` (``min_receivers``
1, ``evict_after`` 2) when an elastic class is selected, takes each version without a step
number (one past every number in use) and checkpoints every committed step right after its
hook call (``hook.run_state()``, which waits for the version in flight; weights +
run state, renamed into place).  A trial may span several versions; after each one the
driver reads the signed decision and checks every live receiver as above.

* ``trainer_kill_inflight``: rank 0 holds version v's decision put 1.5-3 s; the driver
  SIGKILLs both ranks (each runs in a session of its own) and torchrun once v's first
  chunk, its manifest or every receiver's ack is on the store, or (no hold) once its
  decision is.  Recorded: v's fate (chunks, manifest, decision) and which receivers held
  it tentatively.  Checked: before the resume a receiver holds the committed version or
  v tentatively (no decision), and serves its bits; the trainer resumed from its last
  checkpoint (``hook.resume``) is at the store's committed version, its next version is
  above every number in use (``v/`` listing), and it commits (3 tries) with every
  receiver bit-exact.  A resume refused because v committed after the last checkpoint
  is the documented limit (docs/protocol.md, "Run state") and ends the epoch.
* ``receiver_dies``: a live receiver is SIGKILLed for good (before the go, once v's
  manifest is out, or once it acked v).  Checked: no version it did not ack commits
  while it is a member; within ``evict_after`` + 2 versions a decision names it
  evicted and not a member; the next version commits with the rest.
* ``receiver_joins_midversion``: a fresh receiver (``--join``) is started once v's first
  chunk or manifest is out.  Checked: within 4 later versions a decision admits it (in
  ``joined`` and ``receivers``); the next version commits with it a member; it is
  bit-exact after every version like the others.
* ``join_forged``: the driver, without the key, plants a join request (signed with a
  wrong key, unsigned, another receiver's genuine request under this name, 200 KB of
  ``[``, or over the 64 KiB cap) for an unknown, evicted or member id, before the go or
  once v's manifest is out.  Checked over two versions: nobody is admitted, the members
  do not change, both commit.

* ``exit_without_finish`` (``--classes exits``: none, it and the driver classes; the
  trainer runs pipelined, not elastic): after 0-2 clean versions, every trainer rank leaves its loop
  with ``sys.exit(0)`` 0-0.5 s after the hook call of v (v in flight), calling neither
  ``finish()`` nor anything else of the hook (Megatron-Bridge's ``train.py`` on
  ``exit_duration_in_mins``; ``campaign_trainer.py``'s ``D/exit/<v>``).  Checked: within the
  ack timeout + ``EXIT_SLACK_S`` (60 s) of the go the trainer is gone (else a hang) and v has
  a signed decision (the product's settle at exit; none is a failure); every receiver then
  holds what was decided (v, or its base after an abort), bit for bit.  Ends the epoch.

Liar trials (relay epochs, ``--classes liars``: none, the four below and the driver
classes).  A relay of the tree (``ra`` or ``rb``) is run by someone without the key and lies
to its children (``testbed/nemo_dcr_testbed/relay_faults.py``'s ``LyingStore``, each lie logged as a
``"relay_lie"`` line):

* ``relay_doc_lie``: ONE upstream fetch of v's ``DECISION.json`` or ``MANIFEST.json`` is
  answered with the newest earlier version's genuine document, or (decision) with the genuine
  one padded over its byte cap (a 413 to a child); the relay caches the lie as any object;
* ``relay_hides``: "not found" for v's manifest or decision, or ``HEAD.json`` hidden or
  frozen at the last one passed on honestly, on every version up to the bound;
* ``ack_drop``: every ack PUT of the versions up to the bound answered 204 and not
  forwarded, or forwarded with a bit flipped;
* ``bootstrap_lie``: the liar, restarted on an empty spool, flips a bit of ``RUN.json``,
  ``init/INIT.json`` or the init model, or stalls the init model, and the receiver that reads
  it first is restarted from scratch, downloading version 0 through its upstream list
  (``--download-init``); it must come up (exiting or 300 s without "ready" is a failure).

Safety is checked on every version as above.  Liveness (``LIAR_BOUNDS``, ``liar_bound``):
version v and the next ones run, the lie on the first ``lies_on`` of them, until one commits
with every receiver on it; none by v + ``bound`` is a failure (which ends the epoch).  A
receiver only behind there (committed below the trainer, serving exactly the bits it holds)
is noted as ``lagging``, not a violation.  The bounds, from what the product promises: a
one-shot document lie is answered by a second opinion within the version (v or v+1); a hidden
manifest or decision too (v may abort, v+1 commits, the liar still hiding it); a dropped or
flipped ack is seen when v aborts, then the receiver demotes the upstream it wrote through,
and ``r0``'s ack behind ``rb`` -> ``ra`` may need two demotions (v+2 commits); a hidden or
frozen HEAD has no signed evidence against it and is probed on the other upstreams only
after ``HEAD_PROBE_S`` (10 s) without a newer one, so it is hidden on every version up to
ceil(10 s / ack timeout) past v and the last of them must commit; a bootstrap lie may
cost v only by the restarted receiver's catch-up from version 0 outlasting v's ack timeout
(v+1 commits).  A demotion lasts ``retry_after_s``: liar epochs use ``LIAR_RETRY_AFTER_S`` (12 s)
so that it outlasts the versions of the bound, and a liar trial's later versions start at
once (no wait for the tree to heal).  After the trial the liar is restarted on an empty
spool (its cached lies go).  ``struck``: the liar told at least one lie (a lie can miss:
children that left it, or read v's document before it existed).

Driver classes (any epoch kind): ``planted_keys``: before v's go a writer without the key
plants bare keys at the top of the version space (``v/99999999/x`` and 10 more, over a
relay's version window, also read through both relays), junk under the next versions'
prefixes and 200 junk acks (through ``ra``: 4 acks of 1 MiB, which a relay must refuse).
Checked: v or v+1 commits with every receiver on it, planted numbers push no real version
out of a relay's window and no 1 MiB ack is forwarded; in a pipelined epoch the trainer is
then SIGKILLed and resumed from its checkpoint, and its next version must be one past the
last it published, or past the junk planted just above it (bare numbers within
``FLOOR_SLACK`` count as a killed upload's); far planted numbers do not raise the floor; it
must commit within 3.
``claim_race``: 2-4 processes call the product's ``claim_store`` on one fresh prefix (moto S3
or a local directory) at once; exactly one must win, each other one get ``ForeignRunError``,
and ``RUN.json`` name the winner.

A death with one live receiver is redrawn as a join, a join with four as a death (the
record says ``redrawn_from``).  Liveness checks that do not hold (``failures``: an
eviction, admission or resumed commit not within its bound) are counted apart from
violations.

A violation is a silent corruption (must stay 0).  A hang (a receiver that never settles,
a trainer that never decides) is recorded as such and the epoch is restarted.

Resumable: one JSON line per trial in ``--results``; trials already there are skipped (a
resumed campaign starts a fresh epoch).  ``--report-only`` rebuilds the summary + plot.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np

STORE_CLASSES = ("none", "apply_exception", "receiver_kill", "trainer_kill", "store_stall", "store_error",
                 "chunk_tamper", "manifest_tamper", "decision_tamper", "ack_tamper", "one_refuses",
                 "pointer_attack", "hostile_doc")
# faults of the relay tree: they need a relay epoch (--classes relay), where the receivers read
# through two relays whose upstream lists end with the origin store
RELAY_CLASSES = ("relay_kill", "relay_stop", "relay_flip", "relay_restart_empty")
# faults of the pipelined refit and of elastic membership: they need a pipelined epoch
# (--classes pipeline), whose trainer runs refit.pipeline=true, checkpoints every committed
# step and, with an elastic class, refit.membership=elastic
PIPELINE_CLASSES = ("trainer_kill_inflight", "receiver_dies", "receiver_joins_midversion", "join_forged",
                    "store_stall_inflight")
ELASTIC_CLASSES = ("receiver_dies", "receiver_joins_midversion", "join_forged")
# a relay that lies to its children (relay epochs; testbed/relay_faults.py's LyingStore): one
# wrong document answer, documents hidden or HEAD frozen, acks dropped or flipped, bootstrap
# objects flipped or stalled.  Checked for safety as every trial and for liveness: a version
# within LIAR_BOUNDS commits with every receiver on it (a "failure" otherwise)
LIAR_CLASSES = ("relay_doc_lie", "relay_hides", "ack_drop", "bootstrap_lie")
RELAY_TREE_CLASSES = RELAY_CLASSES + LIAR_CLASSES  # they need a relay epoch
# the driver alone, in an epoch of any kind: planted keys (a key-less writer), a claim race
# (trainers starting on one fresh prefix at once, the product's claim_store in N processes)
DRIVER_CLASSES = ("planted_keys", "claim_race")
# pipelined epochs only: the trainer's loop ends in sys.exit() with a version in flight, without
# finish() (Bridge's exit_duration_in_mins); ends the epoch
EXIT_CLASSES = ("exit_without_finish",)
PIPELINE_EPOCH_CLASSES = PIPELINE_CLASSES + EXIT_CLASSES  # they make an epoch pipelined
CLASSES = STORE_CLASSES + RELAY_CLASSES + PIPELINE_CLASSES + LIAR_CLASSES + DRIVER_CLASSES + EXIT_CLASSES
# store classes that also run in a relay epoch (they need no store injector in the receivers)
RELAY_EPOCH_CLASSES = ("none", "apply_exception", "one_refuses")
# --classes aliases
CLASS_GROUPS = {"store": STORE_CLASSES, "relay": ("none",) + RELAY_CLASSES, "pipeline": ("none",) + PIPELINE_CLASSES,
                "liars": ("none",) + LIAR_CLASSES + DRIVER_CLASSES, "exits": ("none",) + EXIT_CLASSES + DRIVER_CLASSES}
# relative frequency in a random campaign (trainer kills restart everything: rare)
WEIGHTS = {"none": 12, "apply_exception": 10, "receiver_kill": 5, "trainer_kill": 0.5, "store_stall": 4,
           "store_error": 10, "chunk_tamper": 10, "manifest_tamper": 10, "decision_tamper": 6,
           "ack_tamper": 10, "one_refuses": 6, "pointer_attack": 8, "hostile_doc": 8,
           "relay_kill": 24, "relay_stop": 24, "relay_flip": 24, "relay_restart_empty": 24,
           "trainer_kill_inflight": 6, "receiver_dies": 6, "receiver_joins_midversion": 6, "join_forged": 6,
           "store_stall_inflight": 6, "relay_doc_lie": 24, "relay_hides": 24, "ack_drop": 24, "bootstrap_lie": 12,
           "planted_keys": 10, "claim_race": 10, "exit_without_finish": 6}
# liar and planted-key trials: (how many versions from v on the relay lies, the offset from v
# of the latest version that must commit with every receiver on it).  A one-shot lie
# (relay_doc_lie: one upstream fetch, cached by the relay as any object; bootstrap_lie: one
# receiver's bootstrap) is over after v: v or v+1 must commit.  A relay that hides or drops
# acks does it on every version up to the bound, so the version that must commit is routed
# around the liar, not merely after it: a hide is answered by a second opinion within the
# version (v may abort at the ack timeout, v+1 commits); a dropped ack is seen only when v
# aborts for "no acknowledgement", then the ack is re-sent through the next upstream and the
# relay demoted (v+1 commits; v+2 allowed when the demotion rests out before v+1's ack).  The
# receiver a bootstrap_lie restarts catches up from version 0 after it is ready, which can
# outlast v's ack timeout (liars run, trial 80: 62 versions, v63 aborted for its ack): v+1
LIAR_BOUNDS = {"relay_doc_lie": (1, 1), "relay_hides": (2, 1), "ack_drop": (3, 2), "bootstrap_lie": (1, 1),
               "planted_keys": (1, 1)}


def liar_bound(cls: str, fault: dict, ack_timeout_s: float) -> tuple[int, int]:
    """LIAR_BOUNDS[cls], but for a hidden or frozen HEAD.json: no second opinion is due
    there (nothing signed says a newer version exists), the follower probes the other
    upstreams once HEAD has named nothing newer for HEAD_PROBE_S (protocol/follower.py),
    and that probe's phase is anything relative to the go.  The versions before it may all
    abort at the ack timeout, so the liar hides HEAD on every version up to
    ceil(HEAD_PROBE_S / ack timeout) past v, and the last of them must commit (routed
    around the demoted liar)."""
    if cls == "relay_hides" and fault.get("doc") == "head":
        from nemo_dcr.protocol.follower import HEAD_PROBE_S

        n = int(np.ceil(HEAD_PROBE_S / ack_timeout_s))
        return n + 1, n
    return LIAR_BOUNDS[cls]
# relay epochs: how long a node rests an upstream it left (FailoverStore's retry_after_s; the
# product's default is 30 s).  Short, so that a tree heals within a trial.  A liar is demoted
# for this long and then preferred again, so a liar trial's bound holds only while the
# demotion lasts over the versions it spans (ack_drop: r0's ack goes through rb then ra, two
# demotions, about 2 x 4 s apart): liar epochs rest LIAR_RETRY_AFTER_S.  With 2 s a relay that
# keeps dropping acks costs a version after every rest (measured: v..v+2 all abort)
RETRY_AFTER_S = 2.0
LIAR_RETRY_AFTER_S = 12.0
# bootstrap_lie: what the liar flips (testbed/relay_faults.py BOOTSTRAP_KEYS), and which receiver
# reads it first (the one restarted from scratch)
BOOTSTRAP_OBJS = ("run", "init_record", "init_model")
FIRST_READER = {"ra": "r1", "rb": "r0"}
# planted_keys: what a key-less writer plants before the go of v (see plant_keys)
PLANTS = ("far_versions", "ahead_junk", "ack_flood")
# planted_keys, far_versions: this many bare version numbers at the top of the 8-digit space,
# more than a relay's keep_versions (4), so that a window counted from listed numbers is full
FAR_VERSIONS = 10
# planted_keys, ack_flood: junk ack objects planted on the origin per trial; through a relay
# (relay epochs) this many of RELAY_ACK_FLOOD_BYTES each, which a relay must refuse (an ack
# is a few KB)
ACK_FLOOD = 200
RELAY_ACK_FLOOD = 4
RELAY_ACK_FLOOD_BYTES = 1 << 20
# claim_race: processes claiming one fresh prefix at once (the product's claim_store)
CLAIM_RACERS = (2, 4)
# exit_without_finish: how long after the go the trainer must be gone and v decided (the
# version's step and uploads, the ack timeout of the settle at exit, and slack for a loaded
# machine: a hang past it is recorded as one)
EXIT_SLACK_S = 60.0
# trainer_kill_inflight: when the driver SIGKILLs the trainer ranks, version v being in flight:
# once its first chunk is on the store (uploads running), once its manifest is (receivers
# fetching), once every live receiver's ack is (the decision due), or once its decision is
# (the checkpoint being written; the only moment where v may be decided before the kill).
# Before "decision", rank 0 holds v's decision put hold_s seconds, so that v is in flight
KILL_MOMENTS = ("chunks", "manifest", "acks", "decision")
# store_stall_inflight: the store (moto_server) SIGSTOPped while version v is in flight in the
# background, once its first chunk, its manifest or every receiver's ack is on the store;
# "short" (1-4 s) or "long" (the ack timeout plus 1-5 s: v's acks cannot all be read in time);
# rank 0 holds v's decision put 1.5-3 s so that v is not decided before the stall
STALL_MOMENTS = ("chunks", "manifest", "acks")
# join_forged: what a store writer without the key plants under acks/join.d/
FORGED_JOINS = ("wrong_key", "unsigned", "renamed_genuine", "hostile", "oversize")
# receiver_dies: killed before the go, once v's manifest is out, or once it acked v
DIE_MOMENTS = ("before_go", "manifest", "after_ack")
# elastic epochs: evict a member after this many versions in a row without its ack; commit
# needs at least MIN_RECEIVERS members acking
EVICT_AFTER = 2
MIN_RECEIVERS = 1
# The relay tree of a relay epoch (a chain of two relays; every upstream list ends with the
# origin store, which is implied here):
#     origin <- ra <- rb          r0 reads rb, ra, origin          r1 reads ra, origin
RELAYS = ("ra", "rb")
RELAY_UPSTREAMS = {"ra": (), "rb": ("ra",)}
RECEIVER_UPSTREAMS = {"r0": ("rb", "ra"), "r1": ("ra",)}
# when a relay fault strikes: right after the go (the trainer is uploading), once the first
# chunk of the version is on the origin (relays are pulling), once its manifest is (receivers
# are fetching)
RELAY_MOMENTS = ("go", "chunks", "manifest")
# what a key-less writer plants in hostile_doc trials (the oversized one is over every cap but
# the manifest's: 2 MiB of whitespace around an empty object)
HOSTILE_DOCS = {
    "deep_nesting": b"[" * 200_000,
    "huge_int": b'{"version": ' + b"9" * 5000 + b', "signature": "none"}',
    "duplicate_keys": b'{"version": 1, "version": 2, "signature": "none"}',
    "oversize": b" " * (2 << 20) + b"{}",
}
FOREVER = 1_000_000
RECEIVERS = ("r0", "r1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- plans
def make_plan(seed: int, trial: int, cls: str) -> dict:
    """The faults of one trial: a pure function of (seed, trial, class)."""
    rng = random.Random(f"{seed}:{trial}:{cls}")
    r = rng.choice(RECEIVERS)
    f: list[dict] = []
    if cls == "apply_exception":
        f = [{"kind": "apply_exception", "target": r, "after_records": rng.randint(0, 8)}]
    elif cls == "receiver_kill":
        point = rng.choice(["manifest_get", "chunk_get", "mid_apply", "ack_put_before", "ack_put_after",
                            "decision_get"])
        f = [{"kind": "kill", "target": r, "point": point, "after_records": rng.randint(0, 8)}]
    elif cls == "trainer_kill":
        target = rng.choice(["rank0", "rank1"])
        point = rng.choice(["chunk_put_before", "chunk_put_after"] if target == "rank1" else
                           ["manifest_put_before", "manifest_put_after", "ack_get", "decision_put_before",
                            "decision_put_after"])
        f = [{"kind": "kill", "target": target, "point": point}]
    elif cls == "store_stall":
        f = [{"kind": "stall", "target": "driver", "delay_s": round(rng.uniform(0.0, 1.0), 2),
              "stall_s": round(rng.uniform(1.0, 4.0), 2)}]
    elif cls == "store_error":
        f = [rng.choice([
            {"kind": "store_error", "target": r, "op": "get", "key_kind": "chunk", "times": rng.randint(1, 3)},
            {"kind": "store_error", "target": r, "op": "get", "key_kind": "manifest", "times": rng.randint(1, 3)},
            {"kind": "store_error", "target": r, "op": "put", "key_kind": "ack", "times": 1},
            {"kind": "store_error", "target": "rank1", "op": "put", "key_kind": "chunk", "times": 1},
            {"kind": "store_error", "target": "rank0", "op": "put", "key_kind": "manifest", "times": 1},
            {"kind": "store_error", "target": "rank0", "op": "get", "key_kind": "ack", "times": rng.randint(1, 3)},
            {"kind": "store_error", "target": "rank0", "op": "put", "key_kind": "decision", "times": 1,
             "after_write": rng.random() < 0.5},
        ])]
    elif cls == "chunk_tamper":
        f = [{"kind": "tamper", "target": r, "obj": "chunk", "reads": FOREVER,
              "mode": rng.choice(["corrupt", "truncate", "duplicate", "reorder", "foreign", "missing"])}]
    elif cls == "manifest_tamper":
        f = [{"kind": "tamper", "target": r, "obj": "manifest", "reads": FOREVER,
              "mode": rng.choice(["corrupt", "truncate", "unsigned", "forged", "foreign_signed", "replay_prev",
                                  "reorder_signed", "dup_entry_signed"])}]
    elif cls == "decision_tamper":
        f = [{"kind": "tamper", "target": r, "obj": "decision", "reads": rng.randint(1, 4),
              "mode": rng.choice(["corrupt", "truncate", "unsigned", "forged", "foreign_signed", "replay_prev"])}]
    elif cls == "ack_tamper":
        mode = rng.choice(["corrupt", "truncate", "unsigned", "forged", "foreign_signed", "replay_prev",
                           "wrong_receiver", "forged_ok_of_refusal"])
        reads = rng.choice([1, 2, FOREVER])
        if mode == "forged_ok_of_refusal":  # the receiver refuses; the trainer reads a forged ok
            f = [{"kind": "refuse", "target": r},
                 {"kind": "tamper", "target": "rank0", "obj": "ack", "receiver": r, "mode": "forged",
                  "reads": FOREVER}]
        else:
            f = [{"kind": "tamper", "target": "rank0", "obj": "ack", "receiver": r, "mode": mode, "reads": reads}]
    elif cls == "one_refuses":
        f = [{"kind": "refuse", "target": r}]
    elif cls == "pointer_attack":  # the driver, as a store writer without the key
        f = [{"kind": "pointer", "target": "driver", "receiver": r,
              "mode": rng.choice(["replay_head", "delete_pointers", "replay_committed", "aborted_head_restart"])}]
    elif cls == "hostile_doc":
        f = [{"kind": "hostile", "target": "driver", "receiver": r, "at": rng.choice(["head", "ack", "decision"]),
              "mode": rng.choice(sorted(HOSTILE_DOCS))}]
    elif cls in ("relay_kill", "relay_stop", "relay_restart_empty"):  # the driver signals a relay process
        fault = {"kind": cls, "target": rng.choice(RELAYS), "at": rng.choice(RELAY_MOMENTS),
                 "delay_s": round(rng.uniform(0.0, 0.3), 2)}
        if cls == "relay_stop":  # SIGCONT within the trial, or never (killed and restarted after the checks)
            after = rng.choice([None, round(rng.uniform(0.5, 4.0), 2)])
            fault.update(mode="never" if after is None else "cont", cont_after_s=after)
        if cls == "relay_restart_empty":  # back on the same port with a new, empty spool
            fault["down_s"] = round(rng.uniform(0.0, 1.0), 2)
        f = [fault]
    elif cls == "relay_flip":  # the relay serves chunks of v with a bit flipped (testbed/relay_faults.py)
        f = [{"kind": "relay_flip", "target": rng.choice(RELAYS), "mode": rng.choice(["one_chunk", "every_chunk"]),
              "offset": round(rng.random(), 3), "bit": rng.randint(0, 7)}]
    elif cls == "trainer_kill_inflight":
        at = rng.choice(KILL_MOMENTS)
        f = [{"kind": "trainer_sigkill", "target": "driver", "at": at, "delay_s": round(rng.uniform(0.0, 0.2), 2)}]
        if at != "decision":
            f.append({"kind": "hold", "target": "rank0", "key_kind": "decision",
                      "hold_s": round(rng.uniform(1.5, 3.0), 2)})
    elif cls == "receiver_dies":  # the target is drawn by the driver among the live receivers
        f = [{"kind": "receiver_dies", "target": "driver", "at": rng.choice(DIE_MOMENTS), "pick": rng.random()}]
    elif cls == "receiver_joins_midversion":
        f = [{"kind": "join", "target": "driver", "at": rng.choice(("chunks", "manifest"))}]
    elif cls == "join_forged":
        f = [{"kind": "join_forged", "target": "driver", "mode": rng.choice(FORGED_JOINS),
              "at": rng.choice(("before_go", "manifest")), "who": rng.choice(("ghost", "evicted", "member")),
              "pick": rng.random()}]
    elif cls == "store_stall_inflight":
        length = rng.choice(("short", "long"))
        f = [{"kind": "stall_inflight", "target": "driver", "at": rng.choice(STALL_MOMENTS),
              "delay_s": round(rng.uniform(0.0, 0.3), 2), "length": length,
              "stall_s": round(rng.uniform(1.0, 4.0), 2) if length == "short" else None,
              "over_ack_timeout_s": round(rng.uniform(1.0, 5.0), 2) if length == "long" else None},
             # rank 0 holds v's decision put, so that v is still in flight when the stall starts
             {"kind": "hold", "target": "rank0", "key_kind": "decision", "hold_s": round(rng.uniform(1.5, 3.0), 2)}]
    elif cls == "relay_doc_lie":  # one upstream fetch of v's document answered wrongly
        doc = rng.choice(["decision", "manifest"])
        f = [{"kind": "doc_lie", "target": rng.choice(RELAYS), "doc": doc,
              "mode": rng.choice(["older", "oversize"]) if doc == "decision" else "older"}]
    elif cls == "relay_hides":  # not found for v's HEAD / manifest / decision, or HEAD frozen
        doc = rng.choice(["head", "manifest", "decision"])
        f = [{"kind": "hide", "target": rng.choice(RELAYS), "doc": doc,
              "mode": rng.choice(["not_found", "frozen"]) if doc == "head" else "not_found"}]
    elif cls == "ack_drop":  # ack PUTs answered 204, not forwarded (or forwarded with a bit flipped)
        f = [{"kind": "ack_drop", "target": rng.choice(RELAYS), "mode": rng.choice(["drop", "flip"])}]
    elif cls == "bootstrap_lie":
        obj = rng.choice(BOOTSTRAP_OBJS)
        f = [{"kind": "bootstrap_lie", "target": rng.choice(RELAYS), "obj": obj,
              "mode": rng.choice(["flip", "stall"]) if obj == "init_model" else "flip",
              "offset": round(rng.random(), 3), "bit": rng.randint(0, 7)}]
    elif cls == "planted_keys":
        f = [{"kind": "planted", "target": "driver", "what": sorted(rng.sample(PLANTS, rng.randint(1, len(PLANTS)))),
              "ahead": rng.randint(1, 3)}]
    elif cls == "claim_race":
        f = [{"kind": "claim_race", "target": "driver", "backend": rng.choice(["s3", "local"]),
              "n": rng.randint(*CLAIM_RACERS)}]
    elif cls == "exit_without_finish":
        f = [{"kind": "exit", "target": "driver", "delay_s": round(rng.uniform(0.0, 0.5), 2),
              "before": rng.randint(0, 2)}]
    elif cls != "none":
        raise ValueError(cls)
    return {"trial": trial, "cls": cls, "faults": f}


def choose_class(seed: int, trial: int, schedule: str, classes: tuple[str, ...]) -> str:
    if schedule == "roundrobin":
        return classes[trial % len(classes)]
    if schedule == "list":  # --classes is the schedule itself (repeated when shorter)
        return classes[trial % len(classes)]
    rng = random.Random(f"{seed}:{trial}:class")
    return rng.choices(classes, weights=[WEIGHTS[c] for c in classes])[0]


# ----------------------------------------------------------------------------- checks
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


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    def __init__(self, log_path: str):
        self.port = free_port()
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def stall(self, seconds: float) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _log_count(directory: str, needle: str) -> int:
    """Occurrences of ``needle`` in the ``log-*`` files of a node's directory (one per start)."""
    n = 0
    for name in os.listdir(directory):
        if name.startswith("log-"):
            with open(os.path.join(directory, name), errors="replace") as f:
                n += f.read().count(needle)
    return n


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: the parent is the 4th field of stat)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


class ReceiverProc:
    def __init__(self, epoch: Epoch, rid: str, join: bool = False):
        self.epoch = epoch
        self.rid = rid
        self.join = join  # elastic: asks to become a member (Follower.join)
        self.dir = os.path.join(epoch.dir, "rx", rid)
        os.makedirs(self.dir, exist_ok=True)
        self.incarnation = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, download_init: bool = False) -> None:
        """(Re)start from scratch; ``download_init``: version 0 through its upstream list (the
        product's bootstrap), not from the driver's copy."""
        self.incarnation += 1
        state_dir = os.path.join(self.dir, f"state-{self.incarnation}")  # from scratch
        log = open(os.path.join(self.dir, f"log-{self.incarnation}.txt"), "w")
        cmd = [sys.executable, "-m", "nemo_dcr_testbed.faults", "--store", self.epoch.store_uri(self.rid),
               "--receiver-id", self.rid, "--model-id", "fault-campaign", "--init-dir", self.epoch.init_dir,
               "--plan-dir", self.epoch.plan_dir, "--dir", self.dir, "--state-dir", state_dir]
        if self.join:
            cmd.append("--join")
        if download_init:
            cmd.append("--download-init")
        if self.epoch.relays:  # faults are the relays' here (see main: no receiver store faults)
            cmd += ["--hop-timeout-s", str(self.epoch.hop_timeout_s), "--retry-after-s", str(self.epoch.retry_after_s),
                    "--no-store-faults"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.epoch.env,
                                     cwd=ROOT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask(self, req: str) -> None:
        """Ask for a settled dump (answered in ``status.json``)."""
        with open(os.path.join(self.dir, "req.tmp"), "w") as f:
            f.write(req)
        os.replace(os.path.join(self.dir, "req.tmp"), os.path.join(self.dir, "req"))

    def status(self, req: str, timeout: float) -> tuple[dict | None, int]:
        """Ask for a settled dump; restarts the process when it died.  (status, restarts)."""
        self.ask(req)
        restarts = 0
        deadline = time.monotonic() + timeout
        path = os.path.join(self.dir, "status.json")
        while time.monotonic() < deadline:
            if not self.alive():
                if restarts >= 3:
                    return None, restarts
                restarts += 1
                self.start()
            try:
                with open(path) as f:
                    st = json.load(f)
                if st["req"] == req:
                    return st, restarts
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.05)
        return None, restarts

    def log_count(self, needle: str) -> int:
        return _log_count(self.dir, needle)

    def close(self) -> None:
        open(os.path.join(self.dir, "stop"), "w").close()
        _kill(self.proc)


class RelayProc:
    """One relay of a relay epoch: the product's relay server, run by the test-bed launcher
    ``nemo_dcr_testbed.relay_faults`` (which can make it serve flipped chunk bytes, per plan),
    on a port fixed for the epoch so that a restarted relay is found at the same address."""

    def __init__(self, epoch: Epoch, role: str):
        self.epoch = epoch
        self.role = role
        self.dir = os.path.join(epoch.dir, "relays", role)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.uri = f"relay://127.0.0.1:{self.port}"
        self.launches = 0
        self.stopped = False
        self.proc: subprocess.Popen | None = None
        # a warm spare (imports done, upstreams opened, waiting to bind): a restart under load
        # then takes a bind, not a Python start (tens of seconds on the loaded 2-core machine)
        self.spare: tuple[subprocess.Popen, str] | None = None

    def _launch(self, standby: str | None) -> subprocess.Popen:
        self.launches += 1  # every launch has its own log and its own, empty spool directory
        upstream = ",".join([self.epoch.relays[r].uri for r in RELAY_UPSTREAMS[self.role]] + [self.epoch.uri])
        cmd = [sys.executable, "-m", "nemo_dcr_testbed.relay_faults", "--role", self.role,
               "--plan-dir", self.epoch.plan_dir, "--upstream", upstream, "--listen", f"127.0.0.1:{self.port}",
               "--spool", os.path.join(self.dir, f"spool-{self.launches}"),
               "--hop-timeout-s", str(self.epoch.hop_timeout_s), "--retry-after-s", str(self.epoch.retry_after_s)]
        if standby:
            cmd += ["--standby", standby]
        log = open(os.path.join(self.dir, f"log-{self.launches}.txt"), "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.epoch.env, cwd=ROOT,
                                start_new_session=True)

    def start(self) -> None:
        """(Re)start on the epoch's port, on a new, empty spool: the warm spare when there is
        one (then a new spare is launched)."""
        self.stopped = False
        if self.spare is not None and self.spare[0].poll() is None:
            self.proc, go = self.spare
            open(go, "w").close()
        else:
            self.proc = self._launch(None)
        go = os.path.join(self.dir, f"go-{self.launches + 1}")
        self.spare = (self._launch(go), go)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"relay {self.role} did not start (pid {self.proc.pid})")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    def kill(self) -> None:
        _kill(self.proc)
        self.stopped = False

    def log_count(self, needle: str) -> int:
        return _log_count(self.dir, needle)

    def close(self) -> None:
        self.kill()
        if self.spare is not None:
            _kill(self.spare[0])


class Epoch:
    """One trainer run on a fresh bucket, with its receivers (and, in a relay epoch, the
    relay tree they read through)."""

    def __init__(self, work: str, index: int, moto: Moto, key_file: str, ack_timeout_s: float, seed: int,
                 relays: bool = False, hop_timeout_s: float = 2.0, retry_after_s: float = 2.0,
                 pipeline: bool = False, elastic: bool = False):
        import s3fs

        self.index = index
        self.seed = seed
        self.moto = moto  # store_stall_inflight stops it
        self.pipeline = pipeline
        self.elastic = elastic
        self.incarnation = 1  # trainer starts (pipelined epochs resume it after a kill)
        self.joins = 0  # receivers started with --join so far (named j1, j2, ...)
        self.dead: dict[str, ReceiverProc] = {}  # receivers killed for good (receiver_dies)
        self.ack_timeout_s = ack_timeout_s
        self.hop_timeout_s = hop_timeout_s
        self.retry_after_s = retry_after_s
        self.relays: dict[str, RelayProc] = {}
        self.quiet_at = 0.0  # relay epochs: no trial starts before (monotonic)
        self.dir = os.path.join(work, f"epoch-{index}")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.plan_dir = os.path.join(self.dir, "plan")
        for d in ("plan", "go", "dense"):
            os.makedirs(os.path.join(self.dir, d))
        bucket = f"dcr-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto.env["AWS_ENDPOINT_URL"]})
        fs.mkdir(bucket)
        self.uri = f"s3://{bucket}/run"
        self.env = dict(os.environ, **moto.env, NEMO_DCR_KEY_FILE=key_file, OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1")
        self.trainer_log = os.path.join(self.dir, "trainer.log")
        t0 = time.monotonic()
        self.receivers: dict[str, ReceiverProc] = {}
        ready = self.start_trainer()
        if ready.get("refused"):
            raise RuntimeError(f"campaign trainer refused to start: {ready}")
        self.run_id = ready["run_id"]
        self.members = set(RECEIVERS)  # as the last signed decision read names them
        from nemo_dcr.integrations.hf_export import download_checkpoint
        from nemo_dcr.transport.store import open_store

        os.environ.update(moto.env)
        self.store = open_store(self.uri)
        self.init_dir = download_checkpoint(self.store, os.path.join(self.dir, "init"))
        if relays:  # roots first: a relay's upstream list names its parent
            self.relays = {role: RelayProc(self, role) for role in RELAYS}
            for relay in self.relays.values():
                relay.start()
            for relay in self.relays.values():
                relay.wait_ready()
        self.receivers = {rid: ReceiverProc(self, rid) for rid in RECEIVERS}
        for rx in self.receivers.values():  # the first version must not race their start
            self.wait_ready(rx, t0)
        self.version = 0
        self.committed = 0
        self.heads: dict[int, bytes] = {}  # HEAD.json bytes after each trial (genuine, signed)
        self.aborted: set[int] = set()
        self.planted: set[int] = set()  # version numbers a key-less writer planted (planted_keys)
        self.rows_seen = 0
        self.setup_s = time.monotonic() - t0

    @staticmethod
    def wait_ready(rx: "ReceiverProc", t0: float, timeout: float = 300.0) -> None:
        while rx.log_count('"ready": true') < 1:
            if not rx.alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"receiver {rx.rid} did not start:\n"
                                   f"{_tail(os.path.join(rx.dir, f'log-{rx.incarnation}.txt'))}")
            time.sleep(0.1)

    def start_trainer(self, resume: bool = False) -> dict:
        """Start the trainer ranks (a pipelined epoch's resume: from its last checkpoint) and
        wait until they are ready; returns the ready file (pipelined: the next version) or
        ``{"refused": ...}`` when a resume was refused."""
        self.launch_trainer(resume)
        return self.wait_trainer()

    def launch_trainer(self, resume: bool = False) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "nemo_dcr_testbed.campaign_trainer", "--dir", self.dir, "--store", self.uri,
               "--ack-timeout-s", str(self.ack_timeout_s), "--seed", str(self.seed + self.index)]
        if self.pipeline:
            cmd += ["--pipeline", "--incarnation", str(self.incarnation)]
            if self.elastic:
                cmd += ["--membership", "elastic", "--min-receivers", str(MIN_RECEIVERS),
                        "--evict-after", str(EVICT_AFTER)]
            if resume:
                cmd.append("--resume")
        self.trainer_t0 = time.monotonic()
        self.trainer = subprocess.Popen(cmd, stdout=open(self.trainer_log, "a"), stderr=subprocess.STDOUT,
                                        env=self.env, cwd=ROOT, start_new_session=True)

    def wait_trainer(self) -> dict:
        t0 = self.trainer_t0
        ready = os.path.join(self.dir, f"ready-{self.incarnation}.json" if self.pipeline else "ready.json")
        refused = os.path.join(self.dir, f"refused-{self.incarnation}.json")
        while not os.path.exists(ready):
            if os.path.exists(refused):
                with open(refused) as f:
                    return {"refused": json.load(f)}
            if self.trainer.poll() is not None or time.monotonic() - t0 > 300:
                if os.path.exists(refused):
                    continue
                raise RuntimeError(f"campaign trainer did not start:\n{_tail(self.trainer_log)}")
            time.sleep(0.1)
        with open(ready) as f:
            return json.load(f)

    def kill_trainer(self) -> list[int]:
        """SIGKILL every trainer rank, then torchrun (the ranks run in sessions of their own,
        out of torchrun's process group).  Returns the ranks' pids still alive after it
        (must be none)."""
        ranks = _descendants(self.trainer.pid) if self.trainer.poll() is None else []
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill(self.trainer)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_pid_alive(p) for p in ranks):
            time.sleep(0.05)
        return [p for p in ranks if _pid_alive(p)]

    def store_uri(self, rid: str) -> str:
        """The store URI a receiver reads: the origin, or its relays then the origin."""
        if not self.relays:
            return self.uri
        return ",".join([self.relays[r].uri for r in RECEIVER_UPSTREAMS[rid]] + [self.uri])

    def heal(self) -> list[str]:
        """Start making the tree whole again: a relay still stopped is killed, a dead one is
        restarted on the same port (a relay never reads an earlier incarnation's spool: each
        start makes its own).  Returns what was done; :meth:`wait_healed` waits for it."""
        done = []
        for role, relay in self.relays.items():
            if relay.stopped:
                relay.kill()
                done.append(f"{role}: stopped, killed")
            if not relay.alive():
                relay.start()
                done.append(f"{role}: restarted")
        return done

    def wait_healed(self) -> None:
        for relay in self.relays.values():
            relay.wait_ready()

    def rows(self) -> list[dict]:
        try:
            with open(os.path.join(self.dir, "steps.jsonl")) as f:
                return [json.loads(x) for x in f.read().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def row(self, version: int) -> dict | None:
        """The trainer's row of ``version`` (versions skip numbers after a resume)."""
        return next((r for r in self.rows() if r["version"] == version), None)

    def dense(self, version: int) -> dict:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.dir, "dense", f"v{version}.safetensors"))

    def close(self) -> None:
        open(os.path.join(self.dir, "stop"), "w").close()
        for rx in self.receivers.values():
            rx.close()
        for relay in self.relays.values():
            relay.close()
        try:
            self.trainer.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.kill_trainer()


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- store attacks
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


# ----------------------------------------------------------------------------- relay faults
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


# ----------------------------------------------------------------------------- one trial
def run_trial(ep: Epoch, moto: Moto, plan: dict, seed: int, liveness: bool = False,
              wait_quiet: bool = True) -> tuple[dict, bool]:
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
    rec = {"trial": plan["trial"], "seed": seed, "cls": plan["cls"], "faults": plan["faults"],
           "topology": "relay" if ep.relays else "store", "ack_timeout_s": ep.ack_timeout_s,
           "epoch": ep.index, "version": v, "base_version": base, "violations": [], "hang": False,
           "unplanned_restarts": 0, "planned_restarts": 0}
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
    rec["attack"] = attacker.done or relay_faulter.done
    if ep.relays:
        # decided: the tree starts healing now, while the receivers settle (a relay stopped for
        # good is killed and restarted, a killed one restarted); an unplanned relay death is counted
        planned = {f["target"] for f in plan["faults"] if f["kind"] in RelayFaulter.KINDS}
        rec["relay_crashes"] = [r for r, relay in ep.relays.items() if not relay.alive() and r not in planned]
        rec["healed"] = ep.heal()
    rec["t_go"] = t_go
    end_epoch = False
    if row is None:
        if ep.trainer.poll() is None:  # hung: the trainer neither decided nor died
            rec["hang"] = True
            rec["violations"].append("trainer did not decide within 180s")
            return rec, True
        end_epoch = True
        if not trainer_kill:
            rec["violations"].append(f"trainer exited ({ep.trainer.returncode}) without a fault planned: "
                                     + _tail(ep.trainer_log, 5))
        # what was decided about v, if anything, is on the store
        sealer = Sealer(load_key(os.environ.get("NEMO_DCR_KEY_FILE")))
        try:
            d = Decision.from_json(ep.store.get(decision_key(v)), sealer)
        except KeyError:
            d = None
        rec["t_decided"] = time.time()
        rec["committed"] = bool(d and d.commit)
        rec["decision_written"] = d is not None
        rec["reason"] = "trainer rank killed"
        expect_committed = v if (d and d.commit) else base
        allowed_tentative = {None} if d is not None else {None, v}
    else:
        rec["t_decided"] = row["t_decided"]
        rec["committed"] = row["committed"]
        rec["reason"] = row["reason"][:300]
        rec["changed"], rec["chunks"] = row["changed"], row["chunks"]
        if row["base_version"] != base:
            rec["violations"].append(f"trainer base {row['base_version']}, driver expected {base}")
        expect_committed = v if row["committed"] else base
        allowed_tentative = {None}
    if rec["committed"]:
        ep.committed = v
    else:
        ep.aborted.add(v)
    # ---- every receiver settles, then its served bits are compared
    planned_kill = {f["target"] for f in plan["faults"] if f["kind"] == "kill"}
    if liveness:
        rec["lagging"] = []
    end_epoch = check_receivers(ep, rec, v, expect_committed, allowed_tentative, planned_kill,
                                lag=rec.get("lagging")) or end_epoch
    return _finish_trial(ep, rec, v, end_epoch, ignored_before, refused_before, left_before, switches_before,
                         flips_before)


def check_receivers(ep: Epoch, rec: dict, v: int, expect_committed: int, allowed_tentative: set,
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
            rec["planned_restarts"] += min(dead_restarts, 1)
            dead_restarts -= min(dead_restarts, 1)
        rec["unplanned_restarts"] += dead_restarts
        if dead_restarts:
            rec.setdefault("crashes", []).append(f"{rid}: {_tail(os.path.join(rx.dir, f'log-{rx.incarnation - 1}.txt'), 3)}")
        if st is None:
            rec["hang"] = True
            rec["violations"].append(f"{rid}: no settled state within 120s (was_dead={was_dead})")
            log = os.path.join(rx.dir, f"log-{rx.incarnation}.txt")
            rec.setdefault("hang_logs", {})[rid] = _tail(log, 6)[-1500:]
            end_epoch = True
            continue
        info = {k: st.get(k) for k in ("committed", "tentative", "awaiting", "handled", "held_version", "member")}
        rec["receivers"][rid] = info
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
            rec["violations"].append(f"{rid}: committed v{st['committed']}, trainer committed v{expect_committed}")
        if st["tentative"] not in allowed_tentative:
            rec["violations"].append(f"{rid}: serves tentative v{st['tentative']} after the decision")
        if bad:
            rec["violations"].append(f"{rid}: {len(bad)} tensors differ from the dense state of v{held}: {bad[:3]}")
        if st["committed"] != expect_committed or bad:
            # which version's bits does it hold?  (diagnosis only)
            for k in range(max(0, v - 3), v + 1):
                if os.path.exists(os.path.join(ep.dir, "dense", f"v{k}.safetensors")) \
                        and not compare_state(served, ep.dense(k)):
                    info["bits_of"] = k
    return end_epoch


def _finish_trial(ep: Epoch, rec: dict, v: int, end_epoch: bool, ignored_before: int, refused_before: int,
                  left_before: dict, switches_before: dict, flips_before: int) -> tuple[dict, bool]:
    if ep.relays:
        t_heal = time.monotonic()
        ep.wait_healed()  # the next trial starts on the whole tree
        rec["heal_wait_s"] = round(time.monotonic() - t_heal, 3)
        # a node "re-parents" when it leaves a failed upstream for the next one (FailoverStore's
        # warning); switching back to a healed parent is counted apart
        left, switches = _node_counts(ep, LEFT_LINE), _node_counts(ep, SWITCH_LINE)
        rec["reparents"] = {n: left[n] - left_before.get(n, 0) for n in left if left[n] > left_before.get(n, 0)}
        rec["switches"] = {n: switches[n] - switches_before.get(n, 0) for n in switches
                           if switches[n] > switches_before.get(n, 0)}
        rec["flipped_chunks"] = _flips(ep) - flips_before
        if rec["reparents"] or rec["healed"]:
            # the next trial starts once every node prefers its first upstream again (a left
            # upstream rests retry_after_s), so that its fault meets the tree's real shape
            ep.quiet_at = time.monotonic() + ep.retry_after_s
    ignored_after = sum(rx.log_count('"ignored"') for rx in ep.receivers.values())
    refused_after = sum(rx.log_count('"ok": false') for rx in ep.receivers.values())
    rec["receiver_ignored"] = ignored_after - ignored_before
    if rec["receiver_ignored"] > 40:  # each planted object is logged once per identity, not per poll
        rec["violations"].append(f"log flood: {rec['receiver_ignored']} ignored-object lines in one trial")
    try:
        ep.heads[v] = ep.store.get("HEAD.json")  # what a later pointer_attack may replay
    except KeyError:
        pass
    rec["receiver_refused"] = refused_after - refused_before
    rec["detected"] = bool(not rec["committed"] or rec["receiver_ignored"] or rec["receiver_refused"]
                           or rec["planned_restarts"] or rec["unplanned_restarts"] or end_epoch
                           or rec.get("reparents"))
    rec["duration_s"] = round(time.time() - rec["t_go"], 3)
    rec["silent"] = bool(rec["violations"]) and not rec["hang"]
    # after a violation the run's state is not trusted: the next trial starts a fresh run
    return rec, end_epoch or bool(rec["violations"])


# ----------------------------------------------------------------------------- liars, planted keys, claim race
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


def run_liar_trial(ep: Epoch, moto: Moto, plan: dict, seed: int) -> tuple[dict, bool]:
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
    rec["faults"] = plan["faults"]
    rec.update(head)
    rec["versions"] = [{"version": r["version"], "committed": r["committed"], "lagging": r["lagging"]}
                       for r in parts]
    for r in parts[1:]:
        rec["violations"] += r["violations"]
        rec["hang"] = rec["hang"] or r["hang"]
        rec["unplanned_restarts"] += r["unplanned_restarts"]
        for key in ("reparents", "switches"):
            for n, c in (r.get(key) or {}).items():
                rec.setdefault(key, {})[n] = rec.get(key, {}).get(n, 0) + c
        rec["detected"] = rec["detected"] or r["detected"]
    last = parts[-1]
    rec.update(committed=last["committed"], t_decided=last["t_decided"], receivers=last.get("receivers"))
    clean = last["committed"] and not last["lagging"]
    if not clean and not rec["violations"]:
        rec["failures"].append(f"no version within v{v0}..v{v0 + bound} committed with every receiver on it "
                               f"(versions {[(e['version'], e['committed']) for e in rec['versions']]}; "
                               f"{'; '.join(last['lagging'])[:300]})")
    if ep.relays:
        rec["lies"] = _lies(ep) - lies_before
        rec["struck"] = rec["lies"] > 0 or cls == "planted_keys"
    if cls == "planted_keys" and ep.relays:
        kept, seen = _relay_versions(ep), _relay_versions(ep, "recently_confirmed")
        rec["relay_versions"] = kept
        rec["relay_confirmed"] = seen
        # planted numbers must not push the real versions out: a relay through which a
        # child read the version's manifest or decision must still hold it; one its
        # children bypassed (a liar epoch's relay, left after a lie) may not (planted junk
        # under v/<v>/chunks/ can bring v in unconfirmed, and planted versions replace it)
        for role, vs in kept.items():
            if vs is not None and last["version"] in (seen.get(role) or []) and last["version"] not in vs \
                    and any(w in ep.planted for w in vs):
                rec["failures"].append(f"{role} keeps {vs}: planted versions pushed v{last['version']} out")
        if head["planted"].get("relay_acks_accepted"):
            rec["failures"].append(f"ra forwarded {head['planted']['relay_acks_accepted']} acks of "
                                   f"{RELAY_ACK_FLOOD_BYTES} bytes to the origin")
    if cls in LIAR_CLASSES and not end:  # the liar forgets what it cached
        relay = ep.relays[f["target"]]
        relay.kill()
        relay.start()
        relay.wait_ready()
        rec.setdefault("healed", []).append(f"{f['target']}: liar restarted on an empty spool")
        ep.quiet_at = time.monotonic() + ep.retry_after_s
    rec["duration_s"] = round(time.time() - rec["t_go"], 3)
    rec["silent"] = bool(rec["violations"]) and not rec["hang"]
    return rec, end or bool(rec["failures"]) or bool(rec["violations"])


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


def run_claim_race(ep: Epoch, plan: dict, seed: int) -> dict:
    """claim_race: N processes call the product's ``claim_store`` (``nemo_dcr.protocol.run``)
    on one fresh prefix at once (the epoch's moto S3 server or a local directory), released
    together by a file once every one has imported and opened its store.  Checked: exactly
    one wins, every other one gets one ``ForeignRunError``, and ``RUN.json`` names the
    winner.  Anything else is a failure (the claim is not atomic)."""
    from nemo_dcr.protocol.run import read_run
    from nemo_dcr.transport.store import open_store

    f = plan["faults"][0]
    t_go = time.time()
    rec = {"trial": plan["trial"], "seed": seed, "cls": plan["cls"], "faults": plan["faults"],
           "topology": "pipeline" if ep.pipeline else "relay" if ep.relays else "store",
           "ack_timeout_s": ep.ack_timeout_s, "epoch": ep.index, "version": ep.version, "base_version": ep.committed,
           "violations": [], "failures": [], "hang": False, "unplanned_restarts": 0, "planned_restarts": 0,
           "t_go": t_go, "committed": None, "t_decided": t_go, "detected": True}
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
                rec["failures"].append(f"a claimant did not start: {line.strip()[:200]}")
        open(go, "w").close()
        for pr in procs:
            try:
                out, _ = pr.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                rec["hang"] = True
                rec["violations"].append("a claimant did not return within 120s")
                continue
            lines = [x for x in out.splitlines() if x.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else {"lost": "no answer", "error": out[-200:]})
    finally:
        for pr in procs:
            _kill(pr)
    winners = [o["won"] for o in outs if "won" in o]
    losers = [o["lost"] for o in outs if "lost" in o]
    rec["claims"] = {"backend": f["backend"], "n": f["n"], "winners": len(winners), "losers": losers}
    if len(winners) != 1:
        rec["failures"].append(f"{len(winners)} of {f['n']} claimants won the prefix")
    if any(x != "ForeignRunError" for x in losers):
        rec["failures"].append(f"losers got {losers}, not ForeignRunError each")
    try:
        held = read_run(open_store(uri), _sealer())
        if len(winners) == 1 and (held is None or held.run_id != winners[0]):
            rec["failures"].append("RUN.json does not name the winner")
    except Exception as e:  # noqa: BLE001 - recorded
        rec["failures"].append(f"RUN.json unreadable after the race: {str(e)[:200]}")
    rec["committed"] = not rec["failures"]
    rec["duration_s"] = round(time.time() - t_go, 3)
    rec["silent"] = False
    return rec


# ----------------------------------------------------------------------------- pipelined epochs
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


def _pstep(ep: Epoch, plan: dict, rec: dict, during=None) -> tuple[int, dict | None, object]:
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
    rec["versions"].append(entry)
    if row is None:
        rec["hang"] = ep.trainer.poll() is None
        rec["violations"].append(f"v{v}: the trainer {'did not decide within 180s' if rec['hang'] else 'exited'}: "
                                 + _tail(ep.trainer_log, 3))
        return v, None, None
    if d is None or d.commit != row["committed"]:
        rec["violations"].append(f"v{v}: the trainer's row says committed={row['committed']}, the signed decision "
                                 f"{'is missing' if d is None else f'says {d.commit}'}")
    if row["base_version"] != ep.committed:
        rec["violations"].append(f"v{v}: trainer base {row['base_version']}, driver expected {ep.committed}")
    if row["committed"]:
        ep.committed = v
    else:
        ep.aborted.add(v)
    if d is not None:
        ep.members = set(d.receivers)
    rec["t_decided"] = row["t_decided"]
    rec["committed"] = row["committed"]
    if check_receivers(ep, rec, v, ep.committed, {None}):
        rec["end_epoch"] = True
    return v, row, d


def _new_record(ep: Epoch, plan: dict, seed: int) -> dict:
    return {"trial": plan["trial"], "seed": seed, "cls": plan["cls"], "faults": plan["faults"],
            "topology": "pipeline", "membership": "elastic" if ep.elastic else "static",
            "ack_timeout_s": ep.ack_timeout_s, "epoch": ep.index, "version": ep.version + 1,
            "base_version": ep.committed, "violations": [], "failures": [], "hang": False,
            "unplanned_restarts": 0, "planned_restarts": 0, "versions": [], "t_go": time.time(),
            "committed": False, "t_decided": time.time()}


def run_pipeline_trial(ep: Epoch, plan: dict, seed: int) -> tuple[dict, bool]:
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
        rec["redrawn_from"], cls = cls, "receiver_joins_midversion"
        plan = {**plan, "cls": cls, "faults": [{"kind": "join", "target": "driver", "at": "manifest"}]}
        rec.update(cls=cls, faults=plan["faults"])
    elif cls == "receiver_joins_midversion" and len(ep.receivers) >= 4:
        rec["redrawn_from"], cls = cls, "receiver_dies"
        plan = {**plan, "cls": cls, "faults": [{"kind": "receiver_dies", "target": "driver", "at": "manifest",
                                                "pick": 0.5}]}
        rec.update(cls=cls, faults=plan["faults"])
    end = False
    if cls == "none":
        _, row, _ = _pstep(ep, plan, rec)
        if row is not None and not row["committed"]:
            rec["failures"].append("the control version did not commit")
        rec["detected"] = False
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
    rec["duration_s"] = round(time.time() - rec["t_go"], 3)
    rec["silent"] = bool(rec["violations"]) and not rec["hang"]
    rec.setdefault("detected", True)
    end = end or rec.pop("end_epoch", False) or bool(rec["violations"]) or rec["hang"] or ep.trainer.poll() is not None
    return rec, end


def _listed_versions(ep: Epoch) -> list[int]:
    """Version numbers listed under ``v/``, without those the driver planted (planted_keys)."""
    return sorted({int(k.split("/")[1]) for k in ep.store.list("v/") if k.count("/") >= 2} - ep.planted)


def _trial_trainer_kill(ep: Epoch, plan: dict, rec: dict) -> bool:
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
        rec["violations"].append(f"trainer ranks {survivors} survived the SIGKILL (the check would be void)")
        rec["end_epoch"] = True
        return True
    rec["t_kill"] = time.time()
    d = _decision(ep, v)
    with open(os.path.join(ep.dir, "ckpt", "LATEST")) as fh:
        ckpt = json.load(fh)["version"]
    fate.update(chunks=len(ep.store.list(f"v/{v:08d}/chunks/")), manifest=ep.store.exists(manifest_key(v)),
                decision=None if d is None else ("commit" if d.commit else "abort"), checkpoint=ckpt)
    rec["fate"] = fate
    if fate["row_before_kill"] and f["at"] != "decision":
        rec["failures"].append(f"v{v} was decided before the kill at {f['at']} (the hold did not keep it in flight)")
    # the resumed trainer starts while the receivers settle on what the killed one left
    ep.incarnation += 1
    ep.launch_trainer(resume=True)
    expect = v if d is not None and d.commit else base
    if check_receivers(ep, rec, v, expect, {None} if d is not None else {None, v}):
        rec["end_epoch"] = True
    fate["receivers_tentative"] = sorted(r for r, i in rec["receivers"].items() if i.get("tentative") == v)
    if d is not None and d.commit:
        ep.committed = v
    ready = ep.wait_trainer()
    if "refused" in ready:
        fate["resume"] = "refused"
        fate["refusal"] = ready["refused"]["error"][:300]
        # documented (docs/protocol.md, "Run state"): a checkpoint older than the store's
        # committed version is refused; any other refusal is a failure of the resume
        if not (d is not None and d.commit and ckpt < v):
            rec["failures"].append(f"resume from checkpoint v{ckpt} refused: {fate['refusal']}")
        elif f"committed v{v} after it" not in fate["refusal"]:
            rec["failures"].append(f"resume refused with an unexpected message: {fate['refusal']}")
        rec["t_decided"] = rec["t_kill"]
        return True
    in_use = max([v, *_listed_versions(ep)])
    fate.update(resume="ok", resumed_committed=ready["committed"], next_version=ready["next_version"],
                in_use=in_use)
    if ready["committed"] != ep.committed:
        rec["violations"].append(f"resumed at committed v{ready['committed']}, the store's run committed "
                                 f"v{ep.committed}")
    if ready["next_version"] <= in_use:
        rec["violations"].append(f"resumed trainer's next version {ready['next_version']} reuses a number in use "
                                 f"(<= {in_use})")
    ep.version = ready["next_version"] - 1
    for _ in range(3):  # the resumed run must commit (an abort under load is retried, bounded)
        w, row, _ = _pstep(ep, {"trial": plan["trial"], "cls": plan["cls"], "faults": []}, rec)
        if row is None or row["committed"] or rec["violations"]:
            break
    fate["resumed_versions"] = [e["version"] for e in rec["versions"]]
    if not rec["committed"]:
        rec["failures"].append("the resumed run did not commit within 3 versions")
    return False


def _trial_receiver_dies(ep: Epoch, plan: dict, rec: dict) -> None:
    """SIGKILL a member for good; it must be evicted after EVICT_AFTER versions without
    its ack, no version it did not ack may commit while it is a member, and the next
    version commits with the rest."""
    from nemo_dcr.protocol.manifest import ack_key

    f = plan["faults"][0]
    live = sorted(ep.receivers)
    target = live[min(int(f["pick"] * len(live)), len(live) - 1)]
    rx = ep.receivers.pop(target)
    ep.dead[target] = rx
    rec["target"] = target

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
            rec["violations"].append(f"v{v} committed while {target} was a member and had not acked it")
        if target in d.evicted:
            evicted_at = v
            if target in d.receivers:
                rec["violations"].append(f"v{v} evicts {target} and still names it a member")
            break
    rec["evicted_at"] = evicted_at
    if evicted_at is None:
        rec["failures"].append(f"{target} not evicted within {EVICT_AFTER + 2} versions")
        return
    if not rec["committed"]:  # the eviction version aborted (e.g. another slow ack): one more
        _pstep(ep, {**plan, "faults": []}, rec)
    v, row, d = _pstep(ep, {**plan, "faults": []}, rec)  # a later version commits with the rest
    if row is not None and not row["committed"]:
        rec["failures"].append(f"v{v} after the eviction did not commit")
    if d is not None and target in d.receivers:
        rec["violations"].append(f"v{v}: evicted {target} is a member again")


def _trial_join(ep: Epoch, plan: dict, rec: dict) -> None:
    """Start a fresh receiver with --join while version v is in flight; it must be admitted
    at a later version, which commits, and serve that version's bits (checked with the
    others after every version)."""
    f = plan["faults"][0]
    ep.joins += 1
    rid = f"j{ep.joins}"
    rec["target"] = rid

    started: list[ReceiverProc] = []

    def start(v: int) -> None:
        _moment(ep, v, f["at"])
        rec["started_in_flight"] = ep.row(v) is None
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
            rec["failures"].append(f"{rid} did not start: {str(e)[:200]}")
            return
        ep.receivers[rid] = started[0]
        for _ in range(4):
            w, row, d = _pstep(ep, {**plan, "faults": []}, rec)
            if row is None or d is None:
                return
            if rid in d.joined:
                admitted = w
                if rid not in d.receivers:
                    rec["violations"].append(f"v{w} admits {rid} and does not name it a member")
                if d.commit and row["committed"] is False:
                    rec["violations"].append(f"v{w}: decision and row disagree")
                break
    rec["admitted_at"] = admitted
    if admitted is None:
        rec["failures"].append(f"{rid} not admitted within 4 versions after the one it started in")
        return
    if not rec["committed"]:
        _pstep(ep, {**plan, "faults": []}, rec)
    w, row, d = _pstep(ep, {**plan, "faults": []}, rec)  # its ack counts now: commits with it
    if row is not None and not row["committed"]:
        rec["failures"].append(f"v{w} after {rid}'s admission did not commit")
    if d is not None and rid not in d.receivers:
        rec["violations"].append(f"v{w}: admitted {rid} is no longer a member")


def _trial_stall_inflight(ep: Epoch, plan: dict, rec: dict) -> None:
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
    rec["stall"] = {"stall_s": round(stall_s, 2), **seen,
                    "outcome": None if row is None else ("commit" if row["committed"] else "abort")}
    if row is None:
        return
    if d is not None and d.evicted:
        rec["failures"].append(f"v{v}: one stalled version evicted {list(d.evicted)}")
    for _ in range(3):
        w, row, d = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec["violations"]:
            break
    if row is not None and not row["committed"]:
        rec["failures"].append("no version committed within 3 versions after the stall")
    if d is not None and d.commit and set(d.receivers) != members_before:
        rec["failures"].append(f"members changed across the stall: {sorted(members_before)} -> {sorted(d.receivers)}")


def _trial_planted_resume(ep: Epoch, plan: dict, rec: dict) -> bool:
    """planted_keys in a pipelined epoch: keys planted before the go of v (plant_keys); v
    must commit (or v+1); then the trainer is SIGKILLed between versions (v's checkpoint
    written) and resumed from it: its next version must be one past the last it published
    or, with ahead_junk, past the last bare number planted just above it (counted as a
    killed upload's: ``protocol/history.py`` FLOOR_SLACK); far planted numbers do not raise the
    floor; and it must commit.  Returns whether the
    epoch must end (a refused resume or a raised floor)."""
    rec["planted"] = plant_keys(ep, ep.version + 1, plan["faults"][0])
    for i in range(2):
        v, row, _ = _pstep(ep, plan if i == 0 else {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec["violations"]:
            break
    if row is None or rec["violations"]:
        return True
    if not row["committed"]:
        rec["failures"].append(f"neither v{v - 1} nor v{v} committed after the planted keys")
        return True
    survivors = ep.kill_trainer()  # between versions: v decided and checkpointed (its row is written after)
    if survivors:
        rec["violations"].append(f"trainer ranks {survivors} survived the SIGKILL")
        return True
    ep.incarnation += 1
    ready = ep.start_trainer(resume=True)
    rec["resume"] = {k: ready.get(k) for k in ("next_version", "committed", "refused")}
    if "refused" in ready:
        rec["failures"].append(f"resume after planted keys refused: {ready['refused']['error'][:300]}")
        return True
    expect = max(ep.version, rec["planted"].get("near_to", 0)) + 1
    if ready["next_version"] != expect:
        rec["failures"].append(f"resumed trainer's next version is {ready['next_version']}, one past the last "
                               f"published or near bare number is {expect}: planted keys set the floor")
        return True
    ep.version = ready["next_version"] - 1  # the driver's next go is the resumed trainer's next version
    for _ in range(3):
        w, row, _ = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or row["committed"] or rec["violations"]:
            break
    if not rec["committed"]:
        rec["failures"].append("the resumed run did not commit within 3 versions")
    return False


def _trial_exit(ep: Epoch, plan: dict, rec: dict) -> None:
    """exit_without_finish: every trainer rank leaves its loop with sys.exit() right after
    the hook call of v (v in flight), calling no finish().  Within the ack timeout plus
    EXIT_SLACK_S of the go the trainer must be gone and v decided (a signed decision on the
    store; none is a failure, a trainer still there a hang); then every receiver must hold
    what was decided (v, or its base after an abort), checked bit for bit."""
    f = plan["faults"][0]
    for _ in range(f.get("before", 0)):  # clean versions first: the exit is not always the run's first
        _, row, _ = _pstep(ep, {**plan, "faults": []}, rec)
        if row is None or rec["violations"]:
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
    rec["exit"] = {"trainer_gone": gone, "rc": ep.trainer.returncode, "after_s": round(time.monotonic() - t0, 2),
                   "decision": None if d is None else ("commit" if d.commit else "abort")}
    rec["versions"].append({"version": v, "committed": bool(d and d.commit)})
    if not gone:
        rec["hang"] = True
        rec["violations"].append(f"v{v}: the trainer did not end within {bound:.0f}s of its sys.exit()")
        ep.kill_trainer()
    if d is None:
        rec["failures"].append(f"v{v}: no signed decision after the trainer exited without finish()")
    elif d.commit:
        ep.committed = v
    else:
        ep.aborted.add(v)
    rec["committed"] = bool(d and d.commit)
    rec["t_decided"] = time.time()
    check_receivers(ep, rec, v, v if (d and d.commit) else base, {None} if d is not None else {None, v})


def _trial_join_forged(ep: Epoch, plan: dict, rec: dict) -> None:
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
            rec["violations"].append(f"v{v}: the forged join request admitted {rid}")
        if set(d.receivers) != members_before:
            rec["violations"].append(f"v{v}: members {sorted(d.receivers)}, before the forgery "
                                     f"{sorted(members_before)}")
        if not row["committed"]:
            rec["failures"].append(f"v{v} did not commit after the forgery")
    rec["detected"] = not any(e.get("joined") for e in rec["versions"])


# ----------------------------------------------------------------------------- report
def _row(r: dict) -> str:
    """The summary row of a record: its class; a store class run in a relay epoch (the
    "none" control of a relay campaign) is a row of its own, ``<class>@relay``."""
    if r["cls"] not in STORE_CLASSES:
        return r["cls"]
    if r.get("topology", "store") == "relay":
        return f"{r['cls']}@relay"
    if r.get("topology", "store") == "pipeline":
        return f"{r['cls']}@pipeline"
    return r["cls"]


def _run_of(r: dict) -> tuple[str, int]:
    """The run (trainer epoch) a record belongs to: a store campaign and a relay campaign
    summarized together number their epochs and trials each from 0."""
    return r.get("topology", "store"), r["epoch"]


def summarize(records: list[dict]) -> dict:
    # grouped by campaign (each numbers its trials from 0), so a fault's recovery is looked for in its own run
    records = sorted(records, key=lambda r: (r.get("topology", "store"), r["trial"]))
    # recovery: fault -> the next committed version of the same epoch (this one included)
    for i, r in enumerate(records):
        r["recovery_s"] = None
        for later in records[i:]:
            if _run_of(later) != _run_of(r) or (later is not r and later.get("epoch_start")):
                break
            if later.get("committed") and not later["violations"]:
                r["recovery_s"] = round(later["t_decided"] - r["t_go"], 3)
                break
    by_class = {}
    rows = [c for c in CLASSES] + [f"{c}@relay" for c in STORE_CLASSES] + [f"{c}@pipeline" for c in STORE_CLASSES]
    for row in rows:
        rs = [r for r in records if _row(r) == row]
        if rs:
            by_class[row] = _class_summary(rs)
    classes = {c: {"trials": b["trials"], "silent_corruptions": b["silent"]} for c, b in by_class.items()}
    relay_rs = [r for r in records if r["cls"] in RELAY_TREE_CLASSES]
    pipe_rs = [r for r in records if r.get("topology") == "pipeline"]
    return {
        "trials": len(records),
        # class -> {"trials", "silent_corruptions"} (the rest per class is in by_class)
        "classes": classes,
        "silent_corruptions": sum(1 for r in records if r["silent"]),
        "hangs": sum(1 for r in records if r["hang"]),
        "relay_trials": len(relay_rs),
        "relay_silent_corruptions": sum(1 for r in relay_rs if r["silent"]),
        "pipeline_trials": len(pipe_rs),
        "pipeline_silent_corruptions": sum(1 for r in pipe_rs if r["silent"]),
        # liveness checks that did not hold (pipelined epochs): not corruptions, counted apart
        "failures": [f"trial {r['trial']} ({r['cls']}): {x}" for r in records for x in r.get("failures", ())][:50],
        "violations": [f"trial {r['trial']} ({r['cls']}): {v}" for r in records for v in r["violations"]][:50],
        "epochs": len({_run_of(r) for r in records}),
        "wall_s": round(sum(r["duration_s"] for r in records), 1),
        "by_class": by_class,
    }


def _class_summary(rs: list[dict]) -> dict:
    rec_s = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
    out = {
        "trials": len(rs),
        "committed": sum(1 for r in rs if r.get("committed")),
        "aborted": sum(1 for r in rs if not r.get("committed")),
        "detected": sum(1 for r in rs if r["detected"]),
        "recovered": len(rec_s),
        "silent": sum(1 for r in rs if r["silent"]),
        "hangs": sum(1 for r in rs if r["hang"]),
        "unplanned_receiver_restarts": sum(r["unplanned_restarts"] for r in rs),
        "mean_recovery_s": round(float(np.mean(rec_s)), 3) if rec_s else None,
        "max_recovery_s": round(float(np.max(rec_s)), 3) if rec_s else None,
        "modes": _modes(rs),
    }
    if any("failures" in r for r in rs):
        out["failed"] = sum(1 for r in rs if r.get("failures"))
    if any("struck" in r for r in rs):  # liar trials whose relay told at least one lie
        out["struck"] = sum(1 for r in rs if r.get("struck"))
    if any(r.get("topology") == "pipeline" for r in rs):
        out["versions"] = sum(len(r.get("versions") or ()) for r in rs)
        out["mean_duration_s"] = round(float(np.mean([r["duration_s"] for r in rs])), 3)
        out["outcomes"] = _outcomes(rs)
    if any(r.get("topology") == "relay" for r in rs):
        # relay epochs: nodes that re-parented, relays that died unplanned, chunks served flipped
        out["reparented"] = sum(1 for r in rs if r.get("reparents"))
        out["receiver_reloads"] = sum(r["unplanned_restarts"] + r["planned_restarts"] for r in rs)
        out["relay_crashes"] = sum(len(r.get("relay_crashes") or ()) for r in rs)
        out["flipped_chunks"] = sum(r.get("flipped_chunks") or 0 for r in rs)
        out["mean_duration_s"] = round(float(np.mean([r["duration_s"] for r in rs])), 3)
    return out


def _outcomes(rs: list[dict]) -> dict:
    """What happened in the pipelined classes, counted: the killed version's fate and the
    resume, where a death was evicted, when a joiner was admitted, what a forgery was."""
    out: dict[str, int] = {}

    def add(k: str) -> None:
        out[k] = out.get(k, 0) + 1
    for r in rs:
        fate = r.get("fate")
        if fate:
            add(f"killed@{fate['at']}: decision={fate['decision']}, manifest={fate['manifest']}, "
                f"resume={fate.get('resume')}")
            if fate.get("receivers_tentative"):
                add("receivers held the killed version tentatively, then rolled it back")
        if r["cls"] == "receiver_dies":
            ev = r.get("evicted_at")
            add("evicted" if ev is not None else "not evicted")
            if ev is not None:
                add(f"evicted {ev - r['version']} versions after the death's")
        if r["cls"] == "receiver_joins_midversion":
            a = r.get("admitted_at")
            add(f"admitted {a - r['version']} versions after the start" if a is not None else "not admitted")
        if r["cls"] == "join_forged":
            add(f"{r.get('mode_used')}@{r['faults'][0]['at']} for a {r.get('who')} id")
        if r.get("redrawn_from"):
            add(f"redrawn from {r['redrawn_from']}")
    return dict(sorted(out.items()))


def _modes(rs: list[dict]) -> dict:
    out: dict[str, int] = {}
    for r in rs:
        for f in r["faults"]:
            m = f.get("mode") or f.get("point") or f.get("key_kind") or f["kind"]
            if "at" in f:
                m = f"{m}@{f['at']}"
            name = f"{f['kind']}:{f.get('obj', '') + ':' if 'obj' in f else ''}{m}@{f['target']}"
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def plot(summary: dict, records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(summary["by_class"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    x = np.arange(len(classes))
    w = 0.2
    for i, (k, lab) in enumerate([("trials", "trials"), ("detected", "detected"), ("recovered", "recovered"),
                                  ("silent", "silent corruptions")]):
        a.bar(x + (i - 1.5) * w, [summary["by_class"][c][k] for c in classes], w, label=lab)
    a.set_xticks(x, classes, rotation=40, ha="right")
    a.set_title(f"fault campaign: {summary['trials']} trials, {summary['silent_corruptions']} silent corruptions")
    a.legend()
    data = [[r["recovery_s"] for r in records if _row(r) == c and r["recovery_s"] is not None] or [0.0]
            for c in classes]
    b.boxplot(data)
    b.set_xticks(np.arange(1, len(classes) + 1), classes, rotation=40, ha="right")
    b.set_ylabel("fault -> next commit (s)")
    b.set_title("recovery time per fault class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _source(rs: list[dict]) -> dict:
    """What one results file holds (the summary may merge several)."""
    return {"trials": len(rs), "topology": sorted({r.get("topology", "store") for r in rs}),
            "ack_timeout_s": sorted({r["ack_timeout_s"] for r in rs if "ack_timeout_s" in r}),
            "wall_s": round(sum(r["duration_s"] for r in rs), 1),
            "silent_corruptions": sum(1 for r in rs if r["silent"]), "hangs": sum(1 for r in rs if r["hang"])}


def load_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by an interrupted run
                    pass
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=500, help="total trials (already recorded ones are skipped)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks/results/fault_campaign.jsonl"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/fault_campaign.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--schedule", choices=("random", "roundrobin", "list"), default="random",
                    help="random: classes drawn from (seed, trial) with WEIGHTS; roundrobin / list: "
                         "--classes in order (list: the order given, repeats allowed)")
    ap.add_argument("--classes", default="store",
                    help="comma list of classes; 'store' = the store classes (default), 'relay' = none + the "
                         "relay classes.  Any relay class makes every epoch a relay epoch (a relay tree between "
                         "the origin store and the receivers)")
    ap.add_argument("--merge", action="append", default=[],
                    help="another campaign's results (JSON lines) summarized with this one's, read only "
                         "(e.g. the store campaign's next to a relay campaign's); repeatable")
    ap.add_argument("--ack-timeout-s", type=float, default=3.0)
    ap.add_argument("--hop-timeout-s", type=float, default=2.0,
                    help="relay epochs: one attempt's timeout on every upstream but the origin (2 attempts)")
    ap.add_argument("--retry-after-s", type=float, default=None,
                    help="relay epochs: how long a node leaves a failed upstream before preferring it again "
                         f"(default {RETRY_AFTER_S:g} s; {LIAR_RETRY_AFTER_S:g} s when a liar class runs, see "
                         "LIAR_RETRY_AFTER_S)")
    ap.add_argument("--max-wall-s", type=float, default=None, help="stop starting trials after this long")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    classes = tuple(x for c in args.classes.split(",") if c for x in CLASS_GROUPS.get(c, (c,)))
    if args.retry_after_s is None:
        args.retry_after_s = LIAR_RETRY_AFTER_S if any(c in LIAR_CLASSES for c in classes) else RETRY_AFTER_S
    if args.schedule == "random":
        classes = tuple(dict.fromkeys(classes))
    for c in classes:
        if c not in CLASSES:
            ap.error(f"unknown class {c!r}")
    if any(c in PIPELINE_EPOCH_CLASSES for c in classes) \
            and not set(classes) <= set(PIPELINE_EPOCH_CLASSES + ("none",) + DRIVER_CLASSES):
        ap.error(f"pipelined classes run in pipelined epochs (the trainer resumes from checkpoints, membership is "
                 f"elastic): with them only none, {', '.join(DRIVER_CLASSES)} (got {args.classes})")
    if any(c in RELAY_TREE_CLASSES for c in classes) \
            and not set(classes) <= set(RELAY_TREE_CLASSES + RELAY_EPOCH_CLASSES + DRIVER_CLASSES):
        ap.error(f"relay classes run in relay epochs, whose receivers read the upstream list without the store "
                 f"injectors: with them only {', '.join(RELAY_EPOCH_CLASSES + DRIVER_CLASSES)} (got {args.classes})")
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    records = load_records(args.results)
    if not args.report_only:
        records = campaign(args, classes, records)
    merged = {path: load_records(path) for path in args.merge}
    everything = records + [r for rs in merged.values() for r in rs]
    summary = summarize(everything)
    summary.update({"seed": args.seed, "schedule": args.schedule, "ack_timeout_s": args.ack_timeout_s,
                    "command": "scripts/fault_campaign.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "sources": {os.path.relpath(p, ROOT): _source(rs) for p, rs in
                                [(args.results, records), *merged.items()]}})
    if any(c in RELAY_TREE_CLASSES for c in classes):
        summary.update(hop_timeout_s=args.hop_timeout_s, retry_after_s=args.retry_after_s)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, everything, args.plot or os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({k: summary[k] for k in ("trials", "silent_corruptions", "hangs", "epochs", "wall_s")}))
    for cls, c in summary["by_class"].items():
        print(f"  {cls:16s} trials {c['trials']:4d}  aborted {c['aborted']:4d}  detected {c['detected']:4d}  "
              f"recovered {c['recovered']:4d}  silent {c['silent']}  hangs {c['hangs']}  "
              f"mean/max recovery {c['mean_recovery_s']}/{c['max_recovery_s']} s"
              + (f"  re-parented {c['reparented']}  receiver reloads {c['receiver_reloads']}  "
                 f"relay crashes {c['relay_crashes']}" if "reparented" in c else ""))
    for v in summary["violations"][:20]:
        print("  VIOLATION", v)
    return 0 if summary["silent_corruptions"] == 0 and summary["hangs"] == 0 else 1


def campaign(args, classes: tuple[str, ...], records: list[dict]) -> list[dict]:
    import tempfile

    from nemo_dcr.protocol.signing import new_key_file

    done = {r["trial"] for r in records}
    todo = [t for t in range(args.trials) if t not in done]
    if not todo:
        return records
    work = args.work or tempfile.mkdtemp(prefix="dcr-campaign-")
    os.makedirs(work, exist_ok=True)
    key_file = os.path.join(work, f"key-{uuid.uuid4().hex[:6]}")
    new_key_file(key_file)
    os.environ["NEMO_DCR_KEY_FILE"] = key_file
    moto = Moto(os.path.join(work, "moto.log"))
    os.environ.update(moto.env)
    epoch_index = max((r["epoch"] for r in records), default=-1) + 1
    ep = None
    t_start = time.monotonic()
    try:
        with open(args.results, "a") as out:
            for t in todo:
                if args.max_wall_s and time.monotonic() - t_start > args.max_wall_s:
                    print(f"stopping after {time.monotonic() - t_start:.0f}s (--max-wall-s); resume to continue",
                          file=sys.stderr)
                    break
                new_epoch = ep is None
                if ep is None:
                    ep = Epoch(work, epoch_index, moto, key_file, args.ack_timeout_s, args.seed,
                               relays=any(c in RELAY_TREE_CLASSES for c in classes),
                               hop_timeout_s=args.hop_timeout_s, retry_after_s=args.retry_after_s,
                               pipeline=any(c in PIPELINE_EPOCH_CLASSES for c in classes),
                               elastic=any(c in ELASTIC_CLASSES for c in classes))
                    print(f"epoch {epoch_index}: trainer + receivers up in {ep.setup_s:.1f}s", file=sys.stderr)
                    epoch_index += 1
                cls = choose_class(args.seed, t, args.schedule, classes)
                plan = make_plan(args.seed, t, cls)
                if cls == "claim_race":
                    rec, end = run_claim_race(ep, plan, args.seed), False
                elif ep.pipeline:
                    rec, end = run_pipeline_trial(ep, plan, args.seed)
                elif cls in LIAR_BOUNDS:
                    rec, end = run_liar_trial(ep, moto, plan, args.seed)
                else:
                    rec, end = run_trial(ep, moto, plan, args.seed)
                rec["epoch_start"] = new_epoch
                out.write(json.dumps(rec) + "\n")
                out.flush()
                records.append(rec)
                print(f"trial {t:4d} {rec['cls']:16s} v{rec['version']:<4d} {'commit' if rec['committed'] else 'abort '} "
                      f"{rec['duration_s']:6.2f}s detected={int(rec['detected'])} "
                      f"{'VIOLATION ' + '; '.join(rec['violations']) if rec['violations'] else ''}"
                      f"{'FAILED ' + '; '.join(rec['failures']) if rec.get('failures') else ''}",
                      file=sys.stderr, flush=True)
                if end:
                    ep.close()
                    ep = None
    finally:
        if ep is not None:
            ep.close()
        moto.close()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return records


if __name__ == "__main__":
    sys.exit(main())
