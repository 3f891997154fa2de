"""The two implementations of every layout transform agree, on hand-made TP shardings.

Global tensors hold their own flat index as value, so after the dense transform every
canonical element says which global element it came from; the sparse projection of a
shard's local indices must point at canonical elements carrying exactly those global
indices.  (The logits test in tests/integration checks the table against real models.)
"""
import itertools

import numpy as np
import pytest
import torch

from nemo_dcr.layout.llama import LLAMA_RULES
from nemo_dcr.layout.mapping import CanonicalProjector, Identity, ModelDims, RowHalves, UnmappedKeyError
from nemo_dcr.layout.shards import ShardSpec


def _dims(heads, groups, d, layers=3, vocab=37, ffn=24):
    return ModelDims(num_layers=layers, hidden_size=heads * d, num_attention_heads=heads,
                     num_query_groups=groups, head_dim=d, ffn_hidden_size=ffn, vocab_size=vocab)


def _global_shapes(dims: ModelDims, padded_vocab: int):
    h, L = dims.hidden_size, dims.num_layers
    qkv = (dims.num_attention_heads + 2 * dims.num_query_groups) * dims.head_dim
    return {
        "embedding.word_embeddings.weight": (padded_vocab, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
        "decoder.layers.self_attention.linear_qkv.weight": (L, qkv, h),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, dims.num_attention_heads * dims.head_dim),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),
        "decoder.layers.mlp.linear_fc1.weight": (L, 2 * dims.ffn_hidden_size, h),
        "decoder.layers.mlp.linear_fc2.weight": (L, h, dims.ffn_hidden_size),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (padded_vocab, h),
    }


def _shards(key, gshape, tp, split_axis):
    """TP shards of a global tensor along split_axis (layer axis prepended for stacked keys);
    split_axis None = replicated on every TP rank (main replica on rank 0 only)."""
    layered = key.startswith("decoder.layers.")
    p = 1 if layered else 0
    body = gshape[p:]
    layers = range(gshape[0]) if layered else [None]
    for layer, r in itertools.product(layers, range(tp)):
        local = list(body)
        off = [0] * len(body)
        if split_axis is not None:
            local[split_axis] //= tp
            off[split_axis] = r * local[split_axis]
        yield ShardSpec(key=key, local_shape=tuple(local), global_shape=gshape,
                        global_offset=((layer,) if layered else ()) + tuple(off),
                        prepend_axis_num=p, replica_id=(0, 0 if split_axis is not None else r, 0),
                        dtype="bfloat16")


SPLIT = {  # Megatron's TP split axis per key (body axes, after the layer axis)
    "embedding.word_embeddings.weight": 0,
    "decoder.layers.self_attention.linear_qkv.weight": 0,
    "decoder.layers.self_attention.linear_proj.weight": 1,
    "decoder.layers.mlp.linear_fc1.weight": 0,  # GLU factory: 2*TP row fragments (gates, then ups)
    "decoder.layers.mlp.linear_fc2.weight": 1,
    "output_layer.weight": 0,
}


@pytest.mark.parametrize("heads,groups,d,tp", [(4, 2, 8, 2), (8, 8, 4, 4), (6, 2, 4, 2), (4, 1, 8, 1)])
def test_sparse_projection_matches_dense_transform(heads, groups, d, tp):
    dims = _dims(heads, groups, d)
    padded = 48
    proj = CanonicalProjector(LLAMA_RULES, dims)
    seen: dict[str, np.ndarray] = {}
    for key, gshape in _global_shapes(dims, padded).items():
        numel = int(np.prod(gshape))
        g = torch.arange(numel, dtype=torch.int64).reshape(gshape)
        dense = {n: t.contiguous().reshape(-1).numpy() for n, t in proj.dense(key, g).items()}
        for n, arr in dense.items():
            seen.setdefault(n, np.zeros(arr.size, np.int64))
        tp_key = 2 * tp if key.endswith("linear_fc1.weight") else tp
        for spec in _shards(key, gshape, tp_key, SPLIT.get(key)):
            if not spec.is_main_replica:
                continue
            local = np.arange(spec.numel, dtype=np.int64)
            gflat = np.ravel_multi_index(tuple(spec.global_index(local).T), gshape)
            for cspec, cflat, sel in proj.project(spec, local):
                np.testing.assert_array_equal(dense[cspec.name][cflat], gflat[sel])
                assert dense[cspec.name].size == int(np.prod(cspec.shape))
                seen[cspec.name][cflat] += 1
    # every canonical element is produced exactly once; padding rows are dropped
    for name, count in seen.items():
        assert np.all(count == 1), name
    assert seen["model.embed_tokens.weight"].size == dims.vocab_size * dims.hidden_size
    assert seen["model.layers.2.self_attn.k_proj.weight"].size == groups * d * dims.hidden_size


def test_projection_negative_control_wrong_group_count_is_caught():
    """Projecting with the wrong number of query groups must disagree with the truth."""
    right, wrong = _dims(4, 2, 8), _dims(4, 1, 8)
    key = "decoder.layers.self_attention.linear_qkv.weight"
    gshape = _global_shapes(right, 48)[key]
    spec = next(_shards(key, gshape, 1, 0))
    local = np.arange(spec.numel, dtype=np.int64)
    good = {c.name: f for c, f, _ in CanonicalProjector(LLAMA_RULES, right).project(spec, local)}
    with pytest.raises(ValueError):
        list(CanonicalProjector(LLAMA_RULES, wrong).project(spec, local))
    assert set(good) == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}


def test_unmapped_key_is_a_clear_error():
    proj = CanonicalProjector(LLAMA_RULES, _dims(4, 2, 8))
    spec = ShardSpec(key="decoder.layers.mlp.router.weight", local_shape=(4,), global_shape=(1, 4),
                     global_offset=(0, 0), prepend_axis_num=1, replica_id=(0,), dtype="bfloat16")
    with pytest.raises(UnmappedKeyError, match="router"):
        list(proj.project(spec, np.arange(4)))


def test_shard_spec_validates_offsets():
    with pytest.raises(ValueError):
        ShardSpec(key="k", local_shape=(4, 4), global_shape=(6, 4), global_offset=(4, 0),
                  prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")


@pytest.mark.parametrize("heads,groups,d,tp,block", [(4, 2, 8, 2, 7), (6, 2, 4, 2, 1 << 20), (4, 1, 8, 1, 5)])
def test_canonical_runs_invert_the_projection(heads, groups, d, tp, block):
    """Runs rebuild the canonical base of any range they cover contiguously, whatever the
    block size they were computed in (small blocks split runs, which must merge again)."""
    from nemo_dcr.layout.runs import canonical_runs
    from nemo_dcr.layout.shards import ParamView

    dims = _dims(heads, groups, d)
    proj = CanonicalProjector(LLAMA_RULES, dims)
    contiguous: dict[str, bool] = {}
    for key, gshape in _global_shapes(dims, 48).items():
        g = torch.arange(int(np.prod(gshape)), dtype=torch.int64).reshape(gshape)
        dense = {n: t.contiguous().reshape(-1).numpy() for n, t in proj.dense(key, g).items()}
        tp_key = 2 * tp if key.endswith("linear_fc1.weight") else tp
        for spec in _shards(key, gshape, tp_key, SPLIT.get(key)):
            if not spec.is_main_replica:
                continue
            view = ParamView(param_name="p", start=3, spec=spec)  # the view starts inside its param
            local_vals = np.ravel_multi_index(tuple(spec.global_index(np.arange(spec.numel)).T), gshape)
            param_bits = np.concatenate(([-1, -1, -1], local_vals))
            for name, runs in canonical_runs(proj, view, block=block).items():
                contiguous[name] = contiguous.get(name, True) and runs.contiguous
                if not runs.contiguous:
                    with pytest.raises(ValueError):
                        runs.fill(np.zeros(dense[name].size, np.int64), param_bits, runs.lo, runs.hi)
                    continue
                dst = np.full(dense[name].size, -7, np.int64)
                lo, hi = runs.lo + 1, max(runs.lo + 1, runs.hi - 2)  # a sub-range
                runs.fill(dst, param_bits, lo, hi)
                np.testing.assert_array_equal(dst[lo:hi], dense[name][lo:hi])
                assert np.all(dst[:lo] == -7) and np.all(dst[hi:] == -7)  # nothing outside
    # column-parallel, vocabulary and replicated tensors are contiguous per rank;
    # row-parallel ones are strided (one run per row) unless TP=1
    assert contiguous["model.layers.0.self_attn.q_proj.weight"]
    assert contiguous["model.embed_tokens.weight"] and contiguous["model.norm.weight"]
    assert contiguous["model.layers.0.self_attn.o_proj.weight"] == (tp == 1)
    assert contiguous["model.layers.0.mlp.down_proj.weight"] == (tp == 1)


@pytest.mark.parametrize("transform,shape", [(Identity(), (6, 5)), (RowHalves(), (8, 3)), (Identity(), (7,))])
def test_whole_shard_shortcut_matches_the_multi_index_projection(transform, shape):
    """A shard that is its whole source tensor projects from flat indices
    (``Transform.project_whole``); it must agree with ``project`` on multi-indices.
    Negative control: a shortcut that splits by rows instead of elements is seen."""
    dims = _dims(4, 2, 8)
    flat = np.array([0, 1, int(np.prod(shape)) // 2 - 1, int(np.prod(shape)) // 2, int(np.prod(shape)) - 1])
    idx = np.stack(np.unravel_index(flat, shape), axis=1)
    part, cflat = transform.project(idx, shape, dims)
    fast_part, fast_flat = transform.project_whole(flat, shape)
    np.testing.assert_array_equal(np.zeros_like(part) if fast_part is None else fast_part, part)
    np.testing.assert_array_equal(fast_flat, cflat)
    if fast_part is not None:
        wrong = (flat >= shape[0] // 2).astype(np.int64)  # rows, not elements: wrong
        assert not np.array_equal(wrong, part)
