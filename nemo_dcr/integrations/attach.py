"""What every framework callback does, once: attach a refit to the model a framework
trains, then publish a version after optimizer steps.  The framework adapters
(``integrations/nemo.py``, ``integrations/bridge.py``) only translate their callback
signatures into :class:`RefitAttachment` calls.

Run state lives in the training checkpoint: :meth:`RefitAttachment.state_dict` is what a
framework saves with the model (the Lightning / NeMo callback's ``state_dict``), and
:meth:`load_state_dict` (on restore, before training starts) makes ``attach`` continue that
run -- checked against the store's signed history -- instead of starting a new one.

Failing early and everywhere: ``attach`` runs when training starts (or at the first
step), before training time is spent.  Bad settings, a store that cannot be reached and a
model the hook cannot map raise :class:`RefitSetupError` with one message on EVERY rank
(the ranks agree on the outcome before going on, so none is left waiting in a
collective).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch.distributed as dist

from nemo_dcr.errors import DcrError, ProtocolError
from nemo_dcr.sender.coding_choice import CODINGS
from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
from nemo_dcr.sender.collectives import agree_or_raise, from_rank0
from nemo_dcr.protocol.history import RunState
from nemo_dcr.integrations.settings import RefitSettings, RefitSetupError
from nemo_dcr.layout.families import UnsupportedModelError
from nemo_dcr.transport.store import ObjectStore, open_store

_PROBE_KEY = "init/.reachable"


def _reachable_store(uri: str) -> ObjectStore:
    """Check the store (``transport/preflight.check_store``: a directory that can be one; an
    ``s3://`` endpoint, credentials, region and bucket, in one listing that writes nothing),
    open it and prove it answers (rank 0 writes, every rank reads back)."""
    from nemo_dcr.transport.preflight import check_store

    check_store(uri, reader=False)
    store = open_store(uri)
    if not dist.is_initialized() or dist.get_rank() == 0:
        store.put(_PROBE_KEY, b"ok")
    if dist.is_initialized():
        dist.barrier()
    if store.get(_PROBE_KEY, max_bytes=2) != b"ok":
        raise OSError(f"{_PROBE_KEY} did not read back")
    return store


@dataclass(frozen=True)
class RefitMetrics:
    """What one decided version cost, the same on every rank except ``pause_s``.  A front end
    logs :meth:`scalars` where its users look (the NeMo callback: Lightning's ``log_dict``;
    the Bridge callback: TensorBoard / W&B).  With ``refit.pipeline`` a version is decided in
    the background and its metrics come from the next hook call (or ``finish()``)."""

    version: int
    """The version decided (= the optimizer steps taken when it was published)."""
    committed: bool
    """Every member acknowledged it (False: aborted; the next version diffs against the
    committed one)."""
    committed_version: int
    """The run's committed version after this decision."""
    wire_bytes: int
    """Bytes of the version's chunks on the store, over all ranks."""
    dense_bytes: int
    """What a dense refit would send: every canonical tensor's bytes."""
    changed: int
    """Canonical elements whose stored bits changed, over all ranks."""
    numel: int
    """Elements diffed, over the ranks' local parameters (replicas included)."""
    receivers: int
    """Receivers the decision covered (the members, under elastic membership)."""
    joined: int
    """Receivers admitted at this version (elastic membership)."""
    evicted: int
    """Receivers evicted at this version (elastic membership)."""
    refit_s: float
    """Rank 0's wall time from the start of the diff to the decision."""
    pause_s: float
    """How long the ``after_step`` / ``finish`` call that returned these metrics held this
    rank's training loop (pipelined: the diff and projection of the step it published, plus
    any wait for the previous decision; synchronous: the whole refit)."""

    @property
    def compression(self) -> float:
        """Dense bytes over wire bytes (0 when nothing was sent)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 0.0

    @property
    def changed_pct(self) -> float:
        """Changed canonical elements, in percent of the canonical elements."""
        return 100.0 * self.changed / self.canonical_numel if self.canonical_numel else 0.0

    canonical_numel: int = 0
    """Elements of every canonical tensor (the denominator of ``changed_pct``)."""
    coding: str = ""
    """The coding the version's chunks used (``refit.coding``; under ``auto``, its choice)."""
    projected_walls: tuple[tuple[str, float], ...] = ()
    """``refit.coding=auto``: each candidate's projected refit wall (s) behind the choice for
    the next version (empty before anything was measured)."""

    def scalars(self) -> dict[str, float]:
        """The metrics under ``refit/...`` names, as plain floats, for any logger."""
        return {"refit/version": float(self.version), "refit/committed": float(self.committed),
                "refit/committed_version": float(self.committed_version),
                "refit/wire_bytes": float(self.wire_bytes), "refit/compression": self.compression,
                "refit/changed_pct": self.changed_pct, "refit/receivers": float(self.receivers),
                "refit/joined": float(self.joined), "refit/evicted": float(self.evicted),
                "refit/refit_seconds": self.refit_s, "refit/trainer_pause_seconds": self.pause_s,
                **{f"refit/coding_{c}": float(c == self.coding) for c in CODINGS if self.coding},
                **{f"refit/projected_wall_{c}_seconds": w for c, w in self.projected_walls}}


class RefitAttachment:
    """The refit of one training run, on this rank."""

    def __init__(self, settings: RefitSettings):
        if not isinstance(settings, RefitSettings):
            raise RefitSetupError(f"expected RefitSettings, got {type(settings).__name__}")
        self.settings = settings
        self.hook: MegatronRefitHook | None = None
        self._last_step: int | None = None
        self._restored: RunState | None = None
        self._weights_step: int | None = None  # the last optimizer step after_step saw
        self._skipped_logged = False

    STATE_FORMAT = "nemo-dcr-refit-state/1"

    def state_dict(self) -> dict:
        """The run state for the trainer's checkpoint ({} before a run exists), with the step
        the weights hold now (the last step seen), so a resume can tell whether they are
        the committed version's bits."""
        if self.hook is not None and self.hook.run_id:
            state = self.hook.run_state()
            if self._weights_step is not None:
                state = dataclasses.replace(state, weights_version=self._weights_step)
        else:
            state = self._restored
        return {} if state is None else {"format": self.STATE_FORMAT, **state.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the run state a checkpoint carried (before ``attach``); {} = none."""
        if not state:
            return
        if not isinstance(state, dict) or state.get("format") != self.STATE_FORMAT:
            raise RefitSetupError(f"refit state in the checkpoint is not {self.STATE_FORMAT}: "
                                  f"{str(state)[:200]}")
        try:
            restored = RunState.from_dict({k: v for k, v in state.items() if k != "format"})
        except DcrError as e:
            raise RefitSetupError(f"refit state in the checkpoint: {e}") from None
        if self.hook is not None:
            raise RefitSetupError("refit state restored after the refit attached (a new run already started)")
        self._restored = restored

    def _resume_state(self) -> RunState | None:
        s = self.settings
        if self._restored is not None:
            if s.resume_run_id and s.resume_run_id != self._restored.run_id:
                raise RefitSetupError(f"refit.resume_run_id={s.resume_run_id} but the checkpoint continues run "
                                      f"{self._restored.run_id}")
            return self._restored
        if s.resume_run_id:
            return RunState(run_id=s.resume_run_id, committed_version=s.resume_version, committed_digest="",
                            published_version=s.resume_version)
        if not s.export_initial:
            raise RefitSetupError("refit.export_initial=false, and there is nothing to resume: the checkpoint "
                                  "holds no refit run state and refit.resume_run_id is not set")
        return None

    @property
    def attached(self) -> bool:
        return self.hook is not None

    @property
    def restored(self) -> bool:
        """A checkpoint's run state was loaded (``attach`` will continue that run)."""
        return self._restored is not None

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
                model, store=store, sender_cfg=s.refit_options(), family=s.family or None,
                vocab_size=s.vocab_size or None)
        except UnsupportedModelError as e:
            raise RefitSetupError(f"the refit cannot map this model: {e}") from None
        try:
            resume = self._resume_state()
            if resume is None:
                self.hook.export_initial()
            else:
                self.hook.resume(resume)
        except ProtocolError as e:  # raised on every rank alike (the sender broadcasts it)
            raise RefitSetupError(str(e)) from None
        return self.hook

    def after_step(self, step: int) -> RefitMetrics | None:
        """Collective: publish version ``step`` (after every ``every_n_steps``-th step);
        returns the metrics of the version decided in this call, or None when none was
        (pipelined: the previous version's, so None at the first published step; or this
        step publishes nothing).  Call :meth:`finish` after the last step."""
        if self.hook is None:
            raise RefitSetupError("after_step before attach: the refit is not attached to a model")
        t_enter = time.perf_counter()
        self._weights_step = step
        if step % self.settings.every_n_steps or step == self._last_step:
            return None
        self._last_step = step
        floor = self.hook.sender.published_version
        if step <= floor:
            # a restarted job re-runs steps whose numbers an earlier incarnation published:
            # never reuse one; the first step past them carries these steps' changes too
            if not self._skipped_logged and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"nemo_dcr: step {step} is not published: version numbers up to {floor} are already in "
                      f"use on the store; the next version is {floor + 1} or later", flush=True)
                self._skipped_logged = True
            return None
        return self._metrics(self.hook(step=step), t_enter)

    def finish(self) -> RefitMetrics | None:
        """Collective: at the end of training, wait for the version still in flight (the
        pipelined refit) and return its metrics; None when nothing was in flight.  The
        framework callbacks call it at train end; a loop of its own calls it after its last
        step.  A process that ends without it settles the version in flight at interpreter
        exit or SIGTERM (``RefitSender.settle_on_exit``: bounded, its metrics unreported)."""
        if self.hook is None:
            return None
        t_enter = time.perf_counter()
        return self._metrics(self.hook.finish(), t_enter)

    def _metrics(self, stats, t_enter: float) -> RefitMetrics | None:
        """Collective: ``stats`` (rank 0 holds the totals) as the same metrics on every rank."""
        if stats is None:
            return None
        # totals live on rank 0 (the sender gathers them there); a framework's logger may
        # live on another rank (Megatron's on the last one)
        totals = from_rank0((int(stats.wire_bytes), int(stats.dense_bytes), int(stats.changed), int(stats.numel),
                             len(stats.members), len(stats.joined), len(stats.evicted), float(stats.refit_s),
                             tuple(stats.coding_walls.items())))
        wire, dense, changed, numel, members, joined, evicted, refit_s, walls = totals
        return RefitMetrics(version=stats.version, committed=bool(stats.committed),
                            committed_version=self.hook.sender.baseline.version, wire_bytes=wire, dense_bytes=dense,
                            changed=changed, numel=numel, receivers=members, joined=joined, evicted=evicted,
                            refit_s=refit_s, pause_s=time.perf_counter() - t_enter,
                            canonical_numel=self.hook.sender.canonical_numel, coding=stats.coding,
                            projected_walls=walls)
