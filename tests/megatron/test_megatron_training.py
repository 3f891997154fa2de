"""megatron-core training on CPU under torchrun (gloo): TP=2, and TP=2 x PP=2 on 4 ranks.

Three launches (module-scoped fixtures) feed all tests: TP=2 twice with the same seed (the
second run with another PYTHONHASHSEED) and TP=2 x PP=2 with two micro-batches.  Each rank of
``_worker.py`` records digests, change counts and the ``sharded_state_dict()`` metadata; the
tests compare what the ranks recorded.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from packaging.version import Version

from nemo_dcr_testbed.model import ModelConfig, padded_vocab_size

WORKER = Path(__file__).with_name("_worker.py")
LAUNCH_TIMEOUT_S = 240
VOCAB = 1000

pytestmark = pytest.mark.slow


def launch(out_dir: Path, *, nproc: int, tp: int, pp: int, hash_seed: str, extra=()) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(WORKER), str(out_dir),
        "--tp", str(tp), "--pp", str(pp), "--steps", "3", "--vocab-size", str(VOCAB), *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED=hash_seed)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(proc.stdout)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("tp2"), nproc=2, tp=2, pp=1, hash_seed="1")


@pytest.fixture(scope="module")
def tp2_again(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("tp2b"), nproc=2, tp=2, pp=1, hash_seed="2")


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory) -> list[dict]:
    return launch(
        tmp_path_factory.mktemp("tp2pp2"), nproc=4, tp=2, pp=2, hash_seed="3",
        extra=("--num-microbatches", "2"),
    )


def _check_losses(ranks: list[dict]) -> None:
    losses = [[s["loss"] for s in r["steps"]] for r in ranks]
    assert len(losses[0]) == 3
    for lr in losses:
        assert lr == losses[0], "every rank must report the same per-step loss"
    for loss in losses[0]:
        assert isinstance(loss, float) and math.isfinite(loss)
        # Uniform random labels and a near-uniform initial model: cross-entropy ~ ln(vocab).
        assert abs(loss - math.log(VOCAB)) < 0.5, loss
    assert all(s["update_successful"] for r in ranks for s in r["steps"])


def test_tp2_trains_three_steps(tp2):
    _check_losses(tp2)
    for r in tp2:
        assert r["param_dtypes"] == ["torch.bfloat16"]
        assert r["master_dtypes"] == ["torch.float32"]
        fractions = []
        for s in r["steps"]:
            frac = sum(s["changed"].values()) / sum(s["numel"].values())
            fractions.append(frac)
            # Something changed, and far from a dense rewrite of the BF16 bits.
            assert 0.0 < frac < 0.5, frac
        print(f"rank {r['rank']}: BF16 elements changed per step at lr 1e-5: "
              + ", ".join(f"{100 * f:.2f}%" for f in fractions))


def test_bf16_params_are_rounded_fp32_masters(tp2):
    for r in tp2:
        for s in r["steps"]:
            bad = [n for n, ok in s["bf16_is_rounded_master"].items() if not ok]
            assert not bad, f"step {s['step']}: BF16 != round(master) for {bad}"
            # The masters hold precision BF16 cannot: otherwise they would not be masters.
            assert s["master_finer_than_bf16"] > 0


def test_post_step_hook_sees_the_new_bits(tp2):
    for r in tp2:
        prev = r["initial_digests"]
        for s in r["steps"]:
            assert s["hook_digests"] == s["digests"], f"step {s['step']}"
            assert s["hook_digests"] != prev, "control: the step must have changed some bits"
            prev = s["digests"]


def _tp_replicated_identical(ranks: list[dict]) -> None:
    by_pp: dict[int, list[dict]] = {}
    for r in ranks:
        by_pp.setdefault(r["pp_rank"], []).append(r)
    for group in by_pp.values():
        assert len(group) == 2
        a, b = sorted(group, key=lambda r: r["tp_rank"])
        norms = [n for n in a["initial_digests"] if "layernorm" in n]
        assert norms
        prev = None
        for sa, sb in zip(a["steps"], b["steps"], strict=True):
            for n in norms:
                assert sa["digests"][n] == sb["digests"][n], (sa["step"], n)
                assert sa["master_digests"][n] == sb["master_digests"][n], (sa["step"], n)
            # Controls: the fp32 norm masters move every step (so equality is not vacuous),
            # and TP-split params differ between the ranks (so the digests discriminate).
            now = {n: sa["master_digests"][n] for n in norms}
            assert now != prev
            prev = now
            split = [n for n in a["initial_digests"] if "linear_qkv" in n]
            assert split and all(sa["digests"][n] != sb["digests"][n] for n in split)


def test_layer_norms_bit_identical_across_tp_ranks(tp2):
    _tp_replicated_identical(tp2)


def test_same_seed_gives_identical_bits(tp2, tp2_again):
    for a, b in zip(tp2, tp2_again, strict=True):
        assert a["initial_digests"] == b["initial_digests"]
        for sa, sb in zip(a["steps"], b["steps"], strict=True):
            assert sa["digests"] == sb["digests"], f"rank {a['rank']} step {sa['step']}"
            assert sa["master_digests"] == sb["master_digests"]
            assert sa["loss"] == sb["loss"]
        # Control: the digests are sensitive to the params (they change step to step).
        assert len({json.dumps(s["digests"], sort_keys=True) for s in a["steps"]}) == 3


# ---- sharded_state_dict() metadata ------------------------------------------------------


def _is_main(rec: dict) -> bool:
    return all(int(x) == 0 for x in rec["replica_id"])


def tiling_errors(records: list[dict]) -> list[str]:
    """Main replicas must cover every global tensor exactly once; other replicas must
    duplicate a main shard exactly."""
    errors: list[str] = []
    by_key: dict[str, list[dict]] = {}
    for rec in records:
        if "key" in rec:
            by_key.setdefault(rec["key"], []).append(rec)
    for key, recs in by_key.items():
        shape = tuple(recs[0]["global_shape"])
        count = np.zeros(shape, dtype=np.int64)
        main_boxes = set()
        for rec in recs:
            if tuple(rec["global_shape"]) != shape:
                errors.append(f"{key}: inconsistent global_shape")
                continue
            k = rec["prepend_axis_num"]
            sizes = [1] * k + list(rec["local_shape"])
            box = tuple(slice(o, o + n) for o, n in zip(rec["global_offset"], sizes, strict=True))
            if any(sl.stop > dim for sl, dim in zip(box, shape, strict=True)):
                errors.append(f"{key}: shard {box} outside {shape}")
                continue
            if _is_main(rec):
                count[box] += 1
                main_boxes.add(tuple((sl.start, sl.stop) for sl in box))
        for rec in recs:
            if not _is_main(rec):
                k = rec["prepend_axis_num"]
                sizes = [1] * k + list(rec["local_shape"])
                b = tuple((o, o + n) for o, n in zip(rec["global_offset"], sizes, strict=True))
                if b not in main_boxes:
                    errors.append(f"{key}: replica {b} duplicates no main shard")
        if count.min() != 1 or count.max() != 1:
            errors.append(f"{key}: main replicas cover elements {count.min()}..{count.max()} times")
    return errors


def _all_records(ranks: list[dict]) -> list[dict]:
    return [dict(rec, rank=r["rank"]) for r in ranks for rec in r["layout"]]


def _print_layout(ranks: list[dict]) -> None:
    for r in ranks:
        for rec in r["layout"]:
            if "key" not in rec:
                print(f"rank {r['rank']} {rec['sd_name']}: {rec}")
                continue
            print(
                f"rank {r['rank']} {rec['sd_name']}{' [' + rec['factory'] + ']' if rec['factory'] else ''}"
                f": key={rec['key']} local={tuple(rec['local_shape'])}"
                f" global_shape={tuple(rec['global_shape'])} global_offset={tuple(rec['global_offset'])}"
                f" axis_fragmentations={tuple(rec['axis_fragmentations'])}"
                f" replica_id={tuple(rec['replica_id'])} prepend_axis_num={rec['prepend_axis_num']}"
                f" param={rec['param_storage']}"
            )


def _check_layout(ranks: list[dict], *, tp: int, pp: int) -> None:
    records = _all_records(ranks)
    assert tiling_errors(records) == []
    # Negative control: move one main shard and the check must fail.
    bad = copy.deepcopy(records)
    victim = next(r for r in bad if "key" in r and "linear_qkv.weight" in r["key"] and _is_main(r))
    victim["global_offset"][-2] += 1 if victim["global_offset"][-2] == 0 else -1
    assert tiling_errors(bad)

    cfg = ModelConfig(vocab_size=VOCAB)
    for r in ranks:
        tensors = [rec for rec in r["layout"] if "key" in rec]
        # Every BF16 parameter of the rank is reachable from the metadata.
        assert {rec["param_storage"] for rec in tensors} == set(r["initial_digests"])
        fc1 = [rec for rec in tensors if rec["key"].endswith("linear_fc1.weight")]
        assert fc1 and all(rec["factory"] == "apply_swiglu_sharded_factory" for rec in fc1)
        # Two views (gate part, up part) per layer, at rows tp_rank*f/tp and f + tp_rank*f/tp.
        f_local = cfg.ffn_hidden_size // tp
        rows = sorted(rec["global_offset"][1] for rec in fc1)
        layers_here = cfg.num_layers // pp
        expected = sorted(
            [r["tp_rank"] * f_local, cfg.ffn_hidden_size + r["tp_rank"] * f_local] * layers_here
        )
        assert rows == expected
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            recs = [rec for rec in tensors if rec["key"] == name]
            holder = (name.startswith("embedding") and r["pp_rank"] == 0) or (
                name.startswith("output") and r["pp_rank"] == pp - 1
            )
            assert len(recs) == (1 if holder else 0), (name, r["rank"])
            if recs:
                assert recs[0]["global_shape"] == [padded_vocab_size(cfg, tp), cfg.hidden_size]
        layer_offsets = {
            rec["global_offset"][0] for rec in tensors if rec["key"].startswith("decoder.layers.")
        }
        per_stage = cfg.num_layers // pp
        assert layer_offsets == set(range(r["pp_rank"] * per_stage, (r["pp_rank"] + 1) * per_stage))


def test_tp2_sharded_layout_tiles_each_tensor_once(tp2):
    _print_layout(tp2)
    _check_layout(tp2, tp=2, pp=1)


def test_shim_reports_and_scopes_its_patches(tp2):
    for r in tp2:
        shim = r["shim"]
        assert shim["idempotent"]
        assert shim["current_device"] == "cpu"
        assert shim["current_stream_is_cpu"] and shim["stream_context_is_null"]
        assert shim["report"]["torch_cuda_functions"] == ["current_device", "synchronize", "current_stream", "stream"]
        assert shim["type_outside_scope"] == "torch.BFloat16Tensor"
        assert shim["type_inside_scope"] == "torch.cuda.BFloat16Tensor"
        assert shim["clip_scoped"]
        assert shim["cuda_outside_scope_raises"] and shim["setup_embeddings_scoped"]
        assert shim["te_general_gemm_is_none"]
        assert any("DistributedOptimizer" in n for n in shim["report"]["type_name_scoped"])
        # megatron-core 0.16.1 leaves te_general_gemm undefined without Transformer Engine;
        # 0.19 defines it as None itself (moe_utils.py's `else` branch), so patch 5 sets nothing
        undefined_upstream = Version(shim["megatron_core"]) < Version("0.19")
        assert shim["report"]["missing_globals_defined"] == (
            ["megatron.core.transformer.moe.moe_utils.te_general_gemm"] if undefined_upstream else []
        )


# ---- pipeline parallelism ------------------------------------------------------------------


def test_tp2_pp2_trains_three_steps(tp2pp2):
    _check_losses(tp2pp2)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in tp2pp2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in tp2pp2:
        prev = r["initial_digests"]
        for s in r["steps"]:
            assert all(s["bf16_is_rounded_master"].values())
            assert s["hook_digests"] == s["digests"] != prev
            prev = s["digests"]
    _tp_replicated_identical(tp2pp2)


def test_tp2_pp2_sharded_layout_tiles_each_tensor_once(tp2pp2):
    _check_layout(tp2pp2, tp=2, pp=2)
