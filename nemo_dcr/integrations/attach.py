"""What every framework callback does, once: attach a refit to the model a framework
trains, then publish a version after optimizer steps.  The framework adapters
(``integrations/nemo.py``, ``integrations/bridge.py``) only translate their callback
signatures into :class:`RefitAttachment` calls.

Failing early and everywhere: ``attach`` runs when training starts (or at the first
step), before training time is spent.  Bad settings, a store that cannot be reached and a
model the hook cannot map raise :class:`RefitSetupError` with one message on EVERY rank
(the ranks agree on the outcome before going on, so none is left waiting in a
collective).
"""
from __future__ import annotations

import torch.distributed as dist

from nemo_dcr.errors import ProtocolError
from nemo_dcr.integrations.megatron_hook import MegatronRefitHook, agree_or_raise
from nemo_dcr.integrations.settings import RefitSettings, RefitSetupError
from nemo_dcr.layout.families import UnsupportedModelError
from nemo_dcr.transport.store import ObjectStore, open_store

_PROBE_KEY = "init/.reachable"


def _reachable_store(uri: str) -> ObjectStore:
    """Open the store and prove it answers (rank 0 writes, every rank reads back)."""
    store = open_store(uri)
    if not dist.is_initialized() or dist.get_rank() == 0:
        store.put(_PROBE_KEY, b"ok")
    if dist.is_initialized():
        dist.barrier()
    if store.get(_PROBE_KEY) != b"ok":
        raise OSError(f"{_PROBE_KEY} did not read back")
    return store


class RefitAttachment:
    """The refit of one training run, on this rank."""

    def __init__(self, settings: RefitSettings):
        if not isinstance(settings, RefitSettings):
            raise RefitSetupError(f"expected RefitSettings, got {type(settings).__name__}")
        self.settings = settings
        self.hook: MegatronRefitHook | None = None
        self._last_step: int | None = None

    @property
    def attached(self) -> bool:
        return self.hook is not None

    def attach(self, model) -> MegatronRefitHook:
        """Collective: build the hook from ``model`` (a GPTModel, any wrapper of one, or a
        list of model chunks, one per virtual pipeline stage) and write version 0."""
        if self.hook is not None:
            return self.hook
        s = self.settings
        error = None
        store = None
        try:
            store = _reachable_store(s.store_uri)
        except Exception as e:  # noqa: BLE001 - any failure to reach the store is the user's to fix
            error = f"store {s.store_uri!r} is not usable: {type(e).__name__}: {e}"
        agree_or_raise(error, RefitSetupError)
        try:
            self.hook = MegatronRefitHook.from_model(
                model, store=store, sender_cfg=s.sender_config(), family=s.family or None,
                vocab_size=s.vocab_size or None)
        except UnsupportedModelError as e:
            raise RefitSetupError(f"the refit cannot map this model: {e}") from None
        try:
            if s.export_initial:
                self.hook.export_initial()
            else:
                self.hook.resume(s.resume_run_id)
        except ProtocolError as e:  # raised on every rank alike (the sender broadcasts it)
            raise RefitSetupError(str(e)) from None
        return self.hook

    def after_step(self, step: int) -> None:
        """Collective: publish version ``step`` (after every ``every_n_steps``-th step)."""
        if self.hook is None:
            raise RefitSetupError("after_step before attach: the refit is not attached to a model")
        if step % self.settings.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        self.hook(step=step)
