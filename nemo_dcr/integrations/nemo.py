"""NeMo 2 / Lightning callback: a refit after every optimizer step of a NeMo recipe.

    recipe.trainer.callbacks.append(run.Config(RefitCallback, overrides=["refit.store_uri=s3://b/run"]))

``RefitCallback`` subclasses NeMo's ``BaseCallback`` when NeMo is installed (Lightning's
``Callback`` when only Lightning is), and is importable without either.  Lightning calls
``on_train_batch_end`` once per optimizer step, after the BF16 params were written (the
distributed optimizer's deferred all-gather, if any, is forced by the hook).  The model
is NeMo's ``trainer.strategy.megatron_parallel``: one NeMo model per virtual pipeline stage,
each leading along ``.module`` (NeMo DDP -> Float16Module) to a megatron-core ``GPTModel``
chunk; without a NeMo strategy (plain Lightning), ``pl_module`` itself.  The version number
is ``trainer.global_step``, which Lightning has already incremented for the step just taken
when ``on_train_batch_end`` fires: version v is the model after v optimizer steps, the same
rule as the Bridge callback (``tests/nemo`` checks versions 1..N after N steps).  Lightning
does not tell callbacks that an optimizer skipped its update (fp16 overflow) and still counts
the step, so such a step publishes a version with an empty delta.  With gradient accumulation
the batches between optimizer steps see the same ``global_step`` and publish nothing.  The refit's run state is the callback's ``state_dict``, so it
is saved and restored with the training checkpoint and a resumed job continues its run.

The refit is pipelined by default (``refit.pipeline``): ``on_train_batch_end`` returns once
step v is diffed, and version v is decided at the next step's call (or, for the last version,
in ``on_train_end``, which drains the refit: a collective, on every rank, as Lightning calls
it).  A job that ends in an exception never reaches ``on_train_end``, so the version in flight
is not drained there (nothing collective runs from ``on_exception``, where the other ranks may
not be).

Metrics: every decided version's ``RefitMetrics.scalars()`` (``refit/version``, ``committed``,
``committed_version``, ``wire_bytes``, ``compression``, ``changed_pct``, ``receivers``,
``joined``, ``evicted``, ``refit_seconds``, ``trainer_pause_seconds``) go to each of
``trainer.loggers`` (the recipe's TensorBoard, W&B, CSV ...) through ``log_metrics(scalars,
step=v)`` and ``save()``, on global rank 0 only, in the call that decided the version.  Not
``LightningModule.log_dict``, for three reasons: Lightning 2.4 forbids ``self.log`` in
``on_train_end`` (its ``_FxValidator``), where the last version is decided; ``log_dict``
values reach the loggers only on steps that ``log_every_n_steps`` selects, so most versions
would be dropped (a version's numbers cannot be averaged into the next log step); and
``log_dict`` puts them at the step of the call, which is v - 1 for a synchronous refit and v
for a pipelined one.  ``step=v`` is the version on every logger: with Lightning's own step
axis (the loss of optimizer step k is logged at ``_batches_that_stepped`` = k - 1), x = v holds
the loss computed on the very weights version v shipped.  The metrics are the same on every
rank except ``trainer_pause_seconds``, rank 0's here (logging adds no collective: the values
are already shared by ``after_step``; a max over ranks would cost one per step).  They do not
enter ``trainer.callback_metrics`` (no checkpoint can monitor them).

Framework-tested: ``tests/nemo/test_nemo_recipe.py`` runs ``llm.llama3_8b.pretrain_recipe``
(tiny) with this callback under torchrun (``examples/nemo_llama3_refit.py``) and reads every
version's metrics back from the recipe's TensorBoard event files.
"""
from __future__ import annotations

from nemo_dcr.errors import ValidationError
from nemo_dcr.integrations.attach import RefitAttachment, RefitMetrics
from nemo_dcr.integrations.settings import RefitSettings, load_refit_settings

try:  # NeMo's callback base when NeMo is there, else Lightning's, else a plain object
    from nemo.lightning.base_callback import BaseCallback as _Base
except ImportError:
    try:
        from lightning.pytorch import Callback as _Base
    except ImportError:
        _Base = object


def _model_chunks(trainer, pl_module):
    """Every model chunk NeMo trains (``pl_module`` is only the first under virtual pipelining)."""
    chunks = getattr(getattr(trainer, "strategy", None), "megatron_parallel", None)
    return list(chunks) if chunks is not None else pl_module


def _log_metrics(trainer, metrics: RefitMetrics) -> None:
    """Version ``metrics.version``'s scalars to every logger of ``trainer`` at step = the
    version, on global rank 0 (where Lightning's loggers write); nothing on other ranks."""
    if not trainer.is_global_zero:
        return
    scalars = metrics.scalars()
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=metrics.version)
        logger.save()


class RefitCallback(_Base):
    """``settings``: a ``RefitSettings``; or ``overrides``: Hydra overrides of
    ``nemo_dcr/configs/refit.yaml`` (what a recipe's ``run.Config`` can carry as plain strings)."""

    def __init__(self, settings: RefitSettings | None = None, *, overrides: list[str] | None = None):
        super().__init__()
        if settings is None:
            settings = load_refit_settings(list(overrides or ()))
        elif overrides:
            raise ValidationError("give settings or overrides, not both")
        self.refit = RefitAttachment(settings)
        self.last_metrics: RefitMetrics | None = None
        """The last decided version's metrics, on every rank (None before the first decision)."""

    def state_dict(self) -> dict:
        """Saved by Lightning with the checkpoint: the refit's run state (run id, committed
        version and its decision digest, highest version published)."""
        return self.refit.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restored by Lightning before training starts: ``attach`` continues that run."""
        self.refit.load_state_dict(state_dict)

    def on_train_start(self, trainer, pl_module) -> None:
        self.refit.attach(_model_chunks(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.refit.attached:  # resumed mid-epoch without on_train_start
            self.refit.attach(_model_chunks(trainer, pl_module))
        self._decided(trainer, self.refit.after_step(int(trainer.global_step)))

    def on_train_end(self, trainer, pl_module) -> None:
        """Collective: the version still in flight is decided and logged (before Lightning
        finalizes its loggers)."""
        if self.refit.attached:
            self._decided(trainer, self.refit.finish())

    def _decided(self, trainer, metrics: RefitMetrics | None) -> None:
        if metrics is not None:
            self.last_metrics = metrics
            _log_metrics(trainer, metrics)
