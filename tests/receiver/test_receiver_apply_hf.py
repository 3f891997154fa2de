"""In-place apply on a real transformers LlamaForCausalLM, checked against a dense load of
the same target through the same loader into a second model (integer views)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.codec.types import DeltaOp, TensorDelta
from nemo_dcr.receiver.apply import DeltaApplier, PlacementKind
from nemo_dcr.receiver.errors import DeltaValidationError
from nemo_dcr.receiver.verify import compare_modules, compare_with_dense, state_digest
from nemo_dcr.receiver.runtime import RuntimeAdapter
from nemo_dcr.runtimes.hf import HFTransformersAdapter

from receiver_helpers import SPECIAL_BF16, bits, canonical_state, deltas, flip_one_bit, llama, perturb


def _receiver(tie: bool = False):
    adapter = HFTransformersAdapter(llama(tie=tie))
    applier = DeltaApplier(adapter)
    applier.prewarm()
    return adapter, applier


def test_adapter_is_a_runtime_adapter_and_prewarm_writes_nothing():
    adapter = HFTransformersAdapter(llama())
    assert isinstance(adapter, RuntimeAdapter)
    before = state_digest(adapter.module)
    placements = DeltaApplier(adapter).prewarm()
    assert state_digest(adapter.module) == before
    assert set(placements) == set(adapter.tensor_specs())
    # load_state_dict copies each whole canonical tensor into its parameter unchanged
    assert {p.kind for p in placements.values()} == {PlacementKind.DIRECT}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_xor_apply_is_bit_exact_with_dense_load(tie):
    adapter, applier = _receiver(tie)
    names = list(adapter.tensor_specs())
    base = canonical_state(adapter.module, names)
    target = perturb(base, np.random.default_rng(1))
    batch = deltas(base, target)
    # some tensors arrive as two records: disjoint ranges, or interleaved positions
    assert len(batch) > len(names)
    assert any(a.name == b.name and a.element_range[1] > b.element_range[0] for a, b in zip(batch, batch[1:]))

    result = applier.apply(batch)

    assert result.applied == set(names)
    assert result.xor_elements == sum(int((bits(base[n]) != bits(target[n])).sum()) for n in names)
    reference = HFTransformersAdapter(llama(tie=tie))
    report = compare_with_dense(adapter.module, reference, target)
    assert report.equal, report.summary()
    assert report.compared == len(list(adapter.module.named_parameters(remove_duplicate=False))) + len(
        list(adapter.module.named_buffers())
    )
    # negative control: one flipped bit anywhere must be reported, with its place
    param = dict(adapter.module.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    flip_one_bit(param, 7)
    report = compare_modules(adapter.module, reference.module)
    assert report.mismatched_names == {"model.layers.1.mlp.down_proj.weight"}
    (diff,) = report.differences
    assert diff.count == 1 and diff.first_index == (0, 7)


def test_tied_embeddings_follow_the_runtime():
    adapter, applier = _receiver(tie=True)
    model = adapter.module
    assert "lm_head.weight" not in adapter.tensor_specs()  # the checkpoint carries the source only
    base = canonical_state(model, adapter.tensor_specs())
    target = perturb(base, np.random.default_rng(2))
    applier.apply(deltas(base, target))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert np.array_equal(bits(model.lm_head.weight), bits(target["model.embed_tokens.weight"]))
    with pytest.raises(DeltaValidationError, match="lm_head.weight"):
        applier.apply(
            [TensorDelta("lm_head.weight", "bfloat16", (101, 64), DeltaOp.XOR, np.array([0]), np.array([1], np.uint16))]
        )


def test_nan_inf_and_subnormal_payloads_survive():
    adapter, applier = _receiver()
    base = canonical_state(adapter.module, adapter.tensor_specs())
    target = perturb(base, np.random.default_rng(3), special=True)
    applier.apply(deltas(base, target))
    report = compare_with_dense(adapter.module, HFTransformersAdapter(llama()), target)
    assert report.equal, report.summary()
    # independently of any loader: the special patterns are in the parameter, bit for bit
    name = "model.layers.0.self_attn.q_proj.weight"
    got = bits(adapter.module.get_parameter(name))
    want = bits(target[name])
    special_at = np.flatnonzero(np.isin(want, SPECIAL_BF16))
    assert special_at.size >= len(SPECIAL_BF16) - 1
    assert np.array_equal(got[special_at], want[special_at])


def test_overwrite_records_and_mixed_ops():
    adapter, applier = _receiver()
    base = canonical_state(adapter.module, adapter.tensor_specs())
    target = perturb(base, np.random.default_rng(4))
    xor = deltas(base, target, op=DeltaOp.XOR)
    ow = deltas(base, target, op=DeltaOp.OVERWRITE)
    # per tensor, alternately XOR or OVERWRITE; for split tensors one range of each
    batch = [x if i % 2 else o for i, (x, o) in enumerate(zip(xor, ow))]
    assert {d.op for d in batch} == {DeltaOp.XOR, DeltaOp.OVERWRITE}
    result = applier.apply(batch)
    assert result.overwrite_elements > 0 and result.xor_elements > 0
    report = compare_with_dense(adapter.module, HFTransformersAdapter(llama()), target)
    assert report.equal, report.summary()
    # overwrite is idempotent: re-applying the OVERWRITE records changes nothing
    digest = state_digest(adapter.module)
    applier.apply([d for d in batch if d.op is DeltaOp.OVERWRITE])
    assert state_digest(adapter.module) == digest


def test_consecutive_versions():
    adapter, applier = _receiver()
    rng = np.random.default_rng(5)
    state = canonical_state(adapter.module, adapter.tensor_specs())
    for _ in range(3):
        nxt = perturb(state, rng, frac=0.01)
        applier.apply(deltas(state, nxt))
        state = nxt
    report = compare_with_dense(adapter.module, HFTransformersAdapter(llama()), state)
    assert report.equal, report.summary()


def _corrupt(d: TensorDelta, **fields) -> TensorDelta:
    """A record that slipped past its own constructor (the applier must not trust it)."""
    bad = TensorDelta(d.name, d.dtype, d.shape, d.op, d.positions, d.values, d.element_range)
    for k, v in fields.items():
        object.__setattr__(bad, k, v)
    return bad


def _bad_records(ok: list[TensorDelta]) -> dict[str, list[TensorDelta]]:
    d = next(x for x in ok if x.element_range == (0, x.numel) and x.nnz)
    n = d.numel
    return {
        "unknown name": [
            TensorDelta("model.layers.9.mlp.up_proj.weight", d.dtype, d.shape, d.op, d.positions, d.values)
        ],
        "wrong shape": [TensorDelta(d.name, d.dtype, (n + 1,), d.op, d.positions, d.values)],
        "wrong dtype": [TensorDelta(d.name, "float16", d.shape, d.op, d.positions, d.values)],
        "position out of range": [_corrupt(d, positions=np.append(d.positions[:-1], n).astype(np.int64))],
        "positions unsorted": [_corrupt(d, positions=d.positions[::-1].copy())],
        "values not bits": [_corrupt(d, values=d.values.astype(np.float32))],
        # a second record (another chunk / rank) changing an element `d` already changes
        "same element twice": [
            TensorDelta(d.name, d.dtype, d.shape, d.op, d.positions[:1].copy(), np.array([1], np.uint16)),
        ],
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown name",
        "wrong shape",
        "wrong dtype",
        "position out of range",
        "positions unsorted",
        "values not bits",
        "same element twice",
    ],
)
def test_bad_batch_raises_and_writes_nothing(case):
    adapter, applier = _receiver()
    base = canonical_state(adapter.module, adapter.tensor_specs())
    good = deltas(base, perturb(base, np.random.default_rng(6)), split_every=0)
    before = state_digest(adapter.module)
    with pytest.raises(DeltaValidationError):
        applier.apply(good + _bad_records(good)[case])  # the bad record comes last
    assert state_digest(adapter.module) == before
    applier.apply(good)  # the applier is still usable, and the good batch does change weights
    assert state_digest(adapter.module) != before
