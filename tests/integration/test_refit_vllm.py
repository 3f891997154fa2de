"""End to end with vLLM engines as receivers: the real Megatron trainer (TP=2, torchrun)
-> deltas -> a receiver process holding a running ``vllm.LLM`` (TP=1, then TP=2), updated
in place for 3 steps.

Per step the receiver itself checks (the demo's ``bit_exact``): greedy generations and
top-5 logprobs on three prompts, and every non-empty parameter/buffer of every worker,
identical to a second engine refit densely from the trainer's dense export through the
same loader.  Independently, this test starts a FRESH engine from the dense export of the
last version and compares the receiver's dump of every worker's weights with it (integer
views), and checks the versions differ (non-vacuous).  Refusals through the receiver
loop: tests/receiver/test_vllm_runtime.py (in-process) and test_refit_e2e.py (the loop).
"""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nemo_dcr.protocol.manifest import dense_key
from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config

from .test_refit_e2e import SMALL, bit_differences

pytestmark = pytest.mark.vllm
STEPS = 3
# head_dim 64 (vLLM's CPU attention), vLLM TP=2 divides 2 KV heads
VLLM_SMALL = [s for s in SMALL if not s.startswith("model.hidden_size")] + ["model.hidden_size=256"]


def _fresh_engine_state(store_dir, version, work, tp):
    from nemo_dcr.runtimes.vllm import VLLMRuntime

    d = work / f"dense-v{version}"
    d.mkdir()
    shutil.copy(store_dir / "init" / "config.json", d / "config.json")
    shutil.copy(store_dir / dense_key(version), d / "model.safetensors")
    rt = VLLMRuntime.start(str(d), tensor_parallel_size=tp, max_model_len=32)
    try:
        return {f"w{r}.{k}": v for r, sd in enumerate(rt.state_dicts()) for k, v in sd.items()}
    finally:
        rt.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_receiver_refits_bit_exactly(tmp_path, tp):
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"steps={STEPS}",
                            *VLLM_SMALL, "train.lr=3e-6", "refit.verify_dense=true", "receiver.runtime=vllm",
                            f"receiver.tensor_parallel_size={tp}", f"refit.receiver_dump_dir={tmp_path}/dump"])
    summary = demo.run(cfg)
    assert summary["runtime"] == "vllm" and summary["receiver_tp"] == tp
    assert summary["refits"] == STEPS and summary["committed"] == STEPS and summary["bit_exact"] == STEPS, summary
    dumps = [load_file(str(tmp_path / "dump" / "r0" / f"v{v}.safetensors")) for v in range(1, STEPS + 1)]
    assert all(bit_differences(a, b) for a, b in zip(dumps, dumps[1:]))  # every step changed weights
    fresh = _fresh_engine_state(tmp_path / "store", STEPS, tmp_path, tp)
    assert len(fresh) == len(dumps[-1]) > 0
    assert bit_differences(dumps[-1], fresh) == []
    # negative control: the previous version's weights are not the last version's
    assert bit_differences(dumps[-2], fresh)
    if tp == 2:  # both workers hold shards
        assert any(k.startswith("w1.") for k in fresh)
    assert torch.is_tensor(next(iter(fresh.values())))


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory):
    """One 2-step run into a vLLM receiver; its store is replayed below."""
    d = tmp_path_factory.mktemp("vllm-store")
    cfg = load_demo_config([f"run_dir={d}/run", f"store.uri={d}/store", "steps=2", *VLLM_SMALL,
                            "train.lr=3e-6", "refit.verify_dense=false", "receiver.runtime=vllm"])
    summary = demo.run(cfg)
    assert summary["committed"] == 2
    return d / "store", cfg


def test_vllm_receiver_refusals_keep_the_engine_serving(vllm_store, tmp_path):
    """Through the receiver loop: a wrong base version and a corrupted chunk are refused
    with a clear ack; the engine's weights (digest) and greedy generations are unchanged;
    the clean version then applies (control)."""
    from nemo_dcr.protocol.manifest import Manifest, manifest_key
    from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
    from nemo_dcr.receiver.registry import RuntimeOptions, RuntimeRequest, start_runtime
    from nemo_dcr.runtimes.vllm.served import verify_prompts
    from nemo_dcr.transport.store import LocalDirStore

    src, cfg = vllm_store
    shutil.copytree(src, tmp_path / "store")
    store = LocalDirStore(str(tmp_path / "store"))
    built = start_runtime("vllm", RuntimeRequest(init_dir=str(tmp_path / "store" / "init"), run_id="unused",
                                                 state_dir=str(tmp_path), options=RuntimeOptions(max_model_len=32)))
    served = built.served  # the registry's vllm factory: a VLLMServedModel
    try:
        rx = Receiver(served, store, ReceiverConfig(receiver_id="t0", model_id=cfg.refit.model_id))
        prompts = verify_prompts(cfg.model.vocab_size)

        def state():
            return served.runtime.weight_digest(), served.runtime.generate(prompts, max_tokens=8, logprobs=2)

        before = state()
        m2 = Manifest.from_json(store.get(manifest_key(2)))
        ack = rx.apply_tentative(m2, "", run_id=m2.run_id)
        assert not ack.ok and "base version 1" in ack.error and "holds version 0" in ack.error
        m1 = Manifest.from_json(store.get(manifest_key(1)))
        key = m1.chunks[0].key
        good = store.get(key)
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x10
        store.put(key, bytes(bad))
        ack = rx.apply_tentative(m1, "", run_id=m1.run_id)
        assert not ack.ok and key in ack.error and "digest" in ack.error
        assert state() == before and rx.held_version == 0
        store.put(key, good)
        ack = rx.apply_tentative(m1, "", run_id=m1.run_id)
        assert ack.ok and rx.held_version == 1
        assert state()[0] != before[0]  # the control applied and changed weights
    finally:
        built.close()
