"""nemo_dcr as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "nemo_dcr"}'``.

vLLM creates one :class:`DCRWeightTransferEngine` per worker when the engine starts
(``WeightTransferEngineFactory``; the name is registered in every vLLM process by the
``vllm.general_plugins`` entry point, ``plugin.py``).  The RL routes then drive it:

* ``/init_weight_transfer_engine {"init_info": {...}}`` (``backend_config.BackendInitInfo``):
  opens the store, waits for the run, checks that the checkpoint the engine was started from
  is the run's signed version 0, installs the placement plan (``adapter.VLLMWorkerAdapter``
  under a ``DeltaApplier``, as ``nemo-dcr receive --runtime vllm`` does) and starts the
  background follower (``receiver/gated.py``): while the engine serves, it follows the run,
  fetches, verifies, decodes and validates each version (staging), writing nothing.
* ``/start_weight_update``: nothing to prepare (updates are in place).
* ``/update_weights {"update_info": {"version": N}}`` (or ``"latest"``): opens the write
  window; the staged version is applied in place through vLLM's own loader, acknowledged in
  the joint commit, and the call returns once the commit decision is read.  A refused or
  aborted version raises one line (vLLM answers the HTTP call with an error) and leaves the
  engine serving the version it held, rolled back in place where it had been written; the
  engine stays up.
* ``/finish_weight_update {"weight_version": "<run_id>:<N>"}``: vLLM tags every output token
  generated from then on with that version (its own per-request spans); the controller
  (``controller.py``) passes it.

Tensor parallel engines: rank 0 is the run's member and reaches the other workers' shards
through a channel of the backend's own (``tp.py``); pipeline and data parallel engines are
refused at init with one line.  In a TP>1 engine an error is raised by the last worker only
(``_fail``).  docs/design.md, "vLLM weight-transfer backend", has the decisions.
"""
from __future__ import annotations

import logging
import tempfile

import torch
import torch.distributed as dist
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from nemo_dcr.errors import ProtocolError, ValidationError
from nemo_dcr.protocol.run import wait_for_run
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver.apply import DeltaApplier
from nemo_dcr.receiver.bootstrap import fetch_version_zero, verify_start_dir
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.receiver.gated import BackgroundFollower, GatedModel, UpdateRefused, WriteGate
from nemo_dcr.receiver.served import InProcessModel
from nemo_dcr.runtimes.vllm.backend_config import BackendInitInfo, UpdateInfo
from nemo_dcr.transport.store import open_store

# a child of vLLM's logger: the engine's lines go where vLLM's go, in its format
log = logging.getLogger("vllm.nemo_dcr")

WINDOW_GRACE_S = 60.0
"""How much longer than the update's own timeout a TP worker waits for rank 0 to end its window."""


class _Refused:
    """A malformed init_info on a worker that does not raise (see ``_fail``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DCRWeightTransferEngine(WeightTransferEngine[BackendInitInfo, UpdateInfo]):
    init_info_cls = BackendInitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: BackendInitInfo | None = None
        self._follow: BackgroundFollower | None = None  # the run's member: rank 0 (or the only worker)
        self._sharded = None  # rank 0 of a TP>1 engine: its ShardedModel (tp.py)
        self._serving = None  # ranks 1..N-1: their Serving thread (tp.py)
        self._channel = None
        self._windows = 0  # update windows opened (equal on every worker: vLLM calls them all)
        self.local_applier: DeltaApplier | None = None  # local mode (local_setup) only

    # ------------------------------------------------------------ one error per call
    @property
    def _rank(self) -> int:
        return dist.get_rank() if self.parallel_config.world_size > 1 else 0

    def _fail(self, error: Exception) -> None:
        """Raise ``error`` on the engine's last worker only; the others log it and return.

        vLLM 0.32's multiprocess executor raises at the first failed worker reply of a
        collective call and leaves the later workers' replies queued, where the next call reads
        them (seen here: ``/weight_checker`` answered with rank 1's update error, and every
        later call one reply behind).  The last worker's reply is read last, so an error raised
        there alone leaves every queue drained.  Every error of a call is therefore known to
        the last worker (rank 0 sends its own with the end of the window or the init verdict)."""
        if self._rank == self.parallel_config.world_size - 1:
            raise error
        log.warning("nemo_dcr (rank %d): %s", self._rank, _one_line(str(error)))

    # JSON in, checked (backend_config.py); vLLM's defaults would call cls(**dict)
    def parse_init_info(self, init_dict) -> BackendInitInfo:
        try:
            return BackendInitInfo.from_json(init_dict)
        except Exception as e:  # every worker parses the same JSON: init_transfer_engine reports it once
            return _Refused(e)

    def parse_update_info(self, update_dict) -> UpdateInfo:
        return UpdateInfo.from_json(update_dict)

    # ------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: BackendInitInfo) -> None:
        try:
            self._init(init_info)
        except Exception as e:
            self._fail(e)

    def _init(self, info) -> None:
        # the same on every worker: each raises (only the last reports, _fail)
        if isinstance(info, _Refused):
            raise info.error
        if self._follow is not None or self._serving is not None:
            raise ProtocolError("nemo_dcr: the weight-transfer engine is already initialised (shut it down first)")
        if self.local_applier is not None:
            raise ProtocolError("nemo_dcr: this engine is driven by a receiver in its own process (local_setup)")
        pc = self.parallel_config
        if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
            raise ValidationError(
                f"nemo_dcr backend: tensor parallelism only so far (this engine has pipeline_parallel_size="
                f"{pc.pipeline_parallel_size}, data_parallel_size={pc.data_parallel_size})")
        init_dir = str(self.model_config.model)
        if pc.world_size == 1:
            self._start_leader(info, self._check_run(info, init_dir), self._placement(init_dir))
            return
        from nemo_dcr.runtimes.vllm.tp import Serving, ShardedModel, WorkerChannel

        if self._channel is None:  # every worker is in this call: the group is created once per engine
            self._channel = WorkerChannel.create()
        ch = self._channel
        # 1. rank 0 checks the run and its own checkpoint; every worker hears the verdict
        found, verdict = None, ""
        if ch.rank == 0:
            try:
                found = self._check_run(info, init_dir)
            except Exception as e:
                verdict = _one_line(str(e))
        verdict = ch.broadcast(verdict)
        if verdict:
            raise ProtocolError(verdict)
        # 2. every worker installs its placement plan; every worker hears the first failure
        placed, failure = None, ""
        try:
            placed = self._placement(init_dir)
        except Exception as e:
            failure = _one_line(f"rank {ch.rank}: {e}")
        failures = ch.gather(failure)
        final = ch.broadcast(next((f for f in failures if f), "") if ch.rank == 0 else None)
        if final:
            raise ValidationError(final)
        if ch.rank == 0:
            self._start_leader(info, found, placed, served=ShardedModel(placed[0], ch))
        else:
            self._serving = Serving(placed[0], ch, placed[1]).start()
            self._info = info

    def _check_run(self, info: BackendInitInfo, init_dir: str):
        """The store, the run, and the engine's own checkpoint as the run's signed version 0, or
        its snapshot of ``start_version`` (else refused: nothing is set up)."""
        store = open_store(info.store)
        sealer = Sealer(load_key(info.key_file, log=log.warning))
        run_id = wait_for_run(store, sealer, run_id=info.run_id, timeout_s=info.start_timeout_s,
                              allow_unverified=info.insecure_no_key)
        if info.start_version == 0:
            _, root = fetch_version_zero(store, sealer, run_id, state_dir=tempfile.gettempdir(), init_dir=init_dir,
                                         timeout_s=info.start_timeout_s)
        else:  # a committed-version snapshot: the chain continues from its commit decision
            root = verify_start_dir(store, sealer, run_id, init_dir, info.start_version)
        return store, sealer, run_id, root

    def _placement(self, init_dir: str):
        from nemo_dcr.runtimes.vllm.adapter import VLLMWorkerAdapter

        applier = DeltaApplier(VLLMWorkerAdapter(self.model, init_dir))
        applier.prewarm()
        vllm_config = self.vllm_config
        return applier, WriteGate(write_context=lambda: set_current_vllm_config(vllm_config))

    def _start_leader(self, info: BackendInitInfo, found, placed, *, served=None) -> None:
        """Rank 0 (or the only worker): the run's member, following it in the background."""
        store, sealer, run_id, root = found
        applier, gate = placed
        cfg = ReceiverConfig(receiver_id=info.receiver_id, model_id=info.model_id, poll_s=info.poll_s,
                             fetch_threads=info.fetch_threads, stream=info.stream)
        rx = Receiver(GatedModel(served or InProcessModel(applier), gate), store, cfg, held_version=info.start_version)
        self._follow = BackgroundFollower(
            rx, store, sealer, run_id, gate=gate, poll_s=info.poll_s, status_path=info.status_path, log=log.info,
            receiver_id=info.receiver_id, committed=info.start_version, committed_digest=root,
            join=info.join).start()
        self._sharded = served
        self._info = info
        log.info("nemo_dcr: following run %s from %s as %s (version %d checked: %s; %d worker(s))", run_id,
                 info.store, info.receiver_id, info.start_version, str(self.model_config.model),
                 self.parallel_config.world_size)

    # ------------------------------------------------------------ local mode
    def local_setup(self, checkpoint_dir: str) -> DeltaApplier:
        """For a receiver that runs the protocol in the process owning the engine (``nemo-dcr
        receive --runtime vllm``, ``VLLMRuntime``): install this worker's placement plan and
        follow no run; the receiver applies through ``extension.rpc_*`` (validate in every
        worker, then apply in every worker).  Exclusive with ``init_transfer_engine``."""
        if self._follow is not None or self._serving is not None:
            raise ProtocolError("nemo_dcr: this engine already follows a run (init_weight_transfer_engine)")
        if self.local_applier is None:
            self.local_applier, _ = self._placement(str(checkpoint_dir))
        return self.local_applier

    # ------------------------------------------------------------ updates
    def start_weight_update(self) -> None:
        """Nothing to prepare (updates are in place); ``update_weights`` reports a missing init
        (failing here would leave vLLM's workers disagreeing whether a session is open)."""

    def update_weights(self, update_info: dict) -> None:
        if self._follow is None and self._serving is None:
            self._fail(ProtocolError("nemo_dcr: call /init_weight_transfer_engine with the run's init_info first"))
            return
        self._windows += 1
        seq = self._windows
        if self._serving is not None:
            try:
                timeout_s = self.parse_update_info(update_info).timeout_s or self._info.update_timeout_s
            except Exception:  # malformed: rank 0 reports it at the end of the window
                timeout_s = self._info.update_timeout_s
            try:
                self._serving.window(seq, timeout_s + WINDOW_GRACE_S)
            except UpdateRefused as e:
                self._fail(e)
            return
        error = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as e:
            error = e
        if self._sharded is not None:  # the other workers leave their windows with this outcome
            self._sharded.end_window(seq, _one_line(str(error)) if error else None)
        if error is not None:
            self._fail(error)
        elif torch.accelerator.is_available():  # writes on the follower's thread: done before serving resumes
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        follow = self._follow
        version = follow.latest() if update_info.version == "latest" else update_info.version
        timeout_s = update_info.timeout_s or self._info.update_timeout_s
        event = follow.update(version, timeout_s=timeout_s)
        log.info("nemo_dcr: v%d: %s", version, event.get("event") or event.get("decision"))

    def finish_weight_update(self) -> None:
        """Nothing to do: vLLM sets the weight version the controller passes."""

    def shutdown(self) -> None:
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.stop()
        sharded, self._sharded = self._sharded, None
        if sharded is not None:
            sharded.stop()
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.join(10.0)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
