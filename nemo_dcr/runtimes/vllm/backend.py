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

Scope today: one worker per engine (tensor and pipeline parallel size 1); a larger engine is
refused at init with one line.  ``nemo-dcr receive --runtime vllm`` (a ``vllm.LLM`` owned by
the receiver process, TP=1 and TP=2) is unchanged.  docs/design.md, "vLLM weight-transfer
backend", has the decisions.
"""
from __future__ import annotations

import logging
import tempfile

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from nemo_dcr.errors import ProtocolError, ValidationError
from nemo_dcr.protocol.run import wait_for_run
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver.apply import DeltaApplier
from nemo_dcr.receiver.bootstrap import fetch_version_zero
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.receiver.gated import BackgroundFollower, GatedModel, WriteGate
from nemo_dcr.receiver.served import InProcessModel
from nemo_dcr.runtimes.vllm.backend_config import BackendInitInfo, UpdateInfo
from nemo_dcr.transport.store import open_store

# a child of vLLM's logger: the engine's lines go where vLLM's go, in its format
log = logging.getLogger("vllm.nemo_dcr")


class DCRWeightTransferEngine(WeightTransferEngine[BackendInitInfo, UpdateInfo]):
    init_info_cls = BackendInitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: BackendInitInfo | None = None
        self._follow: BackgroundFollower | None = None

    # JSON in, checked (backend_config.py); vLLM's defaults would call cls(**dict)
    def parse_init_info(self, init_dict) -> BackendInitInfo:
        return BackendInitInfo.from_json(init_dict)

    def parse_update_info(self, update_dict) -> UpdateInfo:
        return UpdateInfo.from_json(update_dict)

    def init_transfer_engine(self, init_info: BackendInitInfo) -> None:
        if self._follow is not None:
            raise ProtocolError("nemo_dcr: the weight-transfer engine is already initialised (shut it down first)")
        pc = self.parallel_config
        if pc.world_size != 1:
            raise ValidationError(
                f"nemo_dcr backend: one worker per engine so far (this engine has tensor_parallel_size="
                f"{pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size}); use "
                "'nemo-dcr receive --runtime vllm' for TP>1")
        info = init_info
        store = open_store(info.store)
        sealer = Sealer(load_key(info.key_file, log=log.warning))
        run_id = wait_for_run(store, sealer, run_id=info.run_id, timeout_s=info.start_timeout_s,
                              allow_unverified=info.insecure_no_key)
        init_dir = str(self.model_config.model)
        # the engine's own checkpoint must be the run's signed version 0 (else: refused, nothing set up)
        _, root = fetch_version_zero(store, sealer, run_id, state_dir=tempfile.gettempdir(), init_dir=init_dir,
                                     timeout_s=info.start_timeout_s)
        from nemo_dcr.runtimes.vllm.adapter import VLLMWorkerAdapter

        applier = DeltaApplier(VLLMWorkerAdapter(self.model, init_dir))
        applier.prewarm()
        vllm_config = self.vllm_config
        gate = WriteGate(write_context=lambda: set_current_vllm_config(vllm_config))
        cfg = ReceiverConfig(receiver_id=info.receiver_id, model_id=info.model_id, poll_s=info.poll_s,
                             fetch_threads=info.fetch_threads, stream=info.stream)
        rx = Receiver(GatedModel(InProcessModel(applier), gate), store, cfg)
        self._follow = BackgroundFollower(
            rx, store, sealer, run_id, gate=gate, poll_s=info.poll_s, status_path=info.status_path, log=log.info,
            receiver_id=info.receiver_id, committed=0, committed_digest=root, join=info.join).start()
        self._info = info
        log.info("nemo_dcr: following run %s from %s as %s (version 0 checked: %s)", run_id, info.store,
                 info.receiver_id, init_dir)

    def start_weight_update(self) -> None:
        self._following()

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # writes on the follower's thread: done before serving resumes
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        follow = self._following()
        version = follow.latest() if update_info.version == "latest" else update_info.version
        timeout_s = update_info.timeout_s or self._info.update_timeout_s
        event = follow.update(version, timeout_s=timeout_s)
        log.info("nemo_dcr: v%d: %s", version, event.get("event") or event.get("decision"))

    def finish_weight_update(self) -> None:
        self._following()

    def shutdown(self) -> None:
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.stop()

    def _following(self) -> BackgroundFollower:
        if self._follow is None:
            raise ProtocolError("nemo_dcr: call /init_weight_transfer_engine with the run's init_info first")
        return self._follow
