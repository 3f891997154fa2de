"""Megatron-Bridge callback: a refit after Bridge's optimizer steps, resumed with Bridge's checkpoint.

    from megatron.bridge.training.pretrain import pretrain
    pretrain(config, forward_step, callbacks=[RefitBridgeCallback(overrides=["refit.store_uri=s3://b/run"])])

No Bridge import: Bridge's ``CallbackManager.add`` registers every method of a callback
object that is named after one of its events (and is not its base ``Callback``'s), so this
plain class registers ``on_train_start``, ``on_train_step_end``, ``on_train_end`` and
``on_checkpoint_save`` and nothing else.  Written against Megatron-Bridge 0.6.2 (``megatron/bridge/training/``
``train.py``, ``checkpointing.py``); ``tests/integration/test_bridge_callback.py`` drives it
through that release's own ``callbacks.py`` in ``train.py``'s order.

What Bridge's loop does, and what follows for the refit:

* ``on_train_step_end`` fires BEFORE ``train_state.step += 1``: the optimizer step just taken
  is ``train_state.step + 1``, and that number is the version (1 on the first iteration), so
  a version always equals Bridge's iteration count.  ``every_n_steps`` counts those
  iterations.
* ``context.skipped_iter``: the optimizer made no update (fp16 overflow, non-finite
  gradients, a rerun-machine exit).  Nothing is published; the next version's delta covers
  the iteration (its bits did not change).  Bridge still counts the iteration, so the version
  numbers keep matching its step count.
* ``on_checkpoint_save`` fires after a save (for ``async_save``, when the save is finalized,
  possibly iterations later).  Rank 0 writes the refit's run state (``state_dict()``) into
  the checkpoint's directory, ``<checkpoint.save>/iter_<step:07d>/nemo_dcr_refit.json``
  (temporary file, fsync, rename).  The state is the one taken right after the iteration the
  checkpoint holds (kept per iteration, so an async save gets its own step's state; the step
  of a finalized async save is read from Bridge's tracker
  ``<save>/latest_checkpointed_iteration.txt``, which Bridge writes just before it fires the
  event).
* On restart, Bridge restores ``train_state.step`` before ``on_train_start``.  With a step
  above 0 the callback reads the state from ``<checkpoint.load or checkpoint.save>/
  iter_<step:07d>/nemo_dcr_refit.json`` (rank 0 reads, every rank gets the same), so the run
  continues without ``refit.resume_run_id``, checked against the store's signed history, and
  no version number is reused.  A checkpoint without the file is refused with one line
  (unless ``refit.resume_run_id`` / ``refit.resume_version`` say what to continue).
  Non-persistent and local checkpoints (``non_persistent_ckpt_type``) get no state file: a
  job restarted from one is refused the same way.
* The refit is pipelined (``refit.pipeline``, the default): ``on_train_step_end`` returns
  once the step is diffed; the version's decision is settled at the next iteration's event,
  and ``on_train_end`` (collective, after Bridge's loop) drains the last one.  The run state a
  checkpoint carries is taken once its iteration's version is decided: at the next
  iteration's event, or, for the newest iteration, when its save is reported (rank 0 waits
  for that decision there; the other ranks learn it at their next event).
* An exit condition (``exit_duration_in_mins``, ``exit_interval``, a signal) ends the job
  with ``sys.exit()`` in ``train.py`` BEFORE ``on_train_end``: the last version is then
  settled at interpreter exit by the sender itself (``RefitSender.settle_on_exit``, bounded
  by ``sender.exit_settle_bound_s``), so receivers end on it; its metrics are not logged.
* Per decided version, ``refit/*`` scalars (``RefitMetrics.scalars()``: version, committed,
  committed version, wire bytes, compression, changed %, receivers, joined, evicted, refit
  seconds, trainer pause) go to ``context.state.tensorboard_logger`` (``add_scalar``) and
  ``context.state.wandb_logger`` (``log``) when Bridge set them (on the last rank), at the
  version's step (pipelined: logged one iteration later, so a job killed before that
  event loses the metrics of its last decided version, never the version itself).

``context.model`` is Bridge's list of model chunks (one per virtual pipeline stage).  With
the distributed optimizer and ``overlap_param_gather`` the params may still be stale at
``on_train_step_end``; the hook forces the gather.
"""
from __future__ import annotations

import json
import os


from nemo_dcr.errors import DcrError, FormatError, ValidationError
from nemo_dcr.integrations.attach import RefitAttachment, RefitMetrics
from nemo_dcr.sender.collectives import from_rank0, rank
from nemo_dcr.integrations.settings import RefitSettings, RefitSetupError, load_refit_settings
from nemo_dcr.protocol.jsondoc import parse_document

STATE_FILE = "nemo_dcr_refit.json"
"""The refit's run state inside a Bridge checkpoint's ``iter_<step:07d>`` directory."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Bridge's (Megatron-LM's) tracker: the step of the newest finalized checkpoint."""
_STATE_MAX_BYTES = 64 << 10
_KEEP_STATES = 1024  # run states kept for checkpoints whose (async) save is not finalized yet
_AT_SAVE: dict = {}  # marker: the newest iteration's state, taken when its checkpoint is saved


def _tracker_step(path: str) -> int:
    """The iteration Bridge's tracker file ``path`` names (``FormatError`` if it names none)."""
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise FormatError(f"{path}: not an iteration number: {text[:40]!r}") from None


def _note(msg: str) -> None:
    print(f"nemo_dcr: {msg}", flush=True)


def checkpoint_dir(root: str, step: int) -> str:
    """Bridge's directory of the checkpoint of ``step`` (its ``get_checkpoint_name``)."""
    return os.path.join(root, f"iter_{step:07d}")


def write_state_file(directory: str, state: dict) -> str:
    """Write ``state`` as ``directory/nemo_dcr_refit.json``: a reader sees the old file or the
    whole new one, and the file survives a crash once this returns."""
    path = os.path.join(directory, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(json.dumps(state, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_state_file(directory: str) -> dict | None:
    """The run state in ``directory`` (None when there is no state file)."""
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(_STATE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    return parse_document(data, f"refit state {path}", max_bytes=_STATE_MAX_BYTES)


class RefitBridgeCallback:
    """``settings``: a ``RefitSettings``; or ``overrides``: Hydra overrides of
    ``nemo_dcr/configs/refit.yaml``."""

    def __init__(self, settings: RefitSettings | None = None, *, overrides: list[str] | None = None):
        if settings is None:
            settings = load_refit_settings(list(overrides or ()))
        elif overrides:
            raise ValidationError("give settings or overrides, not both")
        self.refit = RefitAttachment(settings)
        self.last_metrics: RefitMetrics | None = None
        self._states: dict[int, dict] = {}  # Bridge step -> the run state a checkpoint of it carries
        self._noted_no_dir = False

    def state_dict(self) -> dict:
        """The refit's run state now (see ``RefitAttachment.state_dict``)."""
        return self.refit.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a run state kept elsewhere (before training starts); otherwise
        ``on_train_start`` reads it from Bridge's checkpoint."""
        self.refit.load_state_dict(state_dict)

    # -- Bridge events --------------------------------------------------------------------
    def on_train_start(self, context) -> None:
        self._attach(context)

    def on_train_step_end(self, context) -> None:
        self._attach(context)
        step = int(context.state.train_state.step) + 1  # Bridge increments after this event
        # the previous iteration's state is final once its version is decided: take it now
        # (the wait is the one after_step makes anyway), before this step's version is in flight
        self._remember(step - 1)
        if not context.skipped_iter:
            self._publish(context.state, self.refit.after_step(step))
        self._states[step] = _AT_SAVE
        self._trim()

    def on_train_end(self, context) -> None:
        """Collective: the last version in flight (the pipelined refit) is decided and logged."""
        if self.refit.attached:
            self._publish(context.state, self.refit.finish())

    def on_checkpoint_save(self, context) -> None:
        """Rank 0 alone, no collective (an async save's event may come at any iteration); a
        failure is reported, never raised: one rank raising would leave the others waiting in
        the next collective, and the checkpoint without the file is refused at restart."""
        ckpt = context.state.cfg.checkpoint
        if not self.refit.attached or rank() != 0 or not ckpt.save:
            return
        try:
            if getattr(ckpt, "async_save", False):
                # finalized now, saved earlier: Bridge wrote its tracker just before this event
                step = _tracker_step(os.path.join(ckpt.save, TRACKER_FILE))
            else:
                step = int(context.state.train_state.step)
            directory = checkpoint_dir(ckpt.save, step)
            if not os.path.isdir(directory):
                if not self._noted_no_dir:
                    _note(f"no {directory} after a checkpoint save (a non-persistent or local checkpoint?): its "
                          "refit state is not saved, and a job restarted from it will be refused")
                    self._noted_no_dir = True
                return
            state = self._states.get(step)
            if state is _AT_SAVE:  # the newest iteration: its version may be in flight (waited for here)
                state = self._states[step] = self.refit.state_dict()
            if state is None:
                _note(f"the refit state of step {step} is no longer known: {directory} gets none, and a job "
                      "restarted from it will be refused")
                return
            write_state_file(directory, state)
        except (OSError, FormatError) as e:
            _note(f"the refit state of a checkpoint in {ckpt.save} was not saved ({type(e).__name__}: {e}); a job "
                  "restarted from that checkpoint will be refused")
            return
        for s in [s for s in self._states if s < step]:
            del self._states[s]

    # -- helpers --------------------------------------------------------------------------
    def _attach(self, context) -> None:
        """Collective, once: restore the run state of the checkpoint Bridge resumed from
        (step > 0), then attach to ``context.model``."""
        if self.refit.attached:
            return
        step = int(context.state.train_state.step)
        if step > 0 and not self.refit.restored:
            state = from_rank0(self._checkpoint_state(context.state.cfg.checkpoint, step) if rank() == 0 else None)
            if isinstance(state, str):
                raise RefitSetupError(state)
            if state is not None:
                self.refit.load_state_dict(state)
        self.refit.attach(context.model)
        self._remember(step)

    def _checkpoint_state(self, ckpt, step: int) -> dict | str | None:
        """Rank 0: the run state of the checkpoint of ``step`` (None: there is none, and the
        settings name the run to continue), or the one-line reason there is none."""
        root = ckpt.load or ckpt.save
        if root:
            directory = checkpoint_dir(root, step)
            try:
                state = read_state_file(directory)
            except (OSError, DcrError) as e:
                return f"the refit state of checkpoint {directory} is unreadable: {e}"
            if state is not None:
                return state
            missing = f"checkpoint {directory} has no refit state ({STATE_FILE}: not saved with RefitBridgeCallback)"
        else:
            missing = f"Bridge restored step {step}, and cfg.checkpoint names no directory (load, save) to read " \
                      "the refit state from"
        if self.refit.settings.resume_run_id:
            return None  # refit.resume_run_id / resume_version say which run and version
        return (f"{missing}; to continue a refit run from it, give refit.resume_run_id and refit.resume_version "
                "(the committed version its weights hold)")

    def _remember(self, step: int) -> None:
        self._states[step] = self.refit.state_dict()
        self._trim()

    def _trim(self) -> None:
        while len(self._states) > _KEEP_STATES:
            del self._states[next(iter(self._states))]

    def _publish(self, state, metrics: RefitMetrics | None) -> None:
        if metrics is not None:
            self.last_metrics = metrics
            self._log(state, metrics)

    @staticmethod
    def _log(state, m: RefitMetrics) -> None:
        scalars = m.scalars()
        tb = getattr(state, "tensorboard_logger", None)
        if tb is not None:
            for tag, value in scalars.items():
                tb.add_scalar(tag, value, m.version)
        wandb = getattr(state, "wandb_logger", None)
        if wandb is not None:
            wandb.log(scalars, step=m.version)
