"""A receiver whose checkpoint layout differs from its module layout: transformers v5
Qwen3-MoE (per-expert checkpoint tensors, fused 3-D expert parameters).  Deltas arrive in
checkpoint names; after each version the live model must equal, bit for bit, a fresh
``from_pretrained`` of a dense checkpoint of that version (transformers' real loader)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_dcr.codec.types import DeltaOp, TensorDelta
from nemo_dcr.receiver.apply import DeltaApplier, PlacementKind
from nemo_dcr.receiver.errors import DeltaValidationError
from nemo_dcr.receiver.verify import compare_modules, state_digest
from nemo_dcr.runtimes.hf import HFTransformersAdapter, checkpoint_specs, module_specs

from receiver_helpers import bits, deltas, flip_one_bit, perturb

E = 4  # experts per layer


def _qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=64,
        vocab_size=128,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def _read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe")
    _qwen3_moe().save_pretrained(path)
    return path, _read(path)


def _dense_reference(base_dir, tmp_path, state: dict[str, torch.Tensor]):
    """from_pretrained of a dense canonical checkpoint holding ``state``."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "dense"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    shutil.copy(base_dir / "config.json", d / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, local_files_only=True).eval()


def _expert(layer: int, e: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


def test_checkpoint_holds_per_expert_names(checkpoint):
    path, state = checkpoint
    specs = checkpoint_specs(path)
    assert _expert(1, E - 1, "up_proj") in specs and _expert(0, 0, "down_proj") in specs
    assert not any("gate_up_proj" in n for n in specs)
    # the adapter's default specs are transformers' reverse conversion: the same names
    assert module_specs(_qwen3_moe()) == specs
    assert set(state) == set(specs)


def test_prewarm_traces_experts_and_writes_nothing(checkpoint):
    path, _ = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    before = state_digest(adapter.module)
    placements = DeltaApplier(adapter).prewarm()
    assert state_digest(adapter.module) == before
    assert set(placements) == set(adapter.tensor_specs())
    experts = {n for n in placements if ".mlp.experts." in n}
    assert len(experts) == 2 * E * 3
    for n in experts:
        p = placements[n]
        assert p.kind is PlacementKind.TRACED, (n, p.reason)
        assert p.traced.count == 1  # one stacked expert slice: one affine run
        assert len(p.load_unit) == (2 * E if "down_proj" not in n else E)
    assert {placements[n].kind for n in set(placements) - experts} == {PlacementKind.DIRECT}


def test_canonical_bits_at_reads_what_canonical_bits_holds(checkpoint):
    """The journal's undo values come from ``canonical_bits_at``: for TRACED experts and
    DIRECT tensors alike it equals the whole read at those positions (integer views).
    Negative control: after one stored bit of a fused expert parameter flips, both reads
    see it at that expert element, and the earlier read no longer matches."""
    path, _ = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    applier = DeltaApplier(adapter)
    placements = applier.prewarm()
    rng = np.random.default_rng(3)
    kinds = set()
    for name, p in placements.items():
        numel = adapter.tensor_specs()[name].numel
        pos = np.unique(rng.integers(0, numel, size=min(numel, 7))).astype(np.int64)
        np.testing.assert_array_equal(applier.canonical_bits_at(name, pos), applier.canonical_bits(name)[pos])
        kinds.add(p.kind)
    assert {PlacementKind.TRACED, PlacementKind.DIRECT} <= kinds
    name = _expert(1, 2, "up_proj")
    before = applier.canonical_bits_at(name, np.array([5], np.int64))
    fused = adapter.module.model.layers[1].mlp.experts.gate_up_proj
    with torch.no_grad():
        flat = fused.data.view(torch.int16).view(-1)
        whole = applier.canonical_bits(name)
        # find the stored element behind canonical element 5 of this expert: flip bits until it moves
        for i in range(flat.numel()):
            flat[i] ^= 1
            if applier.canonical_bits(name)[5] != whole[5]:
                break
            flat[i] ^= 1
        else:
            raise AssertionError("no stored element reaches canonical element 5")
    after = applier.canonical_bits_at(name, np.array([5], np.int64))
    assert after[0] == applier.canonical_bits(name)[5] and after[0] != before[0]


def test_incomplete_converter_group_is_refused(checkpoint):
    path, state = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    given = {n: state[n] for n in (_expert(0, 0, "gate_proj"), _expert(0, 1, "up_proj"))}
    with pytest.raises(ValueError, match=r"gate_up_proj is converted from 8 checkpoint tensors; 6 were not given"):
        adapter.load_weights(given.items())


def test_versions_apply_bit_exact_against_from_pretrained(checkpoint, tmp_path):
    path, state = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    changed = [
        _expert(0, 0, "gate_proj"),
        _expert(0, 2, "up_proj"),
        _expert(0, 3, "down_proj"),
        _expert(1, 1, "gate_proj"),
        _expert(1, 1, "up_proj"),
        _expert(1, 3, "down_proj"),
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
    ]
    rng = np.random.default_rng(5)
    current = dict(state)
    for version in range(3):
        sub = {n: current[n] for n in changed}
        target = perturb(sub, rng, frac=0.04, special=version == 1)
        op = DeltaOp.OVERWRITE if version == 2 else DeltaOp.XOR
        result = applier.apply(deltas(sub, target, op=op))
        assert result.applied == set(changed) and not result.through_loader
        current.update(target)
        reference = _dense_reference(path, tmp_path, current)
        report = compare_modules(adapter.module, reference)
        assert report.equal, report.summary()
        assert report.compared == len(list(adapter.module.named_parameters(remove_duplicate=False))) + len(
            list(adapter.module.named_buffers())
        )
        for n in (_expert(1, 1, "up_proj"), _expert(0, 1, "down_proj")):
            assert np.array_equal(applier.canonical_bits(n), bits(current[n]))
    # negative control: one flipped bit in a fused expert parameter is found
    flip_one_bit(adapter.module.get_parameter("model.layers.1.mlp.experts.gate_up_proj"), 100)
    report = compare_modules(adapter.module, reference)
    assert report.mismatched_names == {"model.layers.1.mlp.experts.gate_up_proj"}


def _record(name, shape, positions):
    pos = np.asarray(positions, dtype=np.int64)
    return TensorDelta(name, "bfloat16", shape, DeltaOp.XOR, pos, np.full(pos.shape, 0x40, dtype=np.uint16))


@pytest.mark.parametrize("case", ["unknown_expert", "position_out_of_range"])
def test_bad_input_is_refused_and_writes_nothing(checkpoint, case):
    path, state = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    before = state_digest(adapter.module)
    good = _record(_expert(0, 1, "gate_proj"), (32, 64), [0, 5, 99])
    if case == "unknown_expert":
        bad, match = _record(_expert(0, E, "gate_proj"), (32, 64), [0]), "not a canonical tensor"
    else:  # a record that slipped past its own constructor: the applier must not trust it
        bad, match = _record(_expert(1, 2, "down_proj"), (64, 32), [3, 7]), "outside element_range"
        object.__setattr__(bad, "positions", np.array([3, 64 * 32], dtype=np.int64))
    with pytest.raises(DeltaValidationError, match=match):
        applier.apply([good, bad])
    assert state_digest(adapter.module) == before


def test_mixtral_is_traced_too(tmp_path):
    """Same engine, another family's conversion (w1/w3 -> gate_up_proj, renamed block)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=3,
        num_experts_per_tok=2,
        vocab_size=64,
    )
    torch.manual_seed(1)
    MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    state = _read(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in state
    adapter = HFTransformersAdapter.from_pretrained(tmp_path)
    applier = DeltaApplier(adapter)
    placements = applier.prewarm()
    assert placements["model.layers.0.block_sparse_moe.experts.2.w3.weight"].kind is PlacementKind.TRACED
    names = [n for n in state if ".experts." in n or n.endswith("gate.weight")]
    target = perturb({n: state[n] for n in names}, np.random.default_rng(2))
    applier.apply(deltas({n: state[n] for n in names}, target))
    state.update(target)
    report = compare_modules(adapter.module, _dense_reference(tmp_path, tmp_path / "ref", state))
    assert report.equal, report.summary()


def test_fp32_runtime_overwrites_whole_groups_from_the_checkpoint_mirror(checkpoint, tmp_path):
    """A cast after the conversion: experts are TRANSFORM; each overwrite feeds the whole
    converter group (unchanged members from the mirror, seeded by ``initial_tensor``)."""
    from transformers import AutoModelForCausalLM

    path, state = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path, dtype=torch.float32)
    applier = DeltaApplier(adapter)
    placements = applier.prewarm()
    assert placements[_expert(0, 1, "up_proj")].kind is PlacementKind.TRANSFORM
    names = [_expert(0, 1, "up_proj"), _expert(1, 0, "down_proj")]
    target = perturb({n: state[n] for n in names}, np.random.default_rng(9))
    result = applier.apply(deltas({n: state[n] for n in names}, target))
    assert result.through_loader == set(names)
    current = dict(state, **target)
    _dense_reference(path, tmp_path, current)  # writes the dense checkpoint
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), dtype=torch.float32).eval()
    report = compare_modules(adapter.module, reference)
    assert report.equal, report.summary()
