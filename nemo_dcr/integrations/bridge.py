"""Megatron-Bridge-protocol callback: ``on_train_step_end(context)``.

Megatron-Bridge cannot be installed here (it needs Transformer Engine), so this class is
written against its callback protocol and tested with a megatron-core training loop that
calls it with a context shaped like Bridge's (``context.model``: list of model chunks, two
under virtual pipelining in the PP=2 x VPP=2 test; ``context.state.train_state.step``):
protocol-tested, not framework-tested.  It imports
nothing from Bridge.  With Bridge's distributed optimizer and ``overlap_param_gather`` the
params may still be stale at ``on_train_step_end``; the hook forces the gather.
"""
from __future__ import annotations

from nemo_dcr.integrations.attach import RefitAttachment
from nemo_dcr.integrations.settings import RefitSettings, load_refit_settings


class RefitBridgeCallback:
    def __init__(self, settings: RefitSettings | None = None, *, overrides: list[str] | None = None):
        if settings is None:
            settings = load_refit_settings(list(overrides or ()))
        elif overrides:
            raise ValueError("give settings or overrides, not both")
        self.refit = RefitAttachment(settings)

    def state_dict(self) -> dict:
        """The refit's run state, to keep with the training checkpoint (see
        ``RefitAttachment.state_dict``)."""
        return self.refit.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.refit.load_state_dict(state_dict)

    def on_train_start(self, context) -> None:
        self.refit.attach(context.model)

    def on_train_step_end(self, context) -> None:
        if not self.refit.attached:
            self.refit.attach(context.model)
        self.refit.after_step(int(context.state.train_state.step))
