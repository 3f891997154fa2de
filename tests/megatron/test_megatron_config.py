"""Pure-Python checks of the megatron configs and the data stream (no megatron import)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_dcr_testbed.model import ModelConfig, padded_vocab_size
from nemo_dcr_testbed.train import TrainConfig, token_batch


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_attention_heads": 4, "num_query_groups": 3}, "num_query_groups"),
        ({"hidden_size": 130, "num_attention_heads": 4}, "hidden_size"),
        ({"hidden_size": 12, "num_attention_heads": 4, "num_query_groups": 4}, "even"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"norm_epsilon": 0.0}, "norm_epsilon"),
        ({"seed": -1}, "seed"),
    ],
)
def test_model_config_rejects_inconsistent_shapes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_model_config_rejects_non_int_and_is_frozen_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(hidden_size=128.0)
    with pytest.raises(TypeError):
        ModelConfig(2)  # type: ignore[misc]
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 64  # type: ignore[misc]
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads


@pytest.mark.parametrize(
    "tp, pp, match",
    [(3, 1, "num_query_groups"), (4, 1, "num_attention_heads"), (1, 3, "num_layers"), (0, 1, ">= 1")],
)
def test_parallel_layout_must_divide_the_model(tp, pp, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(num_attention_heads=6, num_query_groups=2, hidden_size=96).check_parallel(tp=tp, pp=pp)


@pytest.mark.parametrize("vocab", [1, 127, 128, 129, 1000, 32000, 50257])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocab_is_the_smallest_multiple_of_128_tp(vocab, tp):
    padded = padded_vocab_size(ModelConfig(vocab_size=vocab), tp)
    unit = 128 * tp
    assert padded % unit == 0 and vocab <= padded < vocab + unit


def test_token_batch_is_a_pure_function_and_labels_are_shifted():
    kw = dict(data_seed=3, step=2, microbatch=1, micro_batch_size=2, seq_length=16, vocab_size=50)
    t1, l1 = token_batch(**kw)
    torch.manual_seed(999)  # the global generator must not matter
    t2, l2 = token_batch(**kw)
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    assert t1.shape == l1.shape == (2, 16) and t1.dtype == torch.int64
    assert torch.equal(t1[:, 1:], l1[:, :-1])
    assert 0 <= int(t1.min()) and int(t1.max()) < 50
    other, _ = token_batch(**dict(kw, step=3))
    assert not torch.equal(t1, other)


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0.0}, {"lr": float("nan")}, {"adam_beta2": 1.0}, {"micro_batch_size": 0},
     {"clip_grad": -1.0}, {"num_microbatches": 0}],
)
def test_train_config_validation(kwargs):
    with pytest.raises(ValueError):
        TrainConfig(**kwargs)


def test_cpu_shim_refuses_where_cuda_is_available_and_patches_nothing(monkeypatch):
    from nemo_dcr_testbed import cpu_shim

    if cpu_shim.is_applied():
        pytest.skip("the shim was applied in this process by an earlier test")
    originals = {name: getattr(torch.cuda, name) for name in cpu_shim._TORCH_CUDA_FUNCTIONS}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cpu_shim.CpuShimError, match="CUDA is available"):
        cpu_shim.apply()
    assert {name: getattr(torch.cuda, name) for name in originals} == originals
    assert not cpu_shim.is_applied()
    with pytest.raises(cpu_shim.CpuShimError, match="apply"):
        cpu_shim.seed_model_parallel_rng(0)


# ---- families, MoE, expert parallelism, uneven pipeline stages ---------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"family": "mistral"}, "family"),
        ({"family": "qwen3_moe"}, "num_moe_experts"),
        ({"family": "qwen3", "num_moe_experts": 4}, "num_moe_experts"),
        ({"family": "qwen3_moe", "num_moe_experts": 4, "moe_router_topk": 5}, "moe_router_topk"),
        ({"family": "qwen3_moe", "num_moe_experts": 4, "moe_router_topk": 0}, "moe_router_topk"),
        ({"family": "llama", "moe_ffn_hidden_size": 64}, "moe_ffn_hidden_size"),
        ({"num_moe_experts": -1}, "num_moe_experts"),
    ],
)
def test_model_config_rejects_inconsistent_families(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_model_config_family_properties_and_types():
    moe = ModelConfig(family="qwen3_moe", num_moe_experts=4, moe_ffn_hidden_size=96)
    assert moe.is_moe and moe.qk_layernorm and moe.expert_ffn_hidden_size == 96
    assert ModelConfig(family="qwen3_moe", num_moe_experts=4).expert_ffn_hidden_size == 256
    assert ModelConfig(family="qwen3").qk_layernorm and not ModelConfig(family="qwen3").is_moe
    assert not ModelConfig().qk_layernorm
    with pytest.raises(TypeError):
        ModelConfig(share_embeddings_and_output_weights=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ModelConfig(family=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TrainConfig(use_distributed_optimizer="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg, kw, match",
    [
        (ModelConfig(), {"ep": 2}, "MoE"),
        (ModelConfig(family="qwen3_moe", num_moe_experts=6), {"ep": 4}, "num_moe_experts"),
        (ModelConfig(family="qwen3_moe", num_moe_experts=4, moe_ffn_hidden_size=5), {"tp": 2},
         "expert_ffn_hidden_size"),
        (ModelConfig(), {"ep": 0}, ">= 1"),
        (ModelConfig(num_layers=4), {"pp": 1, "first_stage_layers": 1}, "pp >= 2"),
        (ModelConfig(num_layers=4), {"pp": 2, "first_stage_layers": 4}, "split evenly"),
        (ModelConfig(num_layers=4), {"pp": 2, "first_stage_layers": 1, "last_stage_layers": 2},
         "split evenly"),
        (ModelConfig(num_layers=5), {"pp": 3, "first_stage_layers": 2}, "split evenly"),
    ],
)
def test_check_parallel_rejects_bad_expert_and_stage_layouts(cfg, kw, match):
    kw = {"tp": 1, "pp": 1, **kw}
    with pytest.raises(ValueError, match=match):
        cfg.check_parallel(**kw)


@pytest.mark.parametrize(
    "num_layers, pp, first, last, expected",
    [
        (4, 2, 0, 0, (2, 2)),
        (4, 2, 1, 0, (1, 3)),
        (4, 2, 0, 1, (3, 1)),
        (4, 2, 3, 1, (3, 1)),
        (6, 3, 1, 1, (1, 4, 1)),
        (7, 3, 3, 0, (3, 2, 2)),
    ],
)
def test_stage_layer_counts(num_layers, pp, first, last, expected):
    from nemo_dcr_testbed.model import stage_layer_counts

    counts = stage_layer_counts(num_layers, pp, first_stage_layers=first, last_stage_layers=last)
    assert counts == expected and sum(counts) == num_layers
    ModelConfig(num_layers=num_layers).check_parallel(
        tp=1, pp=pp, first_stage_layers=first, last_stage_layers=last
    )


def test_moe_with_tensor_parallelism_is_refused_with_the_reason():
    cfg = ModelConfig(family="qwen3_moe", num_moe_experts=4)
    with pytest.raises(ValueError, match="sequence parallelism"):
        cfg.check_parallel(tp=2, pp=1, ep=2)
    cfg.check_parallel(tp=1, pp=2, ep=4)


def test_demo_config_parallel_expert_and_stage_fields_round_trip():
    from nemo_dcr_testbed.config import DemoConfig, ParallelConfig

    moe = ModelConfig(family="qwen3_moe", num_moe_experts=4, num_layers=3)
    cfg = DemoConfig(
        model=moe,
        train=TrainConfig(use_distributed_optimizer=True),
        parallel=ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                data_parallel_size=2, expert_model_parallel_size=2),
    )
    again = DemoConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.parallel.world_size == 2
    # Old dicts (no new keys) still load, with the defaults.
    d = cfg.to_dict()
    for k in ("expert_model_parallel_size", "num_layers_in_first_pipeline_stage",
              "num_layers_in_last_pipeline_stage"):
        del d["parallel"][k]
    del d["train"]["use_distributed_optimizer"]
    d["model"] = dataclasses.asdict(ModelConfig())
    old = DemoConfig.from_dict(d)
    assert old.parallel.expert_model_parallel_size == 1 and not old.train.use_distributed_optimizer
    with pytest.raises(ValueError, match="must divide data_parallel_size"):
        ParallelConfig(tensor_model_parallel_size=1, data_parallel_size=3, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="num_moe_experts"):
        DemoConfig(model=ModelConfig(family="qwen3_moe", num_moe_experts=3),
                   parallel=ParallelConfig(tensor_model_parallel_size=1, data_parallel_size=2,
                                           expert_model_parallel_size=2))
    with pytest.raises(ValueError, match="split evenly"):
        DemoConfig(model=ModelConfig(num_layers=3),
                   parallel=ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                           num_layers_in_first_pipeline_stage=3))
    DemoConfig(model=ModelConfig(num_layers=3),
               parallel=ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                       num_layers_in_first_pipeline_stage=1))
    with pytest.raises(TypeError):
        ParallelConfig(expert_model_parallel_size=True)  # type: ignore[arg-type]
