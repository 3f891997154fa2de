"""``make demo ARGS="receiver.runtime=vllm_serve"``: the demo's trainer (megatron-core, TP=2
on gloo) refits a ``vllm serve`` engine with the nemo_dcr backend, driven by the product's
controller with a completion in flight across every refit (``demo_serve.py``).  Every version
must be committed, taken by the engine, and equal -- ``/weight_checker`` checksums of every
plain parameter and greedy generations with top-5 logprobs -- to a stock engine refit densely
from the trainer's export with vLLM's own ``reload_weights``; every completion's spans must
name the versions it crossed.  The comparison carries its own negative control per version
(the stock engine before its reload, one version earlier, must differ).  TP=2 engines are covered by
those tests and were run by hand through the demo (docs/design.md)."""
import pytest

from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config

pytestmark = pytest.mark.vllm


def test_the_demo_refits_a_vllm_serve_engine_checksum_equal_with_spans(tmp_path):
    summary = demo.run(load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store",
                                         "receiver.runtime=vllm_serve", "steps=2"]))
    assert summary["runtime"] == "vllm_serve" and summary["verified"]
    assert summary["refits"] == summary["committed"] == summary["refits_taken"] == 2, summary
    assert summary["checksums_equal"] == summary["bit_exact"] == 2, summary
    assert summary["weight_version_spans_ok"] is True
    assert 0 < summary["generation_pause_s_max"] < 60
