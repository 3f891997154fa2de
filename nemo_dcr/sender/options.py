"""The refit schema, :class:`RefitOptions`: every setting of the sender and its joint commit.

It is the single source of each setting's name, type, default and meaning (one docstring per
field); everything else embeds it instead of restating it: the sender takes it as it is,
``integrations/settings.py``'s :class:`~nemo_dcr.integrations.settings.RefitSettings` adds
what attaching to a training loop needs, and the README's table is checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from nemo_dcr.configs import ConfigError, check_field_types, check_number
from nemo_dcr.errors import ValidationError
from nemo_dcr.sender.coding_choice import CODING_SETTINGS


MEMBERSHIPS = ("static", "elastic")
ELASTIC_SNAPSHOT_EVERY = 20
"""``refit.snapshot_every`` when not set, under elastic membership (receivers join mid-run)."""


class RefitSetupError(ValidationError):
    """The refit cannot start (bad settings, unreachable store, unmappable model)."""


@dataclass(kw_only=True, frozen=True)
class RefitOptions:
    """Every setting of the refit itself (the sender and its joint commit): the schema."""

    model_id: str
    """Lineage name carried by manifests and chunks; receivers refuse another model's."""
    receivers: tuple[str, ...]
    """Receiver ids whose acknowledgement a joint commit waits for (at least one)."""
    chunk_bytes: int = 4 << 20
    """Upper bound on a chunk's raw records (8-byte positions + values) before coding;
    larger tensors are split into several records, so chunks stream at this granularity."""
    upload_workers: int = 8
    """Threads encoding and uploading chunks while later parameters are diffed.  A put mostly
    waits on the store (a round trip per chunk over a distant link; the coders release the
    GIL), so this is not bounded by the cores: with 2 per rank the link benchmark's trainer
    kept two puts in flight and took twice the link's time per byte (docs/benchmarks.md,
    issue 32).  Encoding runs on at most the rank's cores whatever this says."""
    coding: str = "auto"
    """How chunks are coded (docs/design.md, "Choosing the coding per version"): ``context``, the codec's
    default codings in context mode (conditioned on the committed base bits, which receivers
    hold) wherever the trainer rank holds the base of the record's whole canonical range
    (row-parallel shards, whose coverage is strided, stay context-free); ``plain``, the same
    codings context-free; ``fast``, zstd only (cheap to encode and decode, more bytes);
    ``auto``, per version the one projected fastest from measured encode, upload and receiver
    decode rates (rank 0 decides, every rank uses it; starts as ``context``)."""
    ack_timeout_s: float = 300.0
    """How long rank 0 waits for every receiver's acknowledgement of a version."""
    ack_poll_s: float = 0.05
    """Interval between rank 0's checks for acknowledgements."""
    key_file: str = ""
    """File holding the run's shared signing key (hex, from ``nemo-dcr keygen``); '' =
    ``$NEMO_DCR_KEY_FILE``; with neither, nothing is authenticated (docs/protocol.md)."""
    on_refusal: str = "retry"
    """A version some receiver did not acknowledge is aborted: ``retry`` keeps training
    (the next version is diffed against the same base), ``fail`` stops training."""
    max_consecutive_failures: int = 3
    """With ``on_refusal=retry``: stop training after this many aborted versions in a row."""
    pipeline: bool = True
    """Pipelined refit: the hook returns once this rank has diffed and projected the step
    (the changes staged); encode, upload, manifest, acks and the decision run in the
    background and the decision is applied at the next hook call (which waits only if it is
    not there yet), or at ``finish()``.  ``false``: the hook returns after the decision."""
    pipeline_max_staged_bytes: int = 1 << 30
    """Pipelined refit: records diffed but not yet encoded are capped at this many raw bytes
    per rank; past it the hook waits for the encoder (the pause grows, memory does not)."""
    membership: str = "static"
    """``static``: the receivers are ``receivers``, fixed for the run.  ``elastic``: they start
    as ``receivers``; others join with a signed join request and are admitted at the next
    version; a member missing ``evict_after`` acks in a row is evicted (docs/protocol.md)."""
    min_receivers: int = 1
    """Elastic membership: a version commits only with at least this many members acking it."""
    evict_after: int = 3
    """Elastic membership: evict a member after this many consecutive versions without its ack."""
    snapshot_every: int | None = None
    """Every committed version that is a multiple of this, the trainer also writes that
    version's dense canonical state to ``snapshots/`` (docs/protocol.md, "Committed-version snapshots"; in the
    background on rank 0; the newest 2 are kept), so a receiver joining later loads it instead
    of version 0 and replaying every version since.  None: 20 with ``membership=elastic``, 0
    with ``static``; 0: off."""

    def __post_init__(self) -> None:
        from nemo_dcr.protocol.commit import FailureBudget

        try:
            check_field_types(self, "refit")
        except ConfigError as e:  # ConfigTypeError
            raise RefitSetupError(str(e)) from None
        if not self.receivers:
            raise RefitSetupError("refit.receivers is empty: a joint commit needs at least one receiver")
        if self.coding not in CODING_SETTINGS:
            raise RefitSetupError(f"refit.coding must be one of {CODING_SETTINGS}, got {self.coding!r}")
        if self.membership not in MEMBERSHIPS:
            raise RefitSetupError(f"refit.membership must be one of {MEMBERSHIPS}, got {self.membership!r}")
        if self.min_receivers > len(self.receivers) and self.membership == "static":
            raise RefitSetupError(f"refit.min_receivers={self.min_receivers} exceeds the {len(self.receivers)} static "
                                  "receivers")
        for name, kind in (("chunk_bytes", int), ("upload_workers", int), ("ack_timeout_s", float),
                           ("ack_poll_s", float), ("pipeline_max_staged_bytes", int), ("min_receivers", int),
                           ("evict_after", int)):
            try:
                check_number(f"refit.{name}", getattr(self, name), kind=kind, positive=True)
            except ConfigError as e:
                raise RefitSetupError(str(e)) from None
        try:
            FailureBudget(self.on_refusal, self.max_consecutive_failures)  # validates both
        except ValidationError as e:
            raise RefitSetupError(f"refit.{e}") from None
        try:
            check_number("refit.snapshot_every", self.snapshot_every, min=0, allow_none=True)
        except ConfigError:
            raise RefitSetupError(f"refit.snapshot_every must be an int >= 0 (0 = off) or null (20 with elastic "
                                  f"membership, else off), got {self.snapshot_every!r}") from None
        if self.membership == "elastic":
            budget = 1 if self.on_refusal == "fail" else self.max_consecutive_failures
            if self.evict_after > budget:
                raise RefitSetupError(
                    f"refit.evict_after={self.evict_after} exceeds the aborted versions training survives "
                    f"(refit.on_refusal={self.on_refusal}, refit.max_consecutive_failures="
                    f"{self.max_consecutive_failures}): training would stop before a silent member is evicted")

    @property
    def snapshot_interval(self) -> int:
        """``snapshot_every`` resolved: 0 = no snapshots."""
        if self.snapshot_every is None:
            return ELASTIC_SNAPSHOT_EVERY if self.membership == "elastic" else 0
        return self.snapshot_every

    def refit_options(self) -> RefitOptions:
        """The schema's fields of this (possibly larger) settings object, as the sender takes
        them: every field of :class:`RefitOptions`, none named by hand."""
        return RefitOptions(**{f.name: getattr(self, f.name) for f in fields(RefitOptions)})
