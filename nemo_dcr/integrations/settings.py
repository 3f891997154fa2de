"""The refit's settings: one schema, Hydra only at the edge.

:class:`RefitOptions` is the single source of every refit setting's name, type, default and
meaning (one docstring per field).  Everything else embeds it instead of restating it:

* :class:`~nemo_dcr.integrations.sender.SenderConfig` is the schema as the sender takes it
  (:meth:`RefitOptions.sender_config` copies every field of the schema, by its ``fields()``);
* :class:`RefitSettings` adds what attaching to someone else's training loop (NeMo recipe,
  Megatron-Bridge, a plain megatron-core loop) needs: the store, the model mapping, the
  cadence and the resume point;
* the demo's ``refit`` section (``RefitConfig`` in the test bed's ``config.py``) adds its test-bed
  aids.

``load_refit_settings(overrides)`` composes the packaged ``nemo_dcr/configs/refit.yaml``
with Hydra's override grammar (``refit.store_uri=s3://bucket/run``,
``refit.receivers=[r0,r1]``) through the one strict loader (``nemo_dcr.configs``): unknown
keys, wrong types and bad values are a :class:`RefitSetupError` with one line of text.  A
recipe keeps its own override syntax for everything else.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from nemo_dcr.configs import check_field_types, load_config
from nemo_dcr.integrations.coding_choice import CODING_SETTINGS
from nemo_dcr.errors import ValidationError

if TYPE_CHECKING:
    from nemo_dcr.integrations.sender import SenderConfig


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
    upload_workers: int = 2
    """Threads encoding and uploading chunks while later parameters are diffed."""
    coding: str = "auto"
    """How chunks are coded (``integrations/coding_choice.py``): ``context``, the codec's
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
    version's dense canonical state to ``snapshots/`` (``protocol/snapshot.py``, in the
    background on rank 0; the newest 2 are kept), so a receiver joining later loads it instead
    of version 0 and replaying every version since.  None: 20 with ``membership=elastic``, 0
    with ``static``; 0: off."""

    def __post_init__(self) -> None:
        from nemo_dcr.protocol.commit import FailureBudget

        try:
            check_field_types(self, "refit")
        except TypeError as e:
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
        for name in ("chunk_bytes", "upload_workers", "ack_timeout_s", "ack_poll_s", "pipeline_max_staged_bytes",
                     "min_receivers", "evict_after"):
            if getattr(self, name) <= 0:
                raise RefitSetupError(f"refit.{name} must be positive, got {getattr(self, name)}")
        try:
            FailureBudget(self.on_refusal, self.max_consecutive_failures)  # validates both
        except ValueError as e:
            raise RefitSetupError(f"refit.{e}") from None
        if self.snapshot_every is not None and (isinstance(self.snapshot_every, bool)
                                                or not isinstance(self.snapshot_every, int)
                                                or self.snapshot_every < 0):
            raise RefitSetupError(f"refit.snapshot_every must be an int >= 0 (0 = off) or null (20 with elastic "
                                  f"membership, else off), got {self.snapshot_every!r}")
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

    def sender_config(self) -> SenderConfig:
        """The schema's fields of this (possibly larger) settings object, as the sender's
        config: every field of :class:`RefitOptions`, none named by hand."""
        from nemo_dcr.integrations.sender import SenderConfig

        return SenderConfig(**{f.name: getattr(self, f.name) for f in fields(RefitOptions)})


@dataclass(kw_only=True, frozen=True)
class RefitSettings(RefitOptions):
    """The refit schema plus what attaching to a training loop adds."""

    store_uri: str
    """Where versions go: a directory (the embedded default) or an fsspec URI (``s3://...``)."""
    vocab_size: int = 0
    """The tokenizer's vocabulary (Megatron pads its embedding); 0 = the padded size."""
    family: str = ""
    """Layout family (``llama``, ``qwen3``, ``qwen3_moe``); '' = chosen from the model."""
    export_initial: bool = True
    """Start a new run when the refit attaches: claim the store and write version 0 (the
    initial HF checkpoint).  Ignored when the trainer's checkpoint restored the refit's run
    state (the framework callbacks save it with the model): that run continues."""
    every_n_steps: int = 1
    """Publish a version after every n-th optimizer step."""
    resume_run_id: str = ""
    """With ``export_initial=false``, for a loop whose checkpoint does not carry the refit's
    run state: the run (``RUN.json`` on the store) to continue.  With a restored run state it
    must name the same run."""
    resume_version: int = -1
    """With ``resume_run_id``: the committed version the trainer's weights hold (the step of
    the checkpoint it restarted from); checked against the store's signed decisions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.store_uri:
            raise RefitSetupError("refit.store_uri is empty")
        if self.every_n_steps < 1:
            raise RefitSetupError(f"refit.every_n_steps must be >= 1, got {self.every_n_steps}")
        if self.resume_run_id and self.resume_version < 0:
            raise RefitSetupError("refit.resume_run_id needs refit.resume_version (the committed version the "
                                  "trainer's weights hold)")
        if self.resume_version >= 0 and not self.resume_run_id:
            raise RefitSetupError("refit.resume_version needs refit.resume_run_id")
        if self.vocab_size < 0:
            raise RefitSetupError(f"refit.vocab_size must be >= 0, got {self.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class RefitFile:
    """The root of ``refit.yaml``: its ``refit:`` node."""

    refit: RefitSettings


def load_refit_settings(overrides: list[str], *, config_dir: str | None = None,
                        config_name: str = "refit") -> RefitSettings:
    """``<config_dir>/<config_name>.yaml``'s ``refit:`` node (by default the packaged
    ``refit.yaml``) with Hydra overrides, validated."""
    return load_config(RefitFile, config_name, overrides, config_dir=config_dir, error=RefitSetupError).refit
