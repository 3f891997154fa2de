"""What the sender reports and what travels between its ranks: named records, no tuples.

:class:`PublishStats` is one version's report (the hook's return value, totals on rank 0).
The others cross a rank or thread boundary once per version: :class:`Upload` (an upload
worker -> the background work), :class:`RankReport` (every rank -> rank 0),
:class:`Verdict` (rank 0 -> every rank), :class:`RankOutcome` (every rank -> every rank,
so that ``settle`` needs no collective), :class:`Claim` (rank 0 -> every rank, at start).
They are pickled between this job's own ranks (``collectives.py``): plain fields only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nemo_dcr.events import size_text
from nemo_dcr.protocol.manifest import ChunkRef


@dataclass
class PublishStats:
    version: int
    base_version: int
    changed: int = 0
    numel: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    chunks: int = 0
    diff_s: float = 0.0
    project_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    publish_s: float = 0.0
    commit_wait_s: float = 0.0
    reference_s: float = 0.0
    """Verification only: time to gather the dense reference (not part of a refit)."""
    committed: bool = False
    reason: str = ""
    """Why the version was aborted ('' when committed)."""
    acks: list[dict] = field(default_factory=list)
    members: tuple[str, ...] = ()
    """The receivers the decision covered (rank 0)."""
    joined: tuple[str, ...] = ()
    """Receivers admitted at this version (elastic membership; rank 0)."""
    evicted: tuple[str, ...] = ()
    """Receivers evicted at this version (elastic membership; rank 0)."""
    pause_s: float = 0.0
    """How long the call that published this version held the training loop: pipelined
    (``submit``), its settle of the previous version plus the diff and projection, the
    slowest rank's on rank 0; synchronous (``refit``), the whole refit, this rank's."""
    refit_s: float = 0.0
    """Wall time from the start of the diff to the decision, on this rank."""
    snapshot_s: float = 0.0
    """Gathering this committed version's snapshot (``refit.snapshot_every``), in the call
    that settled it (its upload runs in the background on rank 0); 0 when none was taken."""
    coding: str = ""
    """The coding this version's chunks used (``refit.coding``; under ``auto``, the choice)."""
    raw_bytes: int = 0
    """Raw record bytes (positions + values) handed to the encoder (totals on rank 0)."""
    encode_cpu_s: float = 0.0
    """CPU seconds of the encode calls, summed over chunks (totals over ranks on rank 0)."""
    puts: list[tuple[int, float]] = field(default_factory=list)
    """This rank's chunks as (wire bytes, put seconds), for ``refit.coding=auto``."""
    next_coding: str = ""
    """The coding decided for the next version (``auto``: rank 0's choice, on every rank)."""
    coding_walls: dict[str, float] = field(default_factory=dict)
    """``auto``, rank 0: every candidate's projected wall (s) behind ``next_coding`` ({}
    before anything was measured)."""
    requests: dict = field(default_factory=dict)
    """Store calls of this version (``transport/store/meter.py``: by ``op:kind``, with
    attempts, seconds and bytes): this rank's chunk puts; on rank 0 once decided, every
    rank's plus rank 0's manifest, ``HEAD.json``, ack polls and decision record."""


@dataclass(frozen=True)
class Upload:
    """One chunk encoded and put by an upload worker."""

    ref: ChunkRef
    encode_s: float
    """Wall seconds of the encode."""
    put_s: float
    """Wall seconds of the put."""
    encode_cpu_s: float
    """CPU seconds of the encode (the worker thread's: the coders run in it)."""


@dataclass(frozen=True)
class RankReport:
    """A rank's share of a version, gathered to rank 0 before the manifest."""

    refs: tuple[ChunkRef, ...]
    stats: PublishStats
    error: str | None
    """Why this rank's part failed (the version is then aborted on every rank); None: it did not."""


@dataclass(frozen=True)
class Verdict:
    """Rank 0's decision on a version, as every rank applies it."""

    commit: bool
    reason: str
    """Why the version was aborted ('' when committed)."""
    stop: bool
    """The refusal policy says training stops (``ReceiverRefused`` on every rank)."""
    digest: str
    """The decision record's digest ('' if none was written): the next version's base."""
    next_coding: str = ""
    """``refit.coding=auto``: the next version's coding ('' = unchanged)."""


@dataclass(frozen=True)
class RankOutcome:
    """What one rank applies for a version; ``settle`` checks that every rank's is the same."""

    version: int
    commit: bool
    digest: str
    failure: str
    """The background work failed on this rank ('' = it did not)."""
    next_coding: str

    def decision(self) -> tuple:
        """The fields every rank must agree on (all but ``failure``)."""
        return self.version, self.commit, self.digest, self.next_coding


@dataclass(frozen=True)
class Claim:
    """Rank 0's claim of the store (a new run, or the resumed one's position)."""

    run_id: str | None = None
    committed_version: int = 0
    committed_digest: str = ""
    floor: int = 0
    """The highest version number already in use."""
    error: str | None = None


def decided_line(stats: PublishStats, commit: bool, reason: str, seconds: float | None) -> str:
    """The trainer's one line per decided version (rank 0), e.g.
    ``nemo_dcr: v3 committed by r0,r1 in 1.2 s, 5.1 MB`` or
    ``nemo_dcr: v3 aborted: r1 refused (wrong model id) in 0.4 s, 5.1 MB``.

    ``seconds``: from the start of the manifest's publication to the decision record (None:
    not published); the bytes are the version's chunk bytes on the wire (every rank's).
    Refusals are named from the receivers' own acks; the rest of ``reason`` (a receiver
    without a valid ack, a failed trainer rank, too few members) follows as the coordinator
    wrote it."""
    took = "" if seconds is None else f" in {seconds:.1f} s"
    size = size_text(stats.wire_bytes)
    change = "".join(f"; {what} {','.join(rids)}" for what, rids in (("joined", stats.joined),
                                                                      ("evicted", stats.evicted)) if rids)
    if commit:
        members = ",".join(stats.members) or "no receiver"
        return f"nemo_dcr: v{stats.version} committed by {members}{took}, {size}{change}"
    refused, rest = [], reason
    for a in stats.acks:
        if not a.get("ok"):
            error = a.get("error") or "not ok"
            refused.append(f"{a.get('receiver')} refused ({error})")
            rest = rest.replace(f"{a.get('receiver')}: {error}", "", 1)
    rest = "; ".join(p.strip() for p in rest.split("; ") if p.strip())
    why = "; ".join([*refused, *([rest] if rest else [])]) or "no reason recorded"
    return f"nemo_dcr: v{stats.version} aborted: {why}{took}, {size}{change}"
