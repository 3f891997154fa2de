"""The controller's Ray client (``RayEngineClient``) driving an ``AsyncLLM`` in a Ray actor,
as RL frameworks run rollout engines: a local Ray (2 CPUs), the actor
(``nemo_dcr_testbed.vllm_ray.RolloutEngine``) built with ``weight_transfer_config={"backend":
"nemo_dcr"}`` and nothing else (the backend registered by the package's entry point), refit
through vLLM's own ``RayVLLMWeightSyncClient`` and ``AsyncLLM``'s pause and resume, versions
published by a signed run of a small Llama (``TinyRun``).

Bit-exactness: a second, stock actor (no backend) is refit densely with vLLM's own
``reload_weights`` from the last version's checkpoint; ``compute_weight_checksums`` (sha256
of each parameter's bytes) must be equal for every parameter the stock engine keeps plain,
and greedy generations with top-5 logprobs identical (they run the packed kernels).
Controls: the stock engine's checksums before its reload, and ours one version earlier,
differ.  Marked by hand (``vllm``)."""
import time

import pytest
import ray

from nemo_dcr.runtimes.vllm.controller import Controller, RayEngineClient
from nemo_dcr_testbed import vllm_serve
from nemo_dcr_testbed.vllm_ray import start_engine
from nemo_dcr_testbed.vllm_serve import EMPTY, TinyRun

pytestmark = pytest.mark.vllm
PROMPTS = [[1, 2, 3], [5, 6, 7, 8]]
LONG = 150  # tokens of the completion kept in flight across each refit


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-ray")
    run = TinyRun(str(work / "run"), ack_timeout_s=30.0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ours = start_engine(run.init_dir, cpu="0")
        stock = start_engine(run.init_dir, backend=False, cpu="1")
        ray.get([ours.get_weight_version.remote(), stock.get_weight_version.remote()], timeout=600)
        yield run, ours, stock, str(work / "status.json")
    finally:
        ray.shutdown()


def test_an_asyncllm_ray_actor_takes_versions_bit_exact_and_tagged(engines):
    run, ours, stock, status = engines
    client = RayEngineClient(ours, status_path=status)
    ctl = Controller([client], run_id=run.run_id)
    ctl.init([run.init_info("e0", status)])
    label, checksums = "default", {}
    for v in (1, 2):
        run.step(0.03)
        flight = ours.generate.remote(PROMPTS[0], LONG, tag=f"v{v}")
        deadline = time.monotonic() + 60
        while ray.get(ours.progress.remote(f"v{v}")) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        publish = run.publish()
        (result,) = ctl.refit(v)
        publish.join(60)
        assert publish.stats.committed and result.ok, (publish.stats, result)
        assert result.weight_version == f"{run.run_id}:{v}" and result.staged_s is not None
        assert client.weight_version() == result.weight_version
        # the completion crossed the refit: two contiguous spans, the old version then the new
        spans = ray.get(flight, timeout=300)["weight_versions"]
        assert [s["version"] for s in spans] == [label, result.weight_version], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == LONG
        label = result.weight_version
        checksums[v] = client.checksums()
    stock_client = RayEngineClient(stock)
    before = stock_client.checksums()
    ray.get(stock.reload_weights.remote(run.dense_dir("dense-v2")), timeout=600)
    want = stock_client.checksums()
    assert checksums[2].keys() == want.keys()
    assert vllm_serve.differing(checksums[2], want) == []
    assert sum(d != EMPTY for d in want.values()) >= 5  # embeddings, norms, lm_head: compared
    assert vllm_serve.differing(checksums[1], want)  # control: one version earlier is not this one
    assert vllm_serve.differing(before, want)  # control: the stock engine's reload changed it
    for p in PROMPTS:
        a, b = ray.get([ours.generate.remote(p, 16, 5), stock.generate.remote(p, 16, 5)], timeout=300)
        assert (a["token_ids"], a["logprobs"]) == (b["token_ids"], b["logprobs"])
