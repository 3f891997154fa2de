"""Placement discovery on loaders shaped like other runtimes' (fused QKV slices, transposed
storage, one canonical tensor split over two parameters), and the loaders in-place apply
must refuse (rebinding, dropping, two tensors into one place)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch

from nemo_dcr.codec.types import DeltaOp
from nemo_dcr.receiver.apply import CoveragePolicy, DeltaApplier, PlacementKind
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.verify import compare_modules, load_dense, state_digest
from nemo_dcr.receiver.runtime import TensorSpec

from receiver_helpers import deltas, flip_one_bit, perturb

D = 8
BF16 = torch.bfloat16


class Fused(torch.nn.Module):
    """vLLM-like storage: q/k/v fused on dim 0, an MLP weight stored transposed, and a
    canonical gate_up tensor split over two parameters."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * D, D, dtype=BF16))
        self.down_t = torch.nn.Parameter(torch.zeros(2 * D, D, dtype=BF16))  # canonical (D, 2D)
        self.gate = torch.nn.Parameter(torch.zeros(D, D, dtype=BF16))
        self.up = torch.nn.Parameter(torch.zeros(D, D, dtype=BF16))
        self.register_buffer("scale", torch.ones(D, dtype=BF16))


SPECS = {
    "q": TensorSpec("q", "bfloat16", (D, D)),
    "k": TensorSpec("k", "bfloat16", (D, D)),
    "v": TensorSpec("v", "bfloat16", (D, D)),
    "down": TensorSpec("down", "bfloat16", (D, 2 * D)),
    "gate_up": TensorSpec("gate_up", "bfloat16", (2 * D, D)),
    "scale": TensorSpec("scale", "bfloat16", (D,)),
}


def fused_loader(m: Fused, name: str, t: torch.Tensor) -> None:
    """The hand-written placement lives HERE, in the 'runtime', never in the receiver."""
    if name in ("q", "k", "v"):
        i = "qkv".index(name)
        m.qkv.narrow(0, i * D, D).copy_(t)
    elif name == "down":
        m.down_t.copy_(t.t())
    elif name == "gate_up":
        m.gate.copy_(t.narrow(0, 0, D))
        m.up.copy_(t.narrow(0, D, D))
    elif name == "scale":
        m.scale.copy_(t)
    else:
        raise KeyError(name)


class ToyAdapter:
    def __init__(self, loader: Callable = fused_loader, specs=SPECS, initial=None):
        self._module = Fused()
        self._loader = loader
        self._specs = dict(specs)
        self._initial = initial or {}

    @property
    def module(self):
        return self._module

    def tensor_specs(self):
        return self._specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self._loader(self._module, name, t)

    def post_load(self, names):
        pass

    def initial_tensor(self, name):
        return self._initial.get(name)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=g).to(BF16) for n, s in SPECS.items()}


def _runtime(state, loader=fused_loader, **kw) -> ToyAdapter:
    adapter = ToyAdapter(loader, **kw)
    load_dense(adapter, state)
    return adapter


def test_fused_transposed_and_split_placements():
    base = _state(0)
    adapter = _runtime(base)
    placements = DeltaApplier(adapter).prewarm()
    kinds = {n: p.kind for n, p in placements.items()}
    # a contiguous slice of the fused qkv is still a whole-tensor copy at an offset
    assert kinds == {
        "q": PlacementKind.DIRECT,
        "k": PlacementKind.DIRECT,
        "v": PlacementKind.DIRECT,
        "down": PlacementKind.VIEW,
        "gate_up": PlacementKind.VIEW,
        "scale": PlacementKind.DIRECT,
    }
    assert {c.dest for c in placements["gate_up"].copies} == {"gate", "up"}
    assert placements["k"].copies[0].dest_geometry.offset == D * D


@pytest.mark.parametrize("op", [DeltaOp.XOR, DeltaOp.OVERWRITE])
def test_view_placements_apply_bit_exact(op):
    base = _state(0)
    adapter = _runtime(base)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    target = perturb(base, np.random.default_rng(20), frac=0.2, special=True)
    result = applier.apply(deltas(base, target, op=op))
    assert result.through_loader == {"down", "gate_up"}
    reference = _runtime(target)
    report = compare_modules(adapter.module, reference.module)
    assert report.equal, report.summary()
    flip_one_bit(adapter.module.down_t, 5)
    assert compare_modules(adapter.module, reference.module).mismatched_names == {"down_t"}


def test_loader_that_rebinds_is_refused_and_restored():
    def rebinding(m, name, t):
        if name == "scale":
            m.scale = t.clone()  # replaces the buffer instead of writing into it
        else:
            fused_loader(m, name, t)

    adapter = _runtime(_state(0), rebinding)
    buffer = adapter.module.scale
    digest = state_digest(adapter.module)
    with pytest.raises(LoaderError, match="rebinds"):
        DeltaApplier(adapter).prewarm()
    assert adapter.module.scale is buffer and state_digest(adapter.module) == digest


def test_dropped_tensor_policy():
    def dropping(m, name, t):
        if name != "scale":
            fused_loader(m, name, t)

    base = _state(0)
    adapter = _runtime(base, dropping)
    with pytest.raises(LoaderError, match="never writes"):
        DeltaApplier(adapter).prewarm()
    applier = DeltaApplier(adapter, coverage=CoveragePolicy.ALLOW_DROPPED)
    assert applier.prewarm()["scale"].kind is PlacementKind.DROPPED
    target = perturb(base, np.random.default_rng(21), frac=0.2)
    result = applier.apply(deltas(base, target))
    assert result.dropped == {"scale"} and "scale" not in result.applied
    report = compare_modules(adapter.module, _runtime(target, dropping).module)
    assert report.equal, report.summary()


def test_two_tensors_into_one_place_is_refused():
    def colliding(m, name, t):
        fused_loader(m, "q" if name == "k" else name, t)

    with pytest.raises(LoaderError, match="same elements"):
        DeltaApplier(_runtime(_state(0), colliding)).prewarm()


def test_every_parameter_on_one_storage_keeps_its_placements_and_collisions_are_refused(tmp_path, monkeypatch):
    """``--persistent-weights`` maps every parameter on one file, so all of them share one
    storage: the overlap check then sees many writes into it and checks the spans of the
    contiguous ones (not a mask of the whole storage per tensor, which cost 13 GB and a
    minute for a 311 MB model).  Placements and a refit are those of separate storages.
    Control: a loader putting two canonical tensors into one place is still refused."""
    from nemo_dcr.receiver import placement
    from nemo_dcr.runtimes.persistent import bind_persistent

    by_mask = []
    real = placement._check_overlaps_by_mask
    monkeypatch.setattr(placement, "_check_overlaps_by_mask", lambda *a: by_mask.append(a[1].name) or real(*a))
    base = _state(0)
    want = {n: p.kind for n, p in DeltaApplier(_runtime(base)).prewarm().items()}
    adapter = _runtime(base)
    bind_persistent(adapter.module, str(tmp_path / "w"), "run")
    assert len({p.untyped_storage().data_ptr() for p in adapter.module.parameters()}) == 1
    applier = DeltaApplier(adapter)
    assert {n: p.kind for n, p in applier.prewarm().items()} == want
    assert by_mask == []  # disjoint contiguous spans: no mask of the storage
    target = perturb(base, np.random.default_rng(24), frac=0.3)
    applier.apply(deltas(base, target))
    report = compare_modules(adapter.module, _runtime(target).module)
    assert report.equal, report.summary()

    def colliding(m, name, t):
        fused_loader(m, "q" if name == "k" else name, t)

    bad = _runtime(base, colliding)
    bind_persistent(bad.module, str(tmp_path / "w2"), "run")
    with pytest.raises(LoaderError, match="same elements"):
        DeltaApplier(bad).prewarm()
    assert by_mask  # overlapping spans: checked element by element


def test_double_write_is_treated_as_transform():
    def twice(m, name, t):
        if name == "scale":
            m.scale.copy_(t)
            m.scale.copy_(t)  # XORing twice would cancel; copying twice does not
        else:
            fused_loader(m, name, t)

    base = _state(0)
    adapter = _runtime(base, twice, initial=base)
    applier = DeltaApplier(adapter)
    assert applier.prewarm()["scale"].kind is PlacementKind.TRANSFORM
    target = perturb(base, np.random.default_rng(22), frac=0.3)
    applier.apply(deltas(base, target))
    report = compare_modules(adapter.module, _runtime(target, twice).module)
    assert report.equal, report.summary()


def test_rebound_after_prewarm_is_refused():
    base = _state(0)
    adapter = _runtime(base)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    adapter.module.gate = torch.nn.Parameter(adapter.module.gate.detach().clone())
    with pytest.raises(LoaderError, match="prewarm"):
        applier.apply(deltas(base, perturb(base, np.random.default_rng(23))))


def test_changed_view_placement_is_refused_before_writing():
    flip = {"on": False}

    def shifting(m, name, t):
        if name == "gate_up" and flip["on"]:
            m.up.copy_(t.narrow(0, 0, D))
            m.gate.copy_(t.narrow(0, D, D))
        else:
            fused_loader(m, name, t)

    base = _state(0)
    adapter = _runtime(base, shifting)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    flip["on"] = True
    digest = state_digest(adapter.module)
    with pytest.raises(LoaderError, match="changed since prewarm"):
        applier.apply(deltas(base, perturb(base, np.random.default_rng(24), frac=0.2)))
    assert state_digest(adapter.module) == digest


def test_plan_is_immutable_and_apply_leaves_it_alone():
    base = _state(0)
    adapter = _runtime(base)
    applier = DeltaApplier(adapter)
    assert applier.plan is None and dict(applier.placements) == {}
    applier.prewarm()
    plan = applier.plan
    with pytest.raises(TypeError):
        plan.placements["q"] = plan.placements["k"]  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.direct["extra"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.placements = {}  # type: ignore[misc]
    before = {n: (p.kind, p.copies) for n, p in plan.placements.items()}
    applier.apply(deltas(base, perturb(base, np.random.default_rng(25), frac=0.2)))
    assert applier.plan is plan
    assert {n: (p.kind, p.copies) for n, p in plan.placements.items()} == before
    applier.prewarm()  # a new prewarm makes a new plan
    assert applier.plan is not plan


def test_one_validator_for_apply_and_catch_up():
    """``validate_version`` (what ``apply``, ``validate`` and catch-up's chain links run)
    refuses on specs alone; the applier refuses the same batch, writing nothing."""
    from nemo_dcr.codec.types import TensorDelta
    from nemo_dcr.receiver.errors import DeltaValidationError
    from nemo_dcr.receiver.served import validate_version

    base = _state(0)
    good = deltas(base, perturb(base, np.random.default_rng(26), frac=0.2))
    d = next(x for x in good if x.name == "scale" and x.nnz)
    assert set(validate_version(SPECS, good)) == {x.name for x in good}  # negative control
    corrupted = TensorDelta(d.name, d.dtype, d.shape, d.op, d.positions, d.values)
    object.__setattr__(corrupted, "positions", np.array([D], np.int64))  # past the end; constructor bypassed
    bad_batches = [
        [TensorDelta("nope", d.dtype, d.shape, d.op, d.positions, d.values)],
        [TensorDelta(d.name, d.dtype, (D + 1,), d.op, d.positions, d.values)],
        [corrupted],
        [d, TensorDelta(d.name, d.dtype, d.shape, d.op, d.positions[:1].copy(), d.values[:1].copy())],
    ]
    adapter = _runtime(base)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    digest = state_digest(adapter.module)
    for bad in bad_batches:
        with pytest.raises(DeltaValidationError):
            validate_version(SPECS, bad)
        with pytest.raises(DeltaValidationError):
            applier.apply([x for x in good if x.name != "scale"] + bad)
        assert state_digest(adapter.module) == digest
