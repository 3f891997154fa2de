"""Settings of a refit attached to someone else's training loop (NeMo recipe, Megatron-Bridge,
a plain megatron-core loop): keyword-only dataclass = schema, Hydra only at the edge.

``load_refit_settings(overrides)`` composes ``configs/refit.yaml`` with Hydra's override
grammar (``refit.store_uri=s3://bucket/run``, ``refit.receivers=[r0,r1]``); unknown keys
and wrong types are errors.  A recipe keeps its own override syntax for everything else.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from nemo_dcr.integrations.sender import SenderConfig
from nemo_dcr.errors import ValidationError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


class RefitSetupError(ValidationError):
    """The refit cannot start (bad settings, unreachable store, unmappable model)."""


@dataclass(kw_only=True, frozen=True)
class RefitSettings:
    store_uri: str
    """Where versions go: a directory (the embedded default) or an fsspec URI (``s3://...``)."""
    model_id: str
    """Lineage name carried by manifests and chunks; receivers refuse another model's."""
    receivers: tuple[str, ...]
    """Receiver ids whose acknowledgement the joint commit waits for (at least one)."""
    chunk_bytes: int = 4 << 20
    """Upper bound on a chunk's raw records before coding (chunks stream at this size)."""
    upload_workers: int = 2
    """Encode/upload threads per trainer rank."""
    context: bool = True
    """Context-mode coding (conditioned on the base bits receivers hold)."""
    ack_timeout_s: float = 300.0
    """How long rank 0 waits for every receiver's acknowledgement of a version."""
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
    key_file: str = ""
    """File holding the run's shared signing key (hex, from ``nemo-dcr keygen``); '' =
    ``$NEMO_DCR_KEY_FILE``; with neither, nothing is authenticated (docs/protocol.md)."""
    on_refusal: str = "retry"
    """A version some receiver did not acknowledge is aborted: ``retry`` keeps training
    (the next version is diffed against the same base), ``fail`` stops training."""
    max_consecutive_failures: int = 3
    """With ``on_refusal=retry``: stop after this many aborted versions in a row."""
    resume_run_id: str = ""
    """With ``export_initial=false``, for a loop whose checkpoint does not carry the refit's
    run state: the run (``RUN.json`` on the store) to continue.  With a restored run state it
    must name the same run."""
    resume_version: int = -1
    """With ``resume_run_id``: the committed version the trainer's weights hold (the step of
    the checkpoint it restarted from); checked against the store's signed decisions."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "receivers", tuple(self.receivers))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise RefitSetupError(f"refit.{f.name} must be an int, got {v!r}")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise RefitSetupError(f"refit.{f.name} must be true or false, got {v!r}")
        if not self.store_uri:
            raise RefitSetupError("refit.store_uri is empty")
        if not self.receivers:
            raise RefitSetupError("refit.receivers is empty: a joint commit needs at least one receiver")
        if self.every_n_steps < 1:
            raise RefitSetupError(f"refit.every_n_steps must be >= 1, got {self.every_n_steps}")
        try:  # the sender's own bounds (chunk_bytes, upload_workers, ack_timeout_s)
            self.sender_config()
        except ValueError as e:
            raise RefitSetupError(f"refit: {e}") from None
        if self.resume_run_id and self.resume_version < 0:
            raise RefitSetupError("refit.resume_run_id needs refit.resume_version (the committed version the "
                                  "trainer's weights hold)")
        if self.resume_version >= 0 and not self.resume_run_id:
            raise RefitSetupError("refit.resume_version needs refit.resume_run_id")
        if self.vocab_size < 0:
            raise RefitSetupError(f"refit.vocab_size must be >= 0, got {self.vocab_size}")

    def sender_config(self) -> SenderConfig:
        return SenderConfig(model_id=self.model_id, receivers=self.receivers, chunk_bytes=self.chunk_bytes,
                            upload_workers=self.upload_workers, ack_timeout_s=self.ack_timeout_s,
                            context=self.context, key_file=self.key_file, on_refusal=self.on_refusal,
                            max_consecutive_failures=self.max_consecutive_failures)

    def to_dict(self) -> dict:
        return asdict(self)


SCHEMA_NAME = "nemo_dcr_refit_schema"


def load_refit_settings(overrides: list[str], *, config_dir: str = CONFIG_DIR,
                        config_name: str = "refit") -> RefitSettings:
    """Compose ``<config_dir>/<config_name>.yaml`` (its ``refit:`` node) with Hydra overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    @dataclass
    class _Schema:  # Hydra wants a mutable structured node; validation is RefitSettings'
        refit: dict

    ConfigStore.instance().store(name=SCHEMA_NAME, node=_Schema(refit={}))
    try:
        with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
            composed = compose(config_name=config_name, overrides=list(overrides))
        raw = OmegaConf.to_container(composed, resolve=True)["refit"]
    except (HydraException, OmegaConfBaseException) as e:
        raise RefitSetupError(" ".join(str(e).split())) from None
    unknown = sorted(set(raw) - {f.name for f in fields(RefitSettings)})
    if unknown:
        raise RefitSetupError(f"unknown refit settings {unknown}")
    try:
        return RefitSettings(**raw)
    except TypeError as e:
        raise RefitSetupError(str(e)) from None
