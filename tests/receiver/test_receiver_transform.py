"""Loaders that change bits (a cast, a scale) are detected at prewarm; their tensors are
applied as overwrites through the loader from a canonical mirror, and still end bit-exact
with a dense load through the same loader."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
import torch

from nemo_dcr.codec.types import DeltaOp
from nemo_dcr.receiver.apply import DeltaApplier, PlacementKind
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.verify import compare_with_dense, load_dense, state_digest
from nemo_dcr.runtimes.hf import HFTransformersAdapter, checkpoint_specs, module_specs

from receiver_helpers import bits, canonical_state, deltas, flip_one_bit, llama, perturb


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bf16 HF checkpoint directory (safetensors) of the tiny Llama."""
    path = tmp_path_factory.mktemp("ckpt")
    model = llama()
    model.save_pretrained(path)
    return path, canonical_state(model, module_specs(model))


def test_checkpoint_specs_are_the_module_specs(checkpoint):
    path, _ = checkpoint
    assert checkpoint_specs(path) == module_specs(llama())


def test_bf16_receiver_from_checkpoint_dir(checkpoint):
    """The worker's path: ``from_pretrained`` on the initial checkpoint, then XOR apply."""
    path, base = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path)
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert np.array_equal(bits(adapter.initial_tensor(name)), bits(base[name]))
    applier = DeltaApplier(adapter)
    assert {p.kind for p in applier.prewarm().values()} == {PlacementKind.DIRECT}
    target = perturb(base, np.random.default_rng(13))
    applier.apply(deltas(base, target))
    report = compare_with_dense(adapter.module, HFTransformersAdapter.from_pretrained(path), target)
    assert report.equal, report.summary()


def test_fp32_runtime_fed_bf16_is_overwritten_bit_exact(checkpoint):
    path, base = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path, dtype=torch.float32)
    assert {s.dtype for s in adapter.tensor_specs().values()} == {"bfloat16"}
    applier = DeltaApplier(adapter)
    placements = applier.prewarm()
    assert {p.kind for p in placements.values()} == {PlacementKind.TRANSFORM}
    assert "bfloat16 -> torch.float32" in placements["model.norm.weight"].reason

    target = perturb(base, np.random.default_rng(10))
    result = applier.apply(deltas(base, target))
    assert result.through_loader == set(base)
    reference = HFTransformersAdapter.from_pretrained(path, dtype=torch.float32)
    report = compare_with_dense(adapter.module, reference, target)
    assert report.equal, report.summary()
    # the mirror was advanced: a second version applies on top of the first
    nxt = perturb(target, np.random.default_rng(11))
    applier.apply(deltas(target, nxt, op=DeltaOp.OVERWRITE))
    report = compare_with_dense(adapter.module, reference, nxt)
    assert report.equal, report.summary()
    flip_one_bit(adapter.module.get_parameter("model.norm.weight"), 3)
    assert not compare_with_dense(adapter.module, reference, nxt).equal


def test_stale_mirror_is_refused_at_prewarm(checkpoint):
    path, _ = checkpoint
    adapter = HFTransformersAdapter.from_pretrained(path, dtype=torch.float32)
    flip_one_bit(adapter.module.get_parameter("model.layers.0.input_layernorm.weight"), 0, bit=20)
    with pytest.raises(LoaderError, match="input_layernorm"):
        DeltaApplier(adapter).prewarm()


class ScalingAdapter:
    """A runtime whose loader scales every tensor by 2 before copying it (a stand-in for a
    loader that quantizes or folds a scale)."""

    def __init__(self, inner: HFTransformersAdapter):
        self.inner = inner

    @property
    def module(self):
        return self.inner.module

    def tensor_specs(self):
        return self.inner.tensor_specs()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.load_weights((n, t * 2) for n, t in weights)

    def post_load(self, names):
        self.inner.post_load(names)

    def initial_tensor(self, name):
        return self.inner.initial_tensor(name)


def _scaled_runtime(path, base):
    adapter = ScalingAdapter(HFTransformersAdapter.from_pretrained(path))
    load_dense(adapter, base)  # the runtime's state is what its own loader makes of the checkpoint
    return adapter


def test_scaling_loader_is_detected_and_ends_bit_exact(checkpoint):
    path, base = checkpoint
    adapter = _scaled_runtime(path, base)
    applier = DeltaApplier(adapter)
    placements = applier.prewarm()
    assert {p.kind for p in placements.values()} == {PlacementKind.TRANSFORM}
    assert "computed tensor" in placements["lm_head.weight"].reason

    target = perturb(base, np.random.default_rng(12))
    batch = deltas(base, target)
    applier.apply(batch[: len(batch) // 2] + [
        d.__class__(d.name, d.dtype, d.shape, DeltaOp.OVERWRITE, d.positions,
                    bits(target[d.name])[d.positions], d.element_range)
        for d in batch[len(batch) // 2:]
    ])
    report = compare_with_dense(adapter.module, _scaled_runtime(path, base), target)
    assert report.equal, report.summary()
    # a second prewarm keeps the mirror at the applied version, not at the checkpoint's
    applier.prewarm()
    nxt = perturb(target, np.random.default_rng(14))
    applier.apply(deltas(target, nxt))
    report = compare_with_dense(adapter.module, _scaled_runtime(path, base), nxt)
    assert report.equal, report.summary()
    # the scale really happened: the parameter is not the canonical tensor
    assert not np.array_equal(bits(adapter.module.get_parameter("lm_head.weight")), bits(target["lm_head.weight"]))


def test_transform_without_mirror_source_is_refused():
    model = llama(dtype=torch.float32)
    adapter = HFTransformersAdapter(model, specs={
        n: s.__class__(n, "bfloat16", s.shape) for n, s in module_specs(model).items()
    })
    before = state_digest(model)
    with pytest.raises(LoaderError, match="canonical mirror"):
        DeltaApplier(adapter).prewarm()
    assert state_digest(model) == before
