"""NeMo 2 / Lightning callback: a refit after every optimizer step of a NeMo recipe.

    recipe.trainer.callbacks.append(run.Config(RefitCallback, overrides=["refit.store_uri=s3://b/run"]))

``RefitCallback`` subclasses NeMo's ``BaseCallback`` when NeMo is installed (Lightning's
``Callback`` when only Lightning is), and is importable without either.  Lightning calls
``on_train_batch_end`` once per optimizer step, after the BF16 params were written (the
distributed optimizer's deferred all-gather, if any, is forced by the hook);
``pl_module`` is NeMo's model, whose ``.module`` chain leads (NeMo DDP -> Float16Module)
to the megatron-core ``GPTModel``.  The version number is ``trainer.global_step``.
"""
from __future__ import annotations

from nemo_dcr.integrations.attach import RefitAttachment
from nemo_dcr.integrations.settings import RefitSettings, load_refit_settings

try:  # NeMo's callback base when NeMo is there, else Lightning's, else a plain object
    from nemo.lightning.base_callback import BaseCallback as _Base
except ImportError:
    try:
        from lightning.pytorch import Callback as _Base
    except ImportError:
        _Base = object


class RefitCallback(_Base):
    """``settings``: a ``RefitSettings``; or ``overrides``: Hydra overrides of
    ``configs/refit.yaml`` (what a recipe's ``run.Config`` can carry as plain strings)."""

    def __init__(self, settings: RefitSettings | None = None, *, overrides: list[str] | None = None):
        super().__init__()
        if settings is None:
            settings = load_refit_settings(list(overrides or ()))
        elif overrides:
            raise ValueError("give settings or overrides, not both")
        self.refit = RefitAttachment(settings)

    def on_train_start(self, trainer, pl_module) -> None:
        self.refit.attach(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.refit.attached:  # resumed mid-epoch without on_train_start
            self.refit.attach(pl_module)
        self.refit.after_step(int(trainer.global_step))
