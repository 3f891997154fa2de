"""Every model family and parallel layout the hook supports refits bit-exactly.

Each case runs the whole pipeline (``nemo-dcr demo``: megatron-core trainer ranks under
torchrun, the hook built by ``MegatronRefitHook.from_model``, a transformers receiver
process updated in place) for 3 steps.  After every step the receiver's dump of ALL its
parameters and buffers must equal, on integer views, a model that transformers itself
loads with ``from_pretrained`` from the trainer's dense export of that step (full Megatron
tensors gathered and converted with the dense transforms -- never the sparse path; for
MoE, transformers' own checkpoint conversion fuses the per-expert tensors).  Non-vacuous:
consecutive versions differ, and test_refit_e2e.py flips a bit as the negative control.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nemo_dcr.protocol.manifest import Manifest, dense_key, manifest_key
from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config
from nemo_dcr.transport.store import LocalDirStore

from .test_refit_e2e import SMALL, bit_differences

STEPS = 3
MOE = ["model.family=qwen3_moe", "model.num_moe_experts=4", "model.moe_router_topk=2",
       "model.moe_ffn_hidden_size=64"]
TP1 = ["parallel.tensor_model_parallel_size=1"]

LAYOUTS = {
    "qwen3-tp2": ["model.family=qwen3"],
    "qwen3_moe-ep2": [*MOE, *TP1, "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"],
    "llama-tied-pp2": ["model.share_embeddings_and_output_weights=true", *TP1,
                       "parallel.pipeline_model_parallel_size=2"],
    "llama-distopt-dp2": [*TP1, "parallel.data_parallel_size=2", "train.use_distributed_optimizer=true"],
    "qwen3-uneven-pp2": ["model.family=qwen3", "model.num_layers=3", *TP1, "parallel.pipeline_model_parallel_size=2",
                         "parallel.num_layers_in_first_pipeline_stage=1"],
}
SLOW_LAYOUTS = {  # 4 ranks on 2 cores.  (No EP x TP: megatron's MoE layer needs sequence
    # parallelism for TP > 1 in training, and its only non-TE RMSNorm refuses sequence
    # parallelism -- see docs/megatron-on-cpu.md.)
    "llama-tp2-pp2": ["parallel.pipeline_model_parallel_size=2"],
    # EP=2 inside DP=4: each expert has an expert-data-parallel replica that must not emit
    "qwen3_moe-ep2-expert_dp2": [*MOE, *TP1, "parallel.data_parallel_size=4", "parallel.expert_model_parallel_size=2"],
}


def transformers_dense_state(store_dir, version: int, work) -> dict[str, torch.Tensor]:
    """transformers' own ``from_pretrained`` of the dense export of ``version``."""
    from transformers import AutoModelForCausalLM

    from nemo_dcr.receiver.verify import module_state

    d = work / f"dense-v{version}"
    d.mkdir()
    shutil.copy(store_dir / "init" / "config.json", d / "config.json")
    shutil.copy(store_dir / dense_key(version), d / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, local_files_only=True)
    return {k: v.detach().clone() for k, v in module_state(model).items()}


def _run_layout(tmp_path, overrides):
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"steps={STEPS}", *SMALL,
                            "train.lr=3e-6", "refit.verify_dense=true", f"refit.receiver_dump_dir={tmp_path}/dump",
                            *overrides])
    summary = demo.run(cfg)
    assert summary["refits"] == STEPS and summary["committed"] == STEPS and summary["bit_exact"] == STEPS, summary
    previous = None
    for v in range(1, STEPS + 1):
        received = load_file(str(tmp_path / "dump" / "r0" / f"v{v}.safetensors"))
        expected = transformers_dense_state(tmp_path / "store", v, tmp_path)
        assert len(received) == len(expected) > 0
        assert bit_differences(received, expected) == [], f"version {v}"
        if previous is not None:
            assert bit_differences(received, previous), f"version {v} changed nothing"
        previous = received
    return cfg, summary


def _check_emitters(tmp_path, summary):
    """Each canonical element is sent once: chunks of one version never repeat a tensor
    element range across ranks (replicas emit nothing)."""
    store = LocalDirStore(str(tmp_path / "store"))
    for v in range(1, STEPS + 1):
        m = Manifest.from_json(store.get(manifest_key(v)))
        assert m.chunks
    rows = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert all(r["changed"] <= r["canonical_numel"] for r in rows)
    return store, rows


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_refits_bit_exactly(tmp_path, layout):
    cfg, summary = _run_layout(tmp_path, LAYOUTS[layout])
    store, rows = _check_emitters(tmp_path, summary)
    assert summary["family"] == cfg.model.family
    assert summary["ep"] == cfg.parallel.expert_model_parallel_size
    config = json.loads((tmp_path / "store" / "init" / "config.json").read_text())
    if layout.startswith("qwen3_moe"):
        from transformers import AutoConfig

        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        assert AutoConfig.from_pretrained(str(tmp_path / "store" / "init")).num_experts == 4
        names = set(load_file(str(tmp_path / "store" / dense_key(1))))
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names  # published per-expert names
        # both expert-parallel ranks emit (their own experts); their DP replicas of the
        # dense parameters do not
        chunks = Manifest.from_json(store.get(manifest_key(1))).chunks
        assert {c.rank for c in chunks} == {0, 1}
    if "tied" in layout:
        assert config["tie_word_embeddings"] is True
        assert "lm_head.weight" not in set(load_file(str(tmp_path / "store" / dense_key(1))))
    if "distopt" in layout:
        assert summary["distributed_optimizer"] is True
        assert {c.rank for c in Manifest.from_json(store.get(manifest_key(1))).chunks} == {0}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(SLOW_LAYOUTS))
def test_four_rank_layout_refits_bit_exactly(tmp_path, layout):
    _run_layout(tmp_path, SLOW_LAYOUTS[layout])
    if "expert_dp2" in layout:  # ranks 0 and 1 hold experts 0-1 and 2-3; 2 and 3 are replicas
        store = LocalDirStore(str(tmp_path / "store"))
        for v in range(1, STEPS + 1):
            assert {c.rank for c in Manifest.from_json(store.get(manifest_key(v))).chunks} == {0, 1}
