"""The refit's settings: one schema, Hydra only at the edge.

:class:`RefitOptions` is the single source of every refit setting's name, type, default and
meaning (one docstring per field).  Everything else embeds it instead of restating it:

* :class:`~nemo_dcr.sender.RefitSender` takes the schema itself (``nemo_dcr/sender/options.py``;
  :meth:`RefitOptions.refit_options` copies every field of the schema out of a larger
  settings object, by its ``fields()``);
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

from dataclasses import asdict, dataclass

from nemo_dcr.configs import load_config
from nemo_dcr.sender.options import RefitOptions, RefitSetupError

__all__ = ["RefitFile", "RefitOptions", "RefitSettings", "RefitSetupError", "load_refit_settings"]


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
