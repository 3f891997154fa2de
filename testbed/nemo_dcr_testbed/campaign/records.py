"""Typed records of the campaign: what a trial produces (``TrialRecord``, one JSON line of
``--results``) and what the report makes of them (``ClassSummary``, ``SourceSummary``,
``CampaignSummary``: ``--out``, benchmarks/results/fault_campaign*.json).

Every field is declared with its type; a record holds only the fields set on it, in the
order they were first set, and ``to_json()`` gives exactly that (a field never set is not
in the JSON, as with the string-keyed dicts these replace, so the results files keep their
bytes: the same keys, in the same order).  Setting a field that is not declared is an
error.  A record also answers ``rec["x"]``, ``get``, ``setdefault``, ``pop`` and ``update``
by field name, which the trial code uses for the fields only some trials set, and the
report for records read back from results files of every age."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class _Unset:
    """A field not set on a record (not in its JSON)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class Record:
    """Base of the records: declared fields, kept in the order they were first set."""

    def __setattr__(self, name: str, value) -> None:
        if name not in self._names():
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        if value is UNSET:  # the dataclass __init__'s default: nothing set
            return
        self.__dict__.setdefault("_order", {})[name] = None
        object.__setattr__(self, name, value)

    @classmethod
    def _names(cls) -> frozenset[str]:
        names = cls.__dict__.get("_field_names")
        if names is None:
            names = frozenset(f.name for f in fields(cls))
            type.__setattr__(cls, "_field_names", names)
        return names

    @classmethod
    def new(cls, /, **values):
        """A record with ``values`` set in the order given."""
        rec = cls()
        rec.update(values)
        return rec

    @classmethod
    def from_json(cls, d: dict):
        return cls.new(**d)

    def to_json(self) -> dict:
        return {k: _json(self.__dict__[k]) for k in self.__dict__.get("_order", ())}

    # by name: the fields only some trials set, and records read back from any results file
    def __contains__(self, name: str) -> bool:
        return name in self.__dict__.get("_order", ())

    def __getitem__(self, name: str):
        if name not in self:
            raise KeyError(name)
        return self.__dict__[name]

    def __setitem__(self, name: str, value) -> None:
        setattr(self, name, value)

    def get(self, name: str, default=None):
        return self.__dict__[name] if name in self else default

    def setdefault(self, name: str, default=None):
        if name not in self:
            setattr(self, name, default)
        return self.__dict__[name]

    def pop(self, name: str, *default):
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        del self.__dict__["_order"][name]
        return self.__dict__.pop(name)

    def update(self, values: dict | None = None, **kw) -> None:
        for k, v in {**(values or {}), **kw}.items():
            setattr(self, k, v)


def _json(v):
    if isinstance(v, Record):
        return v.to_json()
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    return v


@dataclass(eq=False)
class TrialRecord(Record):
    """One trial (one JSON line of ``--results``).  The fields every trial sets come first;
    the rest are set by the classes (and epoch kinds) named beside them."""

    trial: int = UNSET
    seed: int = UNSET
    cls: str = UNSET
    faults: list[dict] = UNSET  # the plan's faults (kinds.make_plan)
    topology: str = UNSET  # "store", "relay" or "pipeline" (absent in the oldest files: "store")
    membership: str = UNSET  # pipelined epochs: "elastic" or "static"
    ack_timeout_s: float = UNSET
    epoch: int = UNSET
    version: int = UNSET  # the trial's (first) version
    base_version: int = UNSET  # the committed version it started from
    violations: list[str] = UNSET  # broken safety checks: silent corruptions unless a hang
    failures: list[str] = UNSET  # liveness checks that did not hold (pipelined, liar, driver classes)
    hang: bool = UNSET
    unplanned_restarts: int = UNSET
    planned_restarts: int = UNSET
    versions: list[dict] = UNSET  # a trial of several versions: one entry each
    t_go: float = UNSET
    committed: bool | None = UNSET  # claim_race: None until checked
    t_decided: float = UNSET
    detected: bool = UNSET
    # store and relay epochs (store_trials.run_trial)
    attack: str | None = UNSET
    relay_crashes: list[str] = UNSET
    healed: list[str] = UNSET
    decision_written: bool = UNSET
    reason: str = UNSET
    changed: int = UNSET
    chunks: int = UNSET
    lagging: list[str] = UNSET  # liveness trials: receivers only behind
    receivers: dict[str, dict] | None = UNSET  # receiver id -> its settled state
    crashes: list[str] = UNSET
    hang_logs: dict[str, str] = UNSET
    heal_wait_s: float = UNSET
    reparents: dict[str, int] = UNSET
    switches: dict[str, int] = UNSET
    flipped_chunks: int = UNSET
    receiver_ignored: int = UNSET
    receiver_refused: int = UNSET
    # liars, planted keys, claim race (relay_trials)
    planted: dict = UNSET
    bootstrap: dict = UNSET
    lies: int = UNSET
    struck: bool = UNSET
    relay_versions: dict = UNSET
    relay_confirmed: dict = UNSET
    claims: dict = UNSET
    # pipelined epochs (pipeline_trials)
    redrawn_from: str = UNSET
    fate: dict = UNSET  # trainer_kill_inflight: the killed version's fate and the resume
    resume: dict = UNSET
    t_kill: float = UNSET
    target: str = UNSET
    evicted_at: int = UNSET
    admitted_at: int = UNSET
    started_in_flight: bool = UNSET
    stall: dict = UNSET
    exit: dict = UNSET
    who: str = UNSET
    mode_used: str = UNSET
    end_epoch: bool = UNSET  # pipelined trials, popped before the record is written
    # every trial, at its end
    duration_s: float = UNSET
    silent: bool = UNSET
    epoch_start: bool = UNSET  # set by the campaign loop (cli.campaign)
    recovery_s: float | None = UNSET  # set by the report (summarize), never written to --results


@dataclass(eq=False)
class ClassSummary(Record):
    """One row of the summary's ``by_class``."""

    trials: int = UNSET
    committed: int = UNSET
    aborted: int = UNSET
    detected: int = UNSET
    recovered: int = UNSET
    silent: int = UNSET
    hangs: int = UNSET
    unplanned_receiver_restarts: int = UNSET
    mean_recovery_s: float | None = UNSET
    max_recovery_s: float | None = UNSET
    modes: dict[str, int] = UNSET
    failed: int = UNSET  # rows with liveness checks
    struck: int = UNSET  # liar rows
    versions: int = UNSET  # pipelined rows
    mean_duration_s: float = UNSET  # pipelined and relay rows
    outcomes: dict[str, int] = UNSET  # pipelined rows
    reparented: int = UNSET  # relay rows
    receiver_reloads: int = UNSET
    relay_crashes: int = UNSET
    flipped_chunks: int = UNSET


@dataclass(eq=False)
class SourceSummary(Record):
    """What one results file holds (the summary's ``sources``)."""

    trials: int = UNSET
    topology: list[str] = UNSET
    ack_timeout_s: list[float] = UNSET
    wall_s: float = UNSET
    silent_corruptions: int = UNSET
    hangs: int = UNSET


@dataclass(eq=False)
class CampaignSummary(Record):
    """The summary (``--out``): the counts, then how the campaign was run (cli.main)."""

    trials: int = UNSET
    classes: dict[str, dict] = UNSET  # class -> {"trials", "silent_corruptions"}
    silent_corruptions: int = UNSET
    hangs: int = UNSET
    relay_trials: int = UNSET
    relay_silent_corruptions: int = UNSET
    pipeline_trials: int = UNSET
    pipeline_silent_corruptions: int = UNSET
    failures: list[str] = UNSET
    violations: list[str] = UNSET
    epochs: int = UNSET
    wall_s: float = UNSET
    by_class: dict[str, ClassSummary] = UNSET
    seed: int = UNSET
    schedule: str = UNSET
    ack_timeout_s: float = UNSET
    command: str = UNSET
    sources: dict[str, SourceSummary] = UNSET
    hop_timeout_s: float = UNSET
    retry_after_s: float = UNSET
