"""Shared by the protocol tests: a trainer-side RefitSender without a process group, and
receivers (Receiver + Follower) on threads over a stand-in runtime (canonical numpy arrays
updated with the codec's ``apply_delta_``), through a real directory store."""
import re
import threading

import numpy as np
import pytest
import torch

from nemo_dcr.codec import apply_delta_
from nemo_dcr.sender import RefitOptions, RefitSender
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.protocol.follower import Follower
from nemo_dcr.protocol.history import init_digest
from nemo_dcr.protocol.version0 import write_init_record
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
from nemo_dcr.receiver.errors import DeltaValidationError
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.receiver.runtime import TensorSpec
from nemo_dcr.transport.store import LocalDirStore, ObjectInfo, ObjectNotFound, ObjectTooLarge

DIMS = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                 ffn_hidden_size=8, vocab_size=8)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()


class ArrayRuntime:
    """Canonical tensors as numpy bit arrays (a ``ServedModel``).  ``refuse``: numbers of
    apply attempts (1, 2, ...) refused before any write; ``fail_after``: {attempt: k} applies
    the first k records of that attempt, then raises (a partial write).  Repairs (undo
    batches) are not attempts."""

    def __init__(self, tensors: dict[str, torch.Tensor], refuse=(), fail_after=None):
        self.bits = {k: bits_of(v) for k, v in tensors.items()}
        self.specs = {k: TensorSpec.of(k, v) for k, v in tensors.items()}
        self.refuse = set(refuse)
        self.fail_after = dict(fail_after or {})
        self.calls = 0

    def tensor_specs(self):
        return self.specs

    def verify_dense(self, dense):
        raise NotImplementedError

    def sample(self):
        return None

    def canonical_bits(self, name):
        return self.bits[name]

    def validate(self, deltas):
        self.calls += 1
        self._armed = True
        if self.calls in self.refuse:
            raise DeltaValidationError(f"refusing apply call {self.calls} (test)")

    def apply(self, deltas):
        armed, self._armed = getattr(self, "_armed", False), False
        for i, d in enumerate(deltas):
            if armed and self.fail_after.get(self.calls) == i:
                raise RuntimeError(f"injected failure at record {i}")
            apply_delta_(self.bits[d.name], d)


@pytest.fixture
def key(tmp_path):
    return new_key_file(str(tmp_path / "key"))


def _sender(tmp_path, params, key, receivers=("r0",), store=None, **kw):
    spec = ShardSpec(key="w", local_shape=tuple(params["w"].shape), global_shape=tuple(params["w"].shape),
                     global_offset=(0, 0), prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    proj = CanonicalProjector((Rule("w", {"": "canon.w"}),), DIMS)
    store = store or LocalDirStore(str(tmp_path / "store"))
    kw.setdefault("ack_timeout_s", 20)
    cfg = RefitOptions(model_id="m", receivers=receivers, key_file=key, ack_poll_s=0.01, **kw)
    sender = RefitSender(params, {"w": [ParamView("w", 0, spec)]}, proj, store, cfg)
    sender.claim()
    # version 0: this stand-in runtime needs no files, only the signed root of the chain
    sender.set_root(write_init_record(store, sender.sealer, sender.run_id, {}))
    return sender, store


def root_of(store, key, run_id):
    return init_digest(store, Sealer(load_key(key)), run_id)


class Rx:
    """A receiver on a thread: Receiver + Follower over an ArrayRuntime."""

    def __init__(self, rid, store, key, run_id, w0, compose_after=4, **runtime_kw):
        self.runtime = ArrayRuntime({"canon.w": w0.clone()}, **runtime_kw)
        self.rx = Receiver(self.runtime, store, ReceiverConfig(receiver_id=rid, model_id="m", poll_s=0.01))
        self.events = []
        sealer = Sealer(load_key(key))
        self.follower = Follower(self.rx, store, sealer, run_id, receiver_id=rid, log=self.events.append,
                                 compose_after=compose_after, committed_digest=init_digest(store, sealer, run_id))
        self.thread = None
        self.error = None

    def start(self, until):
        def go():
            try:
                self.follower.run(until_version=until, timeout_s=20, poll_s=0.01)
            except BaseException as e:  # surfaced by join()
                self.error = e
        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()
        return self

    def join(self):
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        if self.error:
            raise self.error

    @property
    def w(self):
        return self.runtime.bits["canon.w"]


def _step(w: torch.Tensor, rng, frac=0.05):
    bits = w.view(torch.int16).reshape(-1)
    idx = torch.from_numpy(rng.choice(bits.numel(), int(bits.numel() * frac), replace=False))
    bits[idx] ^= torch.from_numpy(rng.integers(1, 1 << 15, idx.numel()).astype(np.int16))


class Liar:
    """A relay over ``inner`` that lies about the keys of its rules.  A rule is
    ``(pattern, kind, times)``: ``kind`` in ``swap:<key>`` (serve that key's genuine bytes,
    with the asked key's own tag), ``garble`` (the bytes with one flipped), ``413``, ``hide``
    (404 for stat and get), ``freeze``
    (serve the copy held when the rule was added), ``drop`` / ``flip`` (puts); ``times``:
    how many answers lie (None: every one).  A read lies only where the origin has the key
    (a lie about something not there yet is just "not found")."""

    is_relay = True

    def __init__(self, inner: LocalDirStore, uri: str = "relay://liar:1"):
        self.inner, self.uri = inner, uri
        self.rules: list[list] = []
        self.lies = 0

    def lie(self, pattern: str, kind: str, times: int | None = 1) -> "Liar":
        frozen = self.inner.get_with_info(pattern.replace("\\", "")) if kind == "freeze" else None
        self.rules.append([re.compile(pattern), kind, times, frozen])
        return self

    def _rule(self, key: str, kinds: tuple[str, ...]):
        for r in self.rules:
            if r[0].fullmatch(key) and r[1].split(":")[0] in kinds and (r[2] is None or r[2] > 0):
                return r
        return None

    def _take(self, r) -> str:
        if r[2] is not None:
            r[2] -= 1
        self.lies += 1
        return r[1]

    def stat(self, key):
        info = self.inner.stat(key)
        r = self._rule(key, ("hide", "freeze"))
        if info is None or r is None:
            return info
        if r[1] == "freeze":
            return r[3][1]
        self._take(r)
        return None

    def exists(self, key):
        return self.stat(key) is not None

    def get_with_info(self, key, *, max_bytes=None):
        data, info = self.inner.get_with_info(key, max_bytes=max_bytes)
        r = self._rule(key, ("swap", "garble", "413", "hide", "freeze"))
        if r is None:
            return data, info
        kind = r[1] if r[1] == "freeze" else self._take(r)
        if kind == "hide":
            raise ObjectNotFound(f"{self.uri}: get {key!r}: no such object")
        if kind == "413":
            raise ObjectTooLarge(self.uri, key, 1 << 30, max_bytes or 0)
        if kind == "freeze":
            return r[3]
        if kind == "garble":
            i = len(data) // 2
            return data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1:], info
        other = self.inner.get(kind.split(":", 1)[1])
        return other, ObjectInfo(key, len(other), info.tag)  # the genuine copy's identity

    def get(self, key, *, max_bytes=None):
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def put(self, key, data):
        r = self._rule(key, ("drop", "flip"))
        if r is None:
            return self.inner.put(key, data)
        if self._take(r) == "flip":
            self.inner.put(key, data.replace(b'"ok": true', b'"ok": false'))
        # drop: answered 204, not forwarded

    def list(self, prefix, *, limit=None):
        return self.inner.list(prefix, limit=limit)

    def delete(self, key):
        self.inner.delete(key)
