"""Two-phase apply (``DeltaApplier.stage`` / ``apply(deltas, staged)`` / ``unstage``) on a
real transformers Llama whose adapter declares some parameters unserved, as vLLM's CPU
adapter declares the plain weights kept beside its packed kernels.  Every check reads
integer views; each has a control showing the bits it compares did move."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from nemo_dcr.receiver.apply import DeltaApplier
from nemo_dcr.receiver.errors import DeltaValidationError, LoaderError
from nemo_dcr.receiver.gated import GateClosed, GatedModel, WriteGate
from nemo_dcr.receiver.served import InProcessModel
from nemo_dcr.receiver.verify import compare_with_dense, load_dense
from nemo_dcr.runtimes.hf import HFTransformersAdapter

from receiver_helpers import bits, canonical_state, deltas, flip_one_bit, llama, perturb

UNSERVED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight")
COPIED = "model.embed_tokens.weight"  # served, but a kernel is built from it: prepare gets a patched copy


class TwoPhaseAdapter(HFTransformersAdapter):
    """A stand-in for a runtime that serves some weights from copies of its own: writes to
    ``UNSERVED`` are invisible until ``install`` (here: recorded)."""

    def __init__(self, module):
        super().__init__(module)
        self.prepared: list[frozenset[str]] = []
        self.installed: list[object] = []
        self.copies: list[dict] = []
        self.covered: list[frozenset[str]] = []

    def unserved(self):
        return frozenset(UNSERVED)

    def kernel_weights(self):
        return frozenset({COPIED})

    def prepare(self, names, copies):
        self.prepared.append(names)
        self.copies.append({n: c.clone() for n, c in copies.items()})
        return ("built", tuple(sorted(names)))

    def install(self, prepared, names, covered):
        self.installed.append(prepared)
        self.covered.append(covered)
        self.post_load(names)


@pytest.fixture
def case():
    adapter = TwoPhaseAdapter(llama())
    applier = DeltaApplier(adapter)
    applier.prewarm()
    names = list(adapter.tensor_specs())
    base = canonical_state(adapter.module, names)
    target = perturb(base, np.random.default_rng(3))
    return adapter, applier, base, target, deltas(base, target)


def _held(adapter):
    return {n: bits(p) for n, p in adapter.module.named_parameters()}


def _served_unchanged(adapter, base):
    held = _held(adapter)
    return all(np.array_equal(held[n], bits(base[n])) for n in base if n not in UNSERVED)


def test_stage_writes_only_unserved_weights_and_apply_finishes_bit_exact(case):
    adapter, applier, base, target, batch = case
    staged = applier.stage(batch)

    assert staged.names == set(UNSERVED)
    assert _served_unchanged(adapter, base)
    held = _held(adapter)
    for n in UNSERVED:  # control: the staged weights did move, to the target
        assert not np.array_equal(held[n], bits(base[n]))
        np.testing.assert_array_equal(held[n], bits(target[n]))
    assert adapter.prepared == [frozenset(UNSERVED) | {COPIED}] and adapter.installed == []
    (copies,) = adapter.copies  # the served weight's patched copy is the target; the weight is not
    assert set(copies) == {COPIED}
    np.testing.assert_array_equal(copies[COPIED].numpy().view(np.uint16), bits(target[COPIED]))
    assert not np.array_equal(bits(base[COPIED]), bits(target[COPIED]))  # control

    result = applier.apply(batch, staged)

    assert result.applied == set(base)
    assert adapter.installed == [("built", tuple(sorted(set(UNSERVED) | {COPIED})))]
    assert adapter.covered == [frozenset(UNSERVED) | {COPIED}]
    report = compare_with_dense(adapter.module, TwoPhaseAdapter(llama()), target)
    assert report.equal, report.summary()
    flip_one_bit(dict(adapter.module.named_parameters())[UNSERVED[0]], 5)  # negative control
    assert not compare_with_dense(adapter.module, TwoPhaseAdapter(llama()), target).equal


def test_unstage_restores_every_bit(case):
    adapter, applier, base, target, batch = case
    staged = applier.stage(batch)
    assert not all(np.array_equal(_held(adapter)[n], bits(base[n])) for n in UNSERVED)  # control
    applier.unstage(staged)
    held = _held(adapter)
    for n in base:
        np.testing.assert_array_equal(held[n], bits(base[n]))
    with pytest.raises(DeltaValidationError, match="unstaged"):
        applier.apply(batch, staged)


def test_an_apply_refused_after_the_stage_undoes_it(case, monkeypatch):
    adapter, applier, base, target, batch = case
    staged = applier.stage(batch)
    real_write = DeltaApplier._write

    def failing(self, plan, grouped):
        raise LoaderError("the loader's placement changed since prewarm")

    monkeypatch.setattr(DeltaApplier, "_write", failing)
    with pytest.raises(LoaderError):
        applier.apply(batch, staged)
    monkeypatch.setattr(DeltaApplier, "_write", real_write)
    held = _held(adapter)
    for n in base:
        np.testing.assert_array_equal(held[n], bits(base[n]))
    assert adapter.installed == []
    # a batch that is not the staged one: refused, its stage undone
    staged = applier.stage(batch)
    with pytest.raises(DeltaValidationError, match="not this batch"):
        applier.apply([d for d in batch if d.name not in UNSERVED], staged)
    assert all(np.array_equal(_held(adapter)[n], bits(base[n])) for n in base)


def test_gated_model_stages_before_the_window_and_unstages_when_the_gate_closes(case):
    adapter, applier, base, target, batch = case
    gate = WriteGate()
    model = GatedModel(InProcessModel(applier), gate)
    out = {}

    def run():
        try:
            out["result"] = model.apply(batch)
        except GateClosed as e:
            out["closed"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not gate.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.waiting
    assert _served_unchanged(adapter, base)  # waiting for a window: nothing served moved
    assert any(not np.array_equal(_held(adapter)[n], bits(base[n])) for n in UNSERVED)  # control: staged
    gate.close()
    t.join(10)
    assert "closed" in out
    for n, b in _held(adapter).items():
        np.testing.assert_array_equal(b, bits(base[n]))


def test_gated_model_applies_the_rest_inside_the_window(case):
    adapter, applier, base, target, batch = case
    gate = WriteGate()
    model = GatedModel(InProcessModel(applier), gate)
    t = threading.Thread(target=lambda: model.apply(batch), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not gate.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _served_unchanged(adapter, base)
    with gate.window():
        t.join(30)
    assert not t.is_alive()
    assert gate.stage_s > 0
    report = compare_with_dense(adapter.module, TwoPhaseAdapter(llama()), target)
    assert report.equal, report.summary()


def test_a_kernel_weight_with_tensors_fused_into_it_is_copied_whole():
    """q, k and v land in slices of one served weight a kernel is built from (vLLM's fused
    qkv): ``prepare`` gets one patched copy of the whole weight, each record at its slice's
    offset, and the served weight is not written before ``apply``."""
    from test_receiver_placement import SPECS, ToyAdapter, _state

    class FusedKernel(ToyAdapter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.copies: list[dict] = []

        def unserved(self):
            return frozenset()

        def kernel_weights(self):
            return frozenset({"qkv"})

        def prepare(self, names, copies):
            self.copies.append({n: c.clone() for n, c in copies.items()})
            return {}

        def install(self, prepared, names, covered):
            pass

    base = {n: t for n, t in _state(0).items() if n in ("q", "k", "v")}
    target = perturb(base, np.random.default_rng(5), frac=0.2)
    adapter = FusedKernel(specs={n: SPECS[n] for n in base})
    load_dense(adapter, base)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    served = bits(adapter.module.qkv)
    batch = deltas(base, target, split_every=1000)
    staged = applier.stage(batch)

    assert staged.covered == {"q", "k", "v"} and not staged.names
    np.testing.assert_array_equal(bits(adapter.module.qkv), served)  # the served weight waits
    (copies,) = adapter.copies
    want = np.concatenate([bits(target[n]) for n in ("q", "k", "v")])
    np.testing.assert_array_equal(copies["qkv"].numpy().view(np.uint16), want)
    assert not np.array_equal(served, want)  # control: the bits moved
    applier.apply(batch, staged)
    np.testing.assert_array_equal(bits(adapter.module.qkv), want)
