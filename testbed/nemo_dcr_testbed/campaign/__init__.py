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
