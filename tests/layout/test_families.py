"""The MoE / Qwen3 tables and the family registry, on hand-made EP x TP shardings.

As in test_mapping.py, global tensors hold their own flat index, so every canonical element
says which Megatron element it came from: the sparse projection of each expert-parallel
shard must agree with the dense transform, every canonical element must be produced
exactly once, and the names must be the published per-expert ones.
"""
import itertools

import numpy as np
import pytest
import torch

from nemo_dcr.layout.families import FAMILIES, UnsupportedModelError, hf_config_fields, select_family
from nemo_dcr.layout.mapping import LAYER_EXPERT, CanonicalProjector, Identity, ModelDims, Rule
from nemo_dcr.layout.shards import ShardSpec, check_tiling

DIMS = ModelDims(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, head_dim=4,
                 ffn_hidden_size=24, vocab_size=37, num_moe_experts=4, moe_ffn_hidden_size=6,
                 moe_router_topk=2, qk_layernorm=True)
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


def _expert_shards(key, gshape, ep, tp, split_axis, glu):
    """Megatron's expert shards: layer and global expert prepended, experts split over EP
    ranks, TP split of the body (fc1 as 2*TP GLU row fragments)."""
    L, E = gshape[:2]
    body = gshape[2:]
    frags = 2 * tp if glu else tp
    for layer, e, f in itertools.product(range(L), range(E), range(frags)):
        local = list(body)
        off = [0] * len(body)
        local[split_axis] //= frags
        off[split_axis] = f * local[split_axis]
        yield ShardSpec(key=key, local_shape=tuple(local), global_shape=gshape, global_offset=(layer, e, *off),
                        prepend_axis_num=2, replica_id=(0, 0, 0), dtype="bfloat16")


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (4, 2)])
def test_expert_projection_matches_dense_and_covers_once(ep, tp):
    proj = CanonicalProjector(FAMILIES["qwen3_moe"].rules, DIMS)
    F, H, E, L = DIMS.moe_ffn_hidden_size, DIMS.hidden_size, DIMS.num_moe_experts, DIMS.num_layers
    shapes = {FC1: (L, E, 2 * F, H), FC2: (L, E, H, F)}
    seen = {}
    for key, gshape in shapes.items():
        g = torch.arange(int(np.prod(gshape)), dtype=torch.int64).reshape(gshape)
        dense = {n: t.contiguous().reshape(-1).numpy() for n, t in proj.dense(key, g).items()}
        specs = list(_expert_shards(key, gshape, ep, tp, 0 if key == FC1 else 1, key == FC1))
        check_tiling(specs)
        for spec in specs:
            local = np.arange(spec.numel, dtype=np.int64)
            gflat = np.ravel_multi_index(tuple(spec.global_index(local).T), gshape)
            for cspec, cflat, sel in proj.project(spec, local):
                np.testing.assert_array_equal(dense[cspec.name][cflat], gflat[sel])
                seen.setdefault(cspec.name, np.zeros(dense[cspec.name].size, np.int64))[cflat] += 1
    assert all(np.all(c == 1) for c in seen.values())
    expected = {f"model.layers.{l}.mlp.experts.{e}.{w}_proj.weight"
                for l in range(L) for e in range(E) for w in ("gate", "up", "down")}
    assert set(seen) == expected
    assert seen["model.layers.1.mlp.experts.3.gate_proj.weight"].size == F * H


def test_swapped_expert_axes_are_caught():
    """Negative control: reading the expert axis as the layer axis names other tensors."""
    gshape = (2, 4, 2 * DIMS.moe_ffn_hidden_size, DIMS.hidden_size)
    spec = next(s for s in _expert_shards(FC1, gshape, 1, 1, 0, True) if s.global_offset[:2] == (0, 3))
    right = {c.name for c in CanonicalProjector(FAMILIES["qwen3_moe"].rules, DIMS).canonical_specs(spec)}
    assert right == {"model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"}
    swapped = (Rule(FC1, {"": "model.layers.{expert}.mlp.experts.{layer}.w"}, Identity(), axes=LAYER_EXPERT[::-1]),)
    wrong = {c.name for c in CanonicalProjector(swapped, DIMS).canonical_specs(spec)}
    assert wrong.isdisjoint(right)


def test_rule_templates_must_use_exactly_the_prepended_axes():
    with pytest.raises(ValueError, match="prepended axes"):
        Rule(FC1, {"": "model.layers.{layer}.mlp.experts.w"}, Identity(), axes=LAYER_EXPERT)


def test_check_tiling_refuses_gaps_and_duplicates():
    gshape = (2, 4, 12, 16)
    specs = list(_expert_shards(FC1, gshape, 2, 1, 0, True))
    check_tiling(specs)
    with pytest.raises(ValueError, match="cover"):
        check_tiling(specs[1:])
    with pytest.raises(ValueError, match="emitted twice"):
        check_tiling(specs + specs[:1])


def test_family_selection_from_features():
    assert select_family(DIMS).name == "qwen3_moe"
    dense = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1, head_dim=4,
                      ffn_hidden_size=8, vocab_size=11)
    assert select_family(dense).name == "llama"
    assert select_family(ModelDims(**{**dense.__dict__, "qk_layernorm": True})).name == "qwen3"
    with pytest.raises(UnsupportedModelError, match="not a qwen3_moe"):
        select_family(dense, "qwen3_moe")
    with pytest.raises(UnsupportedModelError, match="unknown model family"):
        select_family(dense, "mixtral")
    moe_no_qk = ModelDims(**{**DIMS.__dict__, "qk_layernorm": False})
    with pytest.raises(UnsupportedModelError, match="no registered family"):
        select_family(moe_no_qk)


def test_hf_config_is_accepted_by_transformers():
    from transformers import AutoConfig

    for family in FAMILIES.values():
        dims = DIMS if family.moe else ModelDims(**{**DIMS.__dict__, "num_moe_experts": 0,
                                                     "qk_layernorm": family.qk_layernorm})
        fields = hf_config_fields(family, dims)
        cfg = AutoConfig.for_model(fields.pop("model_type"), **{k: v for k, v in fields.items()
                                                                if k != "architectures"})
        assert cfg.num_key_value_heads == 2 and cfg.vocab_size == 37
        if family.moe:
            assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 6)
            assert cfg.norm_topk_prob is True


def test_hf_config_states_the_rope_base_for_transformers_4_and_5():
    """transformers 5 reads ``rope_parameters``, 4.x the top-level ``rope_theta``: both must
    carry the model's base (a 4.x config class would otherwise default to 10000)."""
    from nemo_dcr.integrations.hf_export import hf_config
    from nemo_dcr.layout.families import FAMILIES
    from nemo_dcr.layout.mapping import ModelDims

    for base in (10000.0, 500000.0):
        dims = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=1, head_dim=32,
                         ffn_hidden_size=128, vocab_size=100, rotary_base=base)
        d = hf_config(FAMILIES["llama"], dims)
        assert d["rope_theta"] == base and d["rope_parameters"]["rope_theta"] == base
