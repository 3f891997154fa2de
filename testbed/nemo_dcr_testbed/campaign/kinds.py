"""The fault classes of the campaign and their plans: the class tuples and groups, the
weights of a random campaign, the bounds of the liar classes, the constants every class
draws from, and ``make_plan`` / ``choose_class`` (pure functions of the seed and trial)."""
from __future__ import annotations

import random

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
