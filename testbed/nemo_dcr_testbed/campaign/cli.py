"""The campaign's command line (``scripts/fault_campaign.py``): the flags, the epochs and trials
run, the summary written and printed."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid

from . import __doc__ as DESCRIPTION
from .epoch import Epoch
from .kinds import (CLASSES, CLASS_GROUPS, DRIVER_CLASSES, ELASTIC_CLASSES, LIAR_BOUNDS, LIAR_CLASSES,
    LIAR_RETRY_AFTER_S, PIPELINE_EPOCH_CLASSES, RELAY_EPOCH_CLASSES, RELAY_TREE_CLASSES, RETRY_AFTER_S, choose_class,
    make_plan)
from .pipeline_trials import run_pipeline_trial
from .procs import Moto, ROOT
from .records import TrialRecord
from .relay_trials import run_claim_race, run_liar_trial
from .report import _source, load_records, plot, summarize
from .store_trials import run_trial


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        json.dump(summary.to_json(), f, indent=1)
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


def campaign(args, classes: tuple[str, ...], records: list[TrialRecord]) -> list[TrialRecord]:
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
    saved_env = dict(os.environ)  # restored at the end: tests run the campaign in their own process
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
                rec.epoch_start = new_epoch
                out.write(json.dumps(rec.to_json()) + "\n")
                out.flush()
                records.append(rec)
                print(f"trial {t:4d} {rec.cls:16s} v{rec.version:<4d} {'commit' if rec.committed else 'abort '} "
                      f"{rec.duration_s:6.2f}s detected={int(rec.detected)} "
                      f"{'VIOLATION ' + '; '.join(rec.violations) if rec.violations else ''}"
                      f"{'FAILED ' + '; '.join(rec.failures) if rec.get('failures') else ''}",
                      file=sys.stderr, flush=True)
                if end:
                    ep.close()
                    ep = None
    finally:
        if ep is not None:
            ep.close()
        moto.close()
        os.environ.clear()
        os.environ.update(saved_env)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return records
