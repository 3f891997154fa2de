"""Which coding a version's chunks use (``refit.coding``), and the ``auto`` chooser.

The candidates are one table, :data:`CODINGS` (name -> how the sender calls ``encode_chunk``);
adding a coding is one entry.  Every candidate writes ordinary v1 chunks: a receiver reads
the coding of each record from the chunk itself, so the choice is the trainer's alone and
the wire format and the protocol do not change with it.

``auto`` (:class:`CodingChooser`, run on rank 0 between versions) projects each candidate's
refit wall for the next version from measured rates and picks the smallest::

    encode_s   = R_rank / (enc_rate[c] x P)           slowest rank's raw bytes over its encoders
    upload_s   = U0 + W[c] x U1                       W[c] = R x ratio[c]: wire bytes
    download_s = D0 + W[c] x D1                       the slowest receiver's gets
    decode_s   = R / rx_rate[c]                       slowest receiver's decode wall
    fill_s     = (encode_s + upload_s + download_s + decode_s) / chunks
    wall[c]    = max(encode_s + upload_s, download_s + decode_s) + fill_s

Each of the trainer's upload threads encodes a chunk, then puts it; each of a receiver's
fetch threads gets a chunk, then decodes it (``receiver/fetch.py``): within a side the two
stages take turns on the same threads, so they add.  The two sides overlap (streaming
receive fetches chunks as they land), so a version takes about the slower side plus the
time one chunk needs to pass the other (``fill_s``: one chunk's share of every stage).  ``R`` is raw record bytes (positions +
values, what the diff hands the encoder) of the last version with changes, ``P`` the
encode threads per rank (``upload_workers``, capped by this rank's cores).  Where each
number comes from:

* a one-off *probe* on rank 0, at the first version with changes, encodes and decodes one
  sample chunk of that version with every candidate (CPU seconds of the calling thread):
  per coding, encode and decode rate per core and compressed size ratio;
* every version's real chunks correct the scale: the coding in use is measured (raw bytes /
  encode CPU seconds, wire / raw bytes over all ranks) and the ratio of real to probe
  carries over to the other codings (``enc_scale``, ``ratio_scale``: EWMA), so the probe
  only fixes how the codings compare;
* upload: the slowest rank's put time (summed over its puts, divided by its upload threads),
  split into a part per request ``U0`` and a part per wire byte ``U1`` by a least-squares line
  through the version's chunks' (bytes, put seconds) (:func:`latency_share`; an unshaped link
  to a local store is mostly per request, a slow link mostly per byte), EWMA;
* receivers, from their acks (``decode_cpu_s``, ``decode_cores``, ``download_s``): the
  slowest receiver's decode wall, expressed relative to the probe's local decode rate of
  the coding in use (``rx_scale``: EWMA), so other codings scale by their local decode
  speed, except that a coding the receivers have decoded is projected at its own measured
  scale (``rx_scale_of``: the probe's one sample chunk can rank the codings' decode speeds
  unlike the receivers do; issue 34's auto-coding run); and its download seconds: per byte
  ``D1`` what the trainer's puts cost per byte (``U1``; at most the whole download), the rest
  per request (``D0``).

**Measured correction.**  The model sees each stage's own rate, not what the stages cost each
other: where the trainer ranks, the receivers and the store share cores (a test bed on one
machine, receivers on the trainer's nodes), their CPU seconds add instead of overlapping,
and the model runs short of the walls measured.  So every version also measures its refit
wall (the first chunk handed to the encoder -> the last ack, less the rank's diff and
projection time, which no coding changes) and keeps, per coding, ``corr[c]`` = EWMA of measured
/ modelled wall of the versions coded ``c`` (clamped to ``[1/4, 4]``); a projection is the
model's wall x ``corr[c]``.  A coding not tried yet is projected by the model alone
(``corr = 1``): where the model runs short, the in-use coding's measured walls are higher than
what the others are projected at, so the others are tried, once each at most until one
of them measures better; after that each is compared at its own measured correction. The
first version a chooser observes corrects nothing: its wall carries one-off costs of both sides
(first connections, allocations, caches), and as ``auto`` observes only the versions it codes,
a coding judged on it was not tried again (issue 34's run of scripts/bench_coding_auto.py:
context's first version took 4.4 s, its later ones 2.2-2.8 s, and auto kept a 14-16% slower
coding at every link).

A term whose input is missing (no ack carried decode times) is left out of the max.  To
stop the choice from flapping between two codings whose projections are within noise, the
coding in use is kept unless another one is projected at least ``margin`` faster.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr.codec import Coding, TensorDelta, decode_chunk, encode_chunk
from nemo_dcr.configs.check import check_number
from nemo_dcr.errors import ValidationError


@dataclass(frozen=True, kw_only=True)
class CodingSpec:
    """How the sender encodes a chunk under one ``refit.coding`` value."""

    uses_base: bool
    """Code records against the committed base bits where this rank holds them (the codec's
    context mode); False: context-free."""
    codings: frozenset[Coding] | None
    """``encode_chunk``'s ``codings`` (the entropy codings tried per record; None: its
    default).  The raw codings are always candidates."""


CODINGS: dict[str, CodingSpec] = {
    "context": CodingSpec(uses_base=True, codings=None),
    "plain": CodingSpec(uses_base=False, codings=None),
    "fast": CodingSpec(uses_base=False, codings=frozenset({Coding.SPARSE_ZSTD})),
}
"""The fixed codings: ``context`` (the codec's default codings, conditioned on the base where
this rank holds it), ``plain`` (the same, context-free), ``fast`` (zstd over gaps and XOR
patterns: cheap to encode and decode, more bytes)."""

AUTO = "auto"
AUTO_START = "context"
"""The coding ``auto`` uses until it has measured something (the smallest bytes)."""
CODING_SETTINGS = (AUTO, *CODINGS)


def encode_with(name: str, deltas: Sequence[TensorDelta], *, meta: Mapping[str, str] | None,
                base: Mapping[str, np.ndarray] | None) -> bytes:
    """One chunk of ``deltas`` under coding ``name`` (``base`` is ignored by a context-free one)."""
    spec = CODINGS[name]
    return encode_chunk(deltas, meta=meta, base=(base or None) if spec.uses_base else None, codings=spec.codings)


@dataclass(frozen=True)
class ProbeResult:
    """One candidate on the probe's sample chunk."""

    raw_bytes: int
    wire_bytes: int
    encode_cpu_s: float
    decode_cpu_s: float

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.raw_bytes

    @property
    def encode_rate(self) -> float:
        """Raw bytes per CPU second."""
        return self.raw_bytes / max(self.encode_cpu_s, 1e-9)

    @property
    def decode_rate(self) -> float:
        return self.raw_bytes / max(self.decode_cpu_s, 1e-9)


def probe(deltas: Sequence[TensorDelta], base: Mapping[str, np.ndarray] | None,
          candidates: Sequence[str] = tuple(CODINGS)) -> dict[str, ProbeResult]:
    """Encode and decode one sample chunk with every candidate, in this thread (its CPU time:
    the coders run in the calling thread with the GIL released)."""
    raw = sum(d.nnz * (8 + d.values.itemsize) for d in deltas)
    out = {}
    for name in candidates:
        t0 = time.thread_time()
        blob = encode_with(name, deltas, meta=None, base=base)
        t1 = time.thread_time()
        decode_chunk(blob, base=(base or None) if CODINGS[name].uses_base else None)
        t2 = time.thread_time()
        out[name] = ProbeResult(raw_bytes=raw, wire_bytes=len(blob), encode_cpu_s=t1 - t0, decode_cpu_s=t2 - t1)
    return out


@dataclass(frozen=True, kw_only=True)
class VersionObservation:
    """What one version measured, for the chooser (rank 0 assembles it from every rank's
    stats and the receivers' acks)."""

    coding: str
    """The coding the version's chunks used."""
    raw_bytes: int
    """Raw record bytes encoded, over all ranks."""
    raw_bytes_max_rank: int
    """The same, the rank with the most."""
    wire_bytes: int
    """Chunk bytes put, over all ranks."""
    encode_cpu_s: float
    """CPU seconds of the encode calls, over all ranks."""
    upload_wall_s: float
    """The slowest rank's put seconds (summed over its puts) / its upload threads."""
    chunks: int
    puts: tuple[tuple[int, float], ...] = ()
    """Every chunk's (wire bytes, put seconds), all ranks: splits the put time into a part per
    request and a part per byte (:func:`latency_share`)."""
    rx_decode_s: float | None = None
    """The slowest receiver's decode wall (decode CPU seconds / its fetch threads)."""
    rx_download_s: float | None = None
    """The slowest receiver's download seconds (its ``download_s``)."""
    wall_s: float | None = None
    """The version's measured refit wall past its diff and projection (rank 0: the start of
    the version -> every ack in, less the slowest rank's diff + projection seconds)."""


@dataclass(frozen=True)
class Projection:
    """One candidate's projected refit stages and wall (seconds)."""

    coding: str
    encode_s: float
    upload_s: float
    download_s: float
    decode_s: float
    fill_s: float
    corr: float = 1.0
    """The measured correction of this coding (measured / modelled wall; 1: not measured)."""

    @property
    def model_wall_s(self) -> float:
        return max(self.encode_s + self.upload_s, self.download_s + self.decode_s) + self.fill_s

    @property
    def wall_s(self) -> float:
        return self.model_wall_s * self.corr


def latency_share(puts: Sequence[tuple[int, float]]) -> float:
    """The share of the put seconds that is per request, not per byte: a least-squares line
    ``seconds = a + bytes / bw`` through the chunks' ``(bytes, seconds)``, share = ``n a / sum
    seconds``, ``a`` clamped to ``[0, min seconds]``.  0 (all per byte) with fewer than 4 puts
    or sizes too alike to separate the two (they then cannot be told apart, and per byte is
    the conservative reading: it charges bigger codings more)."""
    if len(puts) < 4:
        return 0.0
    w = np.array([p[0] for p in puts], dtype=np.float64)
    t = np.array([p[1] for p in puts], dtype=np.float64)
    if t.sum() <= 0 or w.std() < 0.05 * w.mean():
        return 0.0
    slope, a = np.polyfit(w, t, 1)
    if slope <= 0:  # larger puts were not slower: nothing per byte can be seen
        a = t.mean()
    a = min(max(float(a), 0.0), float(t.min()))
    return a * len(t) / float(t.sum())


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class CodingChooser:
    """Rank 0's state for ``refit.coding=auto`` (see the module docstring for the model)."""

    encode_parallel: int
    """Encode threads per rank that run at once (``upload_workers`` capped by the cores)."""
    candidates: tuple[str, ...] = tuple(CODINGS)
    alpha: float = 0.5
    """EWMA weight of the newest version."""
    margin: float = 0.05
    """Switch only to a coding projected this much faster than the one in use."""
    probed: dict[str, ProbeResult] | None = None
    enc_scale: float | None = None
    ratio_scale: float | None = None
    upload_fixed_s: float | None = None
    """Upload wall of a version that does not depend on its bytes (the puts' per-request time)."""
    upload_s_per_byte: float | None = None
    """Upload wall per wire byte of the version (the rest of it)."""
    download_fixed_s: float | None = None
    download_s_per_byte: float | None = None
    rx_scale: float | None = None
    """The slowest receiver's decode rate (raw bytes per second of decode wall) / the probe's
    local decode rate of the coding it decoded."""
    rx_scale_of: dict[str, float] = field(default_factory=dict)
    """The same per coding, from that coding's own versions (EWMA)."""
    wall_corr: dict[str, float] = field(default_factory=dict)
    """Per coding, EWMA of its versions' measured / modelled wall (module docstring)."""
    corr_bounds: tuple[float, float] = (0.25, 4.0)
    last: VersionObservation | None = None
    """The newest version with changes (its sizes are the next version's projection)."""
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = [c for c in self.candidates if c not in CODINGS]
        if unknown or not self.candidates:
            raise ValidationError(f"candidates must be among {sorted(CODINGS)}, got {self.candidates}")
        check_number("encode_parallel", self.encode_parallel, min=1)

    @property
    def needs_probe(self) -> bool:
        return self.probed is None

    def record_probe(self, results: Mapping[str, ProbeResult]) -> None:
        missing = [c for c in self.candidates if c not in results]
        if missing:
            raise ValidationError(f"probe lacks {missing}")
        self.probed = {c: results[c] for c in self.candidates}

    def observe(self, obs: VersionObservation) -> None:
        """Fold one version's measurements in (a version without changes says nothing).  The
        first version observed corrects no coding's wall (module docstring)."""
        if obs.raw_bytes <= 0 or obs.wire_bytes <= 0:
            return
        first = self.last is None
        self.last = obs
        a = self.alpha
        share = latency_share(obs.puts)
        up_per_byte = (1 - share) * obs.upload_wall_s / obs.wire_bytes
        if obs.upload_wall_s > 0:
            self.upload_fixed_s = _ewma(self.upload_fixed_s, share * obs.upload_wall_s, a)
            self.upload_s_per_byte = _ewma(self.upload_s_per_byte, up_per_byte, a)
        if obs.rx_download_s:
            # the receiver reads the store the trainer wrote: its gets cost per byte what the
            # trainer's puts did (no more than its whole download); the rest is per request
            per_byte = obs.rx_download_s / obs.wire_bytes
            if obs.upload_wall_s > 0:
                per_byte = min(per_byte, up_per_byte)
            self.download_fixed_s = _ewma(self.download_fixed_s, obs.rx_download_s - per_byte * obs.wire_bytes, a)
            self.download_s_per_byte = _ewma(self.download_s_per_byte, per_byte, a)
        p = (self.probed or {}).get(obs.coding)
        if p is None:
            return
        if obs.encode_cpu_s > 0:
            self.enc_scale = _ewma(self.enc_scale, (obs.raw_bytes / obs.encode_cpu_s) / p.encode_rate, a)
        self.ratio_scale = _ewma(self.ratio_scale, (obs.wire_bytes / obs.raw_bytes) / p.ratio, a)
        if obs.rx_decode_s:
            scale = (obs.raw_bytes / obs.rx_decode_s) / p.decode_rate
            self.rx_scale = _ewma(self.rx_scale, scale, a)
            self.rx_scale_of[obs.coding] = _ewma(self.rx_scale_of.get(obs.coding), scale, a)
        if obs.wall_s and obs.wall_s > 0 and not first:
            model = self.project(obs.coding).model_wall_s  # at the rates just folded in
            if model > 0:
                lo, hi = self.corr_bounds
                c = _ewma(self.wall_corr.get(obs.coding), obs.wall_s / model, a)
                self.wall_corr[obs.coding] = min(max(c, lo), hi)

    def project(self, coding: str) -> Projection:
        """``coding``'s projected stages for a version the size of the last one (needs the probe
        and one observed version)."""
        p, obs = self.probed[coding], self.last
        enc = obs.raw_bytes_max_rank / (p.encode_rate * (self.enc_scale or 1.0) * self.encode_parallel)
        wire = obs.raw_bytes * p.ratio * (self.ratio_scale or 1.0)
        up = (self.upload_fixed_s or 0.0) + wire * (self.upload_s_per_byte or 0.0)
        down = (self.download_fixed_s or 0.0) + wire * (self.download_s_per_byte or 0.0)
        rx = self.rx_scale_of.get(coding, self.rx_scale)
        dec = obs.raw_bytes / (p.decode_rate * rx) if rx else 0.0
        fill = (enc + up + down + dec) / max(1, obs.chunks)
        return Projection(coding, enc, up, down, dec, fill, self.wall_corr.get(coding, 1.0))

    def choose(self, current: str) -> tuple[str, dict[str, Projection]]:
        """The coding for the next version and every candidate's projection ({} while the
        chooser has not measured enough: then ``current`` stays)."""
        if self.probed is None or self.last is None:
            return current, {}
        proj = {c: self.project(c) for c in self.candidates}
        best = min(self.candidates, key=lambda c: proj[c].wall_s)
        if current in proj and proj[current].wall_s <= (1 + self.margin) * proj[best].wall_s:
            best = current
        return best, proj


def describe(choice: str, projections: Mapping[str, Projection]) -> str:
    """One log line: the choice and every candidate's projected wall, with the side that
    bounds it and that side's two stages."""
    if not projections:
        return f"coding {choice} (not measured yet)"
    parts = []
    for c, p in projections.items():
        if p.encode_s + p.upload_s >= p.download_s + p.decode_s:
            side = f"trainer: encode {p.encode_s:.3f} + upload {p.upload_s:.3f}"
        else:
            side = f"receivers: download {p.download_s:.3f} + decode {p.decode_s:.3f}"
        corr = f", measured x{p.corr:.2f}" if p.corr != 1.0 else ""
        parts.append(f"{c} {p.wall_s:.3f}s ({side}{corr})")
    return f"coding {choice}: projected " + ", ".join(parts)


def encode_parallelism(upload_workers: int, local_ranks: int) -> int:
    """Encode threads of one rank that run at once: its upload threads, capped by its share of
    the cores this process may use."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(upload_workers, math.floor(cores / max(1, local_ranks))))
