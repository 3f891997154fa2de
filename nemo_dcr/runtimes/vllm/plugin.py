"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``nemo_dcr``):
registers the ``nemo_dcr`` weight-transfer backend (``backend.py``) in every vLLM process.

vLLM loads general plugins in each of its processes, possibly more than once per process, so
registering is idempotent.  The backend's module is imported lazily, when an engine is
created with ``weight_transfer_config={"backend": "nemo_dcr"}``."""
from __future__ import annotations

from nemo_dcr.runtimes.vllm.backend_config import BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # register_engine refuses a name twice; vLLM's plugin contract says plugins may load again
    if BACKEND in getattr(WeightTransferEngineFactory, "_registry", {}):
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "nemo_dcr.runtimes.vllm.backend", "DCRWeightTransferEngine")
