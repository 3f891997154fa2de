"""The comparison the other receiver tests rely on must itself catch every kind of drift."""
from __future__ import annotations

import pytest
import torch

from nemo_dcr.receiver.verify import compare_modules, compare_tensors, state_digest, tensor_digest

from receiver_helpers import flip_one_bit, llama


def test_identical_models_compare_equal_including_buffers():
    a, b = llama(), llama()
    report = compare_modules(a, b)
    assert report.equal, report.summary()
    assert "model.rotary_emb.inv_freq" in dict(a.named_buffers())
    assert report.compared == len(list(a.named_parameters())) + len(list(a.named_buffers()))
    assert state_digest(a) == state_digest(b)


@pytest.mark.parametrize(
    "name,index,shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", 65, (32, 64)),  # a parameter
        ("model.rotary_emb.inv_freq", 3, (8,)),  # a non-persistent buffer
    ],
)
def test_one_flipped_bit_is_reported_with_its_place(name, index, shape):
    a, b = llama(), llama()
    target = dict(list(b.named_parameters()) + list(b.named_buffers()))[name]
    assert tuple(target.shape) == shape
    before = int(target.detach().reshape(-1).view(torch.int16)[index]) & 0xFFFF
    flip_one_bit(target, index)
    report = compare_modules(a, b)
    assert not report.equal and report.mismatched_names == {name}
    (d,) = report.differences
    want_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), shape))
    assert (d.kind, d.count, d.first_index) == ("bits", 1, want_index)
    assert (d.left_bits, d.right_bits) == (before, before ^ 1)
    digests_a, digests_b = state_digest(a), state_digest(b)
    assert {n for n in digests_a if digests_a[n] != digests_b[n]} == {name}
    with pytest.raises(AssertionError, match=name.replace(".", r"\.")):
        report.raise_if_different()


def test_negative_zero_and_nan_payloads_are_not_equal_to_their_float_twins():
    # allclose / == would call these equal (or never equal); integer views tell them apart
    zero = torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)
    other = zero.clone()
    other.view(torch.int16)[0] = -32768  # -0.0
    other.view(torch.int16)[1] = 0x7FC1  # NaN with another payload
    report = compare_tensors({"t": zero}, {"t": other})
    assert report.differences[0].count == 2
    assert compare_tensors({"t": zero}, {"t": zero.clone()}).equal


def test_dtype_shape_and_missing_names_are_reported():
    t = torch.zeros(4, dtype=torch.bfloat16)
    report = compare_tensors(
        {"a": t, "b": t, "c": t},
        {"a": t.to(torch.float16), "b": t.reshape(2, 2), "d": t},
    )
    assert {(d.name, d.kind) for d in report.differences} == {("a", "dtype"), ("b", "shape")}
    assert report.only_left == ("c",) and report.only_right == ("d",)
    assert report.mismatched_names == {"a", "b", "c", "d"}


def test_tensor_digest_covers_dtype_and_shape():
    t = torch.arange(6, dtype=torch.int16)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.view(torch.bfloat16))
    assert tensor_digest(t).startswith("sha256:")
