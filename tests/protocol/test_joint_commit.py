"""Joint commit, in one process: a trainer-side RefitSender (no process group) and a
Receiver on a thread, through a real directory store.

The receiver's runtime is a stand-in here (canonical numpy arrays updated with the codec's
``apply_delta_``): this test is about versions and commits, not placement -- the real
runtime path is covered by tests/receiver and tests/integration.
"""
import threading

import numpy as np
import pytest
import torch

from nemo_dcr.codec import apply_delta_, read_chunk_index
from nemo_dcr.integrations.sender import ReceiverRefused, RefitSender, SenderConfig
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.protocol.manifest import COMMITTED_KEY, Ack, Committed, Manifest, ack_key, manifest_key
from nemo_dcr.receiver.errors import DeltaValidationError
from nemo_dcr.receiver.worker import Receiver, ReceiverConfig
from nemo_dcr.transport.store import LocalDirStore

DIMS = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                 ffn_hidden_size=8, vocab_size=8)


class ArrayRuntime:
    """Canonical tensors as numpy bit arrays; refuses the versions listed in ``refuse``.
    A ``ServedModel`` (receiver/served.py): ``apply``, ``tensor_specs`` and, for
    context-mode decoding, ``canonical_bits``; no dense verification, no sample."""

    def __init__(self, tensors: dict[str, torch.Tensor], refuse=()):
        self.bits = {k: v.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy() for k, v in tensors.items()}
        self.refuse = set(refuse)
        self.calls = 0
    def tensor_specs(self):
        return dict.fromkeys(self.bits)

    def verify_dense(self, dense):
        raise NotImplementedError

    def sample(self):
        return None

    def canonical_bits(self, name):
        return self.bits[name]

    def apply(self, deltas):
        self.calls += 1
        if self.calls in self.refuse:
            raise DeltaValidationError(f"refusing apply call {self.calls} (test)")
        for d in deltas:
            apply_delta_(self.bits[d.name], d)


def _sender(tmp_path, params, **kw):
    spec = ShardSpec(key="w", local_shape=tuple(params["w"].shape), global_shape=tuple(params["w"].shape),
                     global_offset=(0, 0), prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    proj = CanonicalProjector((Rule("w", {"": "canon.w"}),), DIMS)
    store = LocalDirStore(str(tmp_path / "store"))
    cfg = SenderConfig(model_id="m", receivers=("r0",), ack_timeout_s=20, **kw)
    return RefitSender(params, {"w": [ParamView("w", 0, spec)]}, proj, store, cfg), store


def _step(w: torch.Tensor, rng, frac=0.05):
    bits = w.view(torch.int16).reshape(-1)
    idx = torch.from_numpy(rng.choice(bits.numel(), int(bits.numel() * frac), replace=False))
    bits[idx] ^= torch.from_numpy(rng.integers(1, 1 << 15, idx.numel()).astype(np.int16))


def test_baseline_advances_only_on_commit_and_a_refused_version_is_skipped(tmp_path):
    rng = np.random.default_rng(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    params = {"w": w}
    sender, store = _sender(tmp_path, params, chunk_bytes=512)
    runtime = ArrayRuntime({"canon.w": w.clone()}, refuse={2})
    rx = Receiver(runtime, store, ReceiverConfig(receiver_id="r0", model_id="m", poll_s=0.01))
    t = threading.Thread(target=rx.run, kwargs={"until_version": 3, "timeout_s": 20})
    t.start()
    try:
        _step(w, rng)
        stats = sender.refit(1)
        assert stats.committed and stats.chunks > 1  # several chunks: streaming flushes
        m1 = Manifest.from_json(store.get(manifest_key(1)))
        infos = [i for c in m1.chunks for i in read_chunk_index(store.get(c.key)).records]
        assert infos and all(i.context for i in infos)  # coded against the committed base
        assert Committed.from_json(store.get(COMMITTED_KEY)).version == 1
        _step(w, rng)
        with pytest.raises(ReceiverRefused, match="refusing apply call 2"):
            sender.refit(2)
        assert sender.baseline.version == 1  # not advanced
        assert not Ack.from_json(store.get(ack_key("r0", 2))).ok
        _step(w, rng)
        stats = sender.refit(3)  # diffed against version 1, which the receiver still holds
        assert stats.base_version == 1 and stats.committed
    finally:
        t.join(timeout=30)
    assert rx.held_version == 3
    assert all(a["ok"] for a in stats.acks)
    want = w.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    np.testing.assert_array_equal(runtime.bits["canon.w"], want)
    # the committed baseline holds exactly the trainer's current bits
    np.testing.assert_array_equal(sender.baseline.bits("w"), want)


def test_unacknowledged_version_times_out_and_is_not_committed(tmp_path):
    w = torch.randn(16, 16).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w})
    sender.cfg = SenderConfig(model_id="m", receivers=("r0",), ack_timeout_s=0.3)
    _step(w, np.random.default_rng(1))
    with pytest.raises(ReceiverRefused, match="no acknowledgement"):
        sender.refit(1)
    assert sender.baseline.version == 0 and not store.exists(COMMITTED_KEY)
