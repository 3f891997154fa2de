"""The campaign's summary: the rows per class, recovery times, outcomes and modes, the plot, and
the results files read back (one JSON line per trial)."""
from __future__ import annotations

import json
import os

import numpy as np

from .kinds import CLASSES, RELAY_TREE_CLASSES, STORE_CLASSES
from .records import CampaignSummary, ClassSummary, SourceSummary, TrialRecord


def _row(r: TrialRecord | dict) -> str:
    """The summary row of a record: its class; a store class run in a relay epoch (the
    "none" control of a relay campaign) is a row of its own, ``<class>@relay``."""
    if r["cls"] not in STORE_CLASSES:
        return r["cls"]
    if r.get("topology", "store") == "relay":
        return f"{r['cls']}@relay"
    if r.get("topology", "store") == "pipeline":
        return f"{r['cls']}@pipeline"
    return r["cls"]


def _run_of(r: TrialRecord | dict) -> tuple[str, int]:
    """The run (trainer epoch) a record belongs to: a store campaign and a relay campaign
    summarized together number their epochs and trials each from 0."""
    return r.get("topology", "store"), r["epoch"]


def summarize(records: list[TrialRecord]) -> CampaignSummary:
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
    return CampaignSummary.new(
        trials=len(records),
        # class -> {"trials", "silent_corruptions"} (the rest per class is in by_class)
        classes=classes,
        silent_corruptions=sum(1 for r in records if r["silent"]),
        hangs=sum(1 for r in records if r["hang"]),
        relay_trials=len(relay_rs),
        relay_silent_corruptions=sum(1 for r in relay_rs if r["silent"]),
        pipeline_trials=len(pipe_rs),
        pipeline_silent_corruptions=sum(1 for r in pipe_rs if r["silent"]),
        # liveness checks that did not hold (pipelined epochs): not corruptions, counted apart
        failures=[f"trial {r['trial']} ({r['cls']}): {x}" for r in records for x in r.get("failures", ())][:50],
        violations=[f"trial {r['trial']} ({r['cls']}): {v}" for r in records for v in r["violations"]][:50],
        epochs=len({_run_of(r) for r in records}),
        wall_s=round(sum(r["duration_s"] for r in records), 1),
        by_class=by_class,
    )


def _class_summary(rs: list[TrialRecord]) -> ClassSummary:
    rec_s = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
    out = ClassSummary.new(
        trials=len(rs),
        committed=sum(1 for r in rs if r.get("committed")),
        aborted=sum(1 for r in rs if not r.get("committed")),
        detected=sum(1 for r in rs if r["detected"]),
        recovered=len(rec_s),
        silent=sum(1 for r in rs if r["silent"]),
        hangs=sum(1 for r in rs if r["hang"]),
        unplanned_receiver_restarts=sum(r["unplanned_restarts"] for r in rs),
        mean_recovery_s=round(float(np.mean(rec_s)), 3) if rec_s else None,
        max_recovery_s=round(float(np.max(rec_s)), 3) if rec_s else None,
        modes=_modes(rs),
    )
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


def _outcomes(rs: list[TrialRecord]) -> dict:
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


def _modes(rs: list[TrialRecord]) -> dict:
    out: dict[str, int] = {}
    for r in rs:
        for f in r["faults"]:
            m = f.get("mode") or f.get("point") or f.get("key_kind") or f["kind"]
            if "at" in f:
                m = f"{m}@{f['at']}"
            name = f"{f['kind']}:{f.get('obj', '') + ':' if 'obj' in f else ''}{m}@{f['target']}"
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def plot(summary: CampaignSummary, records: list[TrialRecord], path: str) -> None:
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


def _source(rs: list[TrialRecord]) -> SourceSummary:
    """What one results file holds (the summary may merge several)."""
    return SourceSummary.new(trials=len(rs), topology=sorted({r.get("topology", "store") for r in rs}),
                             ack_timeout_s=sorted({r["ack_timeout_s"] for r in rs if "ack_timeout_s" in r}),
                             wall_s=round(sum(r["duration_s"] for r in rs), 1),
                             silent_corruptions=sum(1 for r in rs if r["silent"]),
                             hangs=sum(1 for r in rs if r["hang"]))


def load_records(path: str) -> list[TrialRecord]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(TrialRecord.from_json(json.loads(line)))
                except json.JSONDecodeError:  # a line cut by an interrupted run
                    pass
    return out
