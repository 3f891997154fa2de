"""megatron-core training on CPU in the layouts the refit hook must read (2 ranks each, gloo):

* ``ep2``: qwen3_moe (4 experts, top-2, q/k RMSNorm), expert parallelism 2 (TP=1, DP=2);
* ``tied_pp2``: llama with ``share_embeddings_and_output_weights`` and PP=2;
* ``distopt_dp2``: llama with megatron's distributed optimizer, DP=2;
* ``uneven_pp2``: qwen3, 3 layers on PP=2 stages of 1 and 2 layers.

Tiny models (hidden 64, seq 16), 3 steps each.  Bit comparisons use the workers' SHA-256 of
``t.view(torch.int16)``.  EP x TP is not here: megatron refuses MoE with TP > 1 without
sequence parallelism, which the local spec's norm refuses (``test_megatron_config``).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from nemo_dcr_testbed.model import ModelConfig, padded_vocab_size

from test_megatron_training import VOCAB, _all_records, _print_layout, launch, tiling_errors

pytestmark = pytest.mark.slow  # multi-process (torchrun); each launch ~10-20 s

TINY = ("--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "16")
EXPERTS = 4


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> list[dict]:
    return launch(
        tmp_path_factory.mktemp("ep2"), nproc=2, tp=1, pp=1, hash_seed="11",
        extra=(*TINY, "--num-layers", "2", "--family", "qwen3_moe", "--num-moe-experts",
               str(EXPERTS), "--moe-router-topk", "2", "--ep", "2"),
    )


@pytest.fixture(scope="module")
def tied_pp2(tmp_path_factory) -> list[dict]:
    return launch(
        tmp_path_factory.mktemp("tied"), nproc=2, tp=1, pp=2, hash_seed="12",
        extra=(*TINY, "--num-layers", "2", "--tie", "--num-microbatches", "2"),
    )


@pytest.fixture(scope="module")
def distopt_dp2(tmp_path_factory) -> list[dict]:
    return launch(
        tmp_path_factory.mktemp("distopt"), nproc=2, tp=1, pp=1, hash_seed="13",
        extra=(*TINY, "--num-layers", "2", "--dist-opt"),
    )


@pytest.fixture(scope="module")
def uneven_pp2(tmp_path_factory) -> list[dict]:
    return launch(
        tmp_path_factory.mktemp("uneven"), nproc=2, tp=1, pp=2, hash_seed="14",
        extra=(*TINY, "--num-layers", "3", "--family", "qwen3", "--first-stage-layers", "1",
               "--num-microbatches", "2"),
    )


def _trains(ranks: list[dict]) -> None:
    """Finite identical losses, successful updates, params changed every step and seen by the
    hook, BF16 == its FP32 master (or master slice) rounded, masters finer than BF16."""
    losses = [[s["loss"] for s in r["steps"]] for r in ranks]
    assert len(losses[0]) == 3 and all(lr == losses[0] for lr in losses)
    assert all(isinstance(x, float) and math.isfinite(x) and abs(x - math.log(VOCAB)) < 0.5
               for x in losses[0])
    for r in ranks:
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["master_dtypes"] == ["torch.float32"]
        prev = r["initial_digests"]
        for s in r["steps"]:
            assert s["update_successful"]
            assert 0 < sum(s["changed"].values()) < 0.5 * sum(s["numel"].values())
            assert s["hook_digests"] == s["digests"] != prev
            prev = s["digests"]
            bad = [n for n, ok in s["bf16_is_rounded_master"].items() if not ok]
            assert s["bf16_is_rounded_master"] and not bad, (r["rank"], s["step"], bad)
            assert s["master_finer_than_bf16"] > 0


def _tiles(ranks: list[dict]) -> None:
    records = _all_records(ranks)
    assert tiling_errors(records) == []
    for r in ranks:  # every BF16 parameter of the rank is reachable from the metadata
        assert {rec["param_storage"] for rec in r["layout"] if "key" in rec} == set(r["initial_digests"])


# ---- expert parallelism ---------------------------------------------------------------------


_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")


def test_ep2_trains_three_steps(ep2):
    _trains(ep2)
    assert sorted(r["ep_rank"] for r in ep2) == [0, 1]
    assert sorted(r["dp_rank"] for r in ep2) == [0, 1]


def test_ep2_each_rank_holds_its_share_of_the_experts(ep2):
    for r in ep2:
        local = {}
        for n in r["initial_digests"]:
            m = _EXPERT.match(n)
            if m:
                local.setdefault(int(m[1]), set()).add(int(m[2]))
        assert local == {0: {0, 1}, 1: {0, 1}}  # num_experts / EP = 2 local experts per layer
        assert any(n.endswith("self_attention.q_layernorm.weight") for n in r["initial_digests"])
        assert any(n.endswith("mlp.router.weight") for n in r["initial_digests"])
        # The global expert index of each local expert, from the sharded metadata: rank e holds
        # experts 2e, 2e+1 (prepend axes: layer, expert).
        fc2 = [rec for rec in r["layout"] if "key" in rec and rec["key"].endswith("experts.linear_fc2.weight")]
        assert {tuple(rec["global_offset"][:2]) for rec in fc2} == {
            (layer, 2 * r["ep_rank"] + j) for layer in (0, 1) for j in (0, 1)
        }


def test_ep2_dense_params_replicated_experts_differ(ep2):
    a, b = sorted(ep2, key=lambda r: r["rank"])
    dense = [n for n in a["initial_digests"] if not _EXPERT.match(n)]
    experts = [n for n in a["initial_digests"] if _EXPERT.match(n)]
    assert dense and experts and set(dense + experts) == set(b["initial_digests"])
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        for n in dense:  # data-parallel replicas (router, attention, norms, embedding, output)
            assert sa["digests"][n] == sb["digests"][n], (sa["step"], n)
            assert sa["master_digests"][n] == sb["master_digests"][n], (sa["step"], n)
        # Control: the same local name is a different expert on the two EP ranks.
        assert all(sa["digests"][n] != sb["digests"][n] for n in experts)


def test_ep2_sharded_layout_tiles_each_tensor_once(ep2):
    _print_layout(ep2)
    _tiles(ep2)


# ---- tied embeddings across pipeline stages ---------------------------------------------------


def test_tied_pp2_output_layer_is_bit_identical_to_the_embedding(tied_pp2):
    _trains(tied_pp2)
    first = next(r for r in tied_pp2 if r["pp_rank"] == 0)
    last = next(r for r in tied_pp2 if r["pp_rank"] == 1)
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    assert emb in first["initial_digests"] and out not in first["initial_digests"]
    assert out in last["initial_digests"] and emb not in last["initial_digests"]
    assert first["initial_digests"][emb] == last["initial_digests"][out]
    prev = None
    for sf, sl in zip(first["steps"], last["steps"], strict=True):
        assert sf["digests"][emb] == sl["digests"][out], sf["step"]
        assert sf["master_digests"][emb] == sl["master_digests"][out], sf["step"]
        assert sf["digests"][emb] != prev  # control: the tied weight moves every step
        prev = sf["digests"][emb]
        # Control: the digests discriminate (another param of the first stage differs).
        assert sf["digests"]["decoder.layers.0.self_attention.linear_qkv.weight"] != sf["digests"][emb]


def test_tied_pp2_sharded_layout(tied_pp2):
    _print_layout(tied_pp2)
    _tiles(tied_pp2)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64)
    last = next(r for r in tied_pp2 if r["pp_rank"] == 1)
    out = [rec for rec in last["layout"] if rec.get("sd_name") == "output_layer.weight"]
    assert len(out) == 1
    # The last stage's copy is a non-main replica of the embedding's key.
    assert out[0]["key"] == "embedding.word_embeddings.weight"
    assert out[0]["global_shape"] == [padded_vocab_size(cfg, 1), 64]
    assert any(int(x) != 0 for x in out[0]["replica_id"])


# ---- distributed optimizer ------------------------------------------------------------------


def test_distopt_dp2_params_identical_across_dp_and_rounded_masters(distopt_dp2):
    _trains(distopt_dp2)
    a, b = sorted(distopt_dp2, key=lambda r: r["dp_rank"])
    assert (a["dp_rank"], b["dp_rank"]) == (0, 1)
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        # After optimizer.step() (param all-gather inside step), in the hook, on EVERY rank.
        assert sa["digests"] == sb["digests"], sa["step"]
        assert sa["hook_digests"] == sb["hook_digests"] == sa["digests"]
        # The masters are partitioned: each element of each param on exactly one DP rank.
        for n, numel in sa["numel"].items():
            ranges = sorted(
                tuple(x) for x in (sa["master_ranges"].get(n), sb["master_ranges"].get(n)) if x
            )
            covered = [i for lo, hi in ranges for i in range(lo, hi)]
            assert sorted(covered) == list(range(numel)), (sa["step"], n, ranges)
        # Control: neither rank holds every master whole (it is really distributed).
        for s in (sa, sb):
            assert sum(hi - lo for lo, hi in s["master_ranges"].values()) < sum(s["numel"].values())


def test_distopt_dp2_sharded_layout(distopt_dp2):
    _tiles(distopt_dp2)


# ---- uneven pipeline stages -------------------------------------------------------------------


def test_uneven_pp2_stages_hold_one_and_two_layers(uneven_pp2):
    _trains(uneven_pp2)
    for r in uneven_pp2:
        layers = {int(n.split(".")[2]) for n in r["initial_digests"] if n.startswith("decoder.layers.")}
        offsets = {rec["global_offset"][0] for rec in r["layout"]
                   if "key" in rec and rec["key"].startswith("decoder.layers.")}
        expected = {0} if r["pp_rank"] == 0 else {1, 2}
        # Local module names restart at 0 on each stage; the metadata carries the global index.
        assert len(layers) == len(expected) and offsets == expected, (r["pp_rank"], layers, offsets)
        assert any(n.endswith("k_layernorm.weight") for n in r["initial_digests"])
    _tiles(uneven_pp2)
