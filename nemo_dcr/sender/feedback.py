"""``refit.coding=auto`` between versions: each version's measurements into the chooser
(``coding_choice.py``), and the next version's coding out of it.

The coding in use is the same on every rank: rank 0 chooses, and the choice travels with
the decision (:class:`~nemo_dcr.sender.stats.Verdict`), applied when the decision is.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nemo_dcr.errors import ValidationError
from nemo_dcr.sender.chunker import Record
from nemo_dcr.sender.coding_choice import (
    AUTO,
    AUTO_START,
    CODING_SETTINGS,
    CodingChooser,
    VersionObservation,
    describe,
    encode_parallelism,
    probe,
)
from nemo_dcr.sender.collectives import log, rank
from nemo_dcr.sender.stats import PublishStats, RankReport


@dataclass(frozen=True)
class RankMeasure:
    """One rank's measurements of a version, as the chooser takes them (taken before rank
    0's stats become totals over ranks)."""

    raw_bytes: int
    encode_cpu_s: float
    upload_s: float
    wire_bytes: int
    puts: tuple[tuple[int, float], ...]
    """(wire bytes, put seconds) per chunk."""


def measures(reports: Sequence[RankReport]) -> list[RankMeasure]:
    return [RankMeasure(raw_bytes=rep.stats.raw_bytes, encode_cpu_s=rep.stats.encode_cpu_s,
                        upload_s=rep.stats.upload_s, wire_bytes=sum(r.nbytes for r in rep.refs),
                        puts=tuple(rep.stats.puts)) for rep in reports]


class CodingFeedback:
    """The coding of the next version; with ``auto``, rank 0's chooser and its probe."""

    def __init__(self, setting: str, upload_workers: int):
        self.setting, self.upload_workers = setting, upload_workers
        self.current = AUTO_START if setting == AUTO else setting
        self.chooser: CodingChooser | None = None
        self.probe_sample: list[Record] | None = None
        self._auto_next: str | None = None  # auto's choice while a fixed coding is switched in

    def switch(self, setting: str) -> None:
        """``refit.coding`` changed between versions (nothing in flight): a fixed coding codes
        the next version; ``auto`` resumes where it left off, with its last choice and its
        chooser's measurements (it observes only the versions it coded)."""
        if setting not in CODING_SETTINGS:
            raise ValidationError(f"refit.coding must be one of {', '.join(CODING_SETTINGS)}, got {setting!r}")
        if setting == self.setting:
            return
        if self.setting == AUTO:
            self._auto_next = self.current
        self.current = (self._auto_next or AUTO_START) if setting == AUTO else setting
        self.setting = setting

    def wants_sample(self) -> bool:
        """Rank 0, ``auto``: keep the next version's first chunk for the one-off probe."""
        return self.setting == AUTO and rank() == 0 and self.probe_sample is None and (
            self.chooser is None or self.chooser.needs_probe)

    def next_coding(self, stats: PublishStats, per_rank: Sequence[RankMeasure], *, errors: bool, t_start: float | None,
                    context_bases: Callable[[list[Record]], dict[str, np.ndarray]]) -> str:
        """Rank 0: fold this version's measurements (``per_rank``; the receivers' rates from
        the acks in ``stats``) into the chooser and pick the next version's coding.  Returns ''
        (unchanged) without ``auto``, and on any failure here, which is logged: the choice
        of a coding never fails a version."""
        if self.setting != AUTO:
            return ""
        current = stats.coding
        try:
            if self.chooser is None:
                local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's, for the cores per rank
                self.chooser = CodingChooser(encode_parallel=encode_parallelism(self.upload_workers, local_ranks))
            chooser = self.chooser
            if chooser.needs_probe and self.probe_sample:
                sample, self.probe_sample = self.probe_sample, None
                chooser.record_probe(probe([d for d, _ in sample], context_bases(sample)))
            if not errors:
                chooser.observe(self._observation(current, stats, per_rank, t_start))
            choice, projections = chooser.choose(current)
        except Exception as e:  # noqa: BLE001 - keep the coding in use
            log(f"nemo_dcr: coding after v{stats.version}: the choice failed, {current} kept: {type(e).__name__}: {e}")
            return ""
        stats.coding_walls = {c: p.wall_s for c, p in projections.items()}
        stats.next_coding = choice
        log(f"nemo_dcr: coding after v{stats.version} ({current}): next {describe(choice, projections)}")
        return choice

    def _observation(self, current: str, stats: PublishStats, per_rank: Sequence[RankMeasure],
                     t_start: float | None) -> VersionObservation:
        acks = [a.get("stats") or {} for a in stats.acks]
        decode = [float(a["decode_cpu_s"]) / max(1, int(a.get("decode_cores") or a.get("fetch_threads") or 1))
                  for a in acks if a.get("decode_cpu_s")]
        download = [float(a["download_s"]) for a in acks if a.get("download_s")]
        return VersionObservation(
            coding=current, raw_bytes=sum(m.raw_bytes for m in per_rank),
            raw_bytes_max_rank=max(m.raw_bytes for m in per_rank), encode_cpu_s=sum(m.encode_cpu_s for m in per_rank),
            upload_wall_s=max(m.upload_s for m in per_rank) / self.upload_workers,
            wire_bytes=sum(m.wire_bytes for m in per_rank), chunks=sum(len(m.puts) for m in per_rank),
            puts=tuple(p for m in per_rank for p in m.puts),
            rx_decode_s=max(decode, default=None), rx_download_s=max(download, default=None),
            wall_s=None if t_start is None else time.perf_counter() - t_start - stats.diff_s - stats.project_s)
