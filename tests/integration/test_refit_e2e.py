"""End to end: Megatron-Core TP=2 under torchrun -> XOR deltas -> local store -> a Hugging
Face receiver process updated in place.  After every step the receiver's parameters and
buffers must equal, bit for bit, a dense refit of the same step (the trainer's full gather
through the same mapping, loaded through the same loader into a fresh model).

One real run (module fixture, ~1 min) feeds every test; the bad-input tests replay its
store into a fresh in-process receiver.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config
from nemo_dcr.protocol.manifest import Ack, Manifest, ack_key, chunk_key, dense_key, manifest_key
from nemo_dcr.receiver.apply import DeltaApplier
from nemo_dcr.receiver.verify import load_dense, module_state, state_digest
from nemo_dcr.receiver.engine import Receiver, ReceiverConfig
from nemo_dcr.runtimes.hf import HFTransformersAdapter
from nemo_dcr.transport.store import LocalDirStore

STEPS = 3
SMALL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.ffn_hidden_size=256", "model.vocab_size=1003",
         "model.seq_length=32"]


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bit_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (or that exist on one side only); integer views, never allclose."""
    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(_int_bits(a[k]), _int_bits(b[k])):
            out.append(k)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    cfg = load_demo_config([f"run_dir={d}/run", f"store.uri={d}/store", f"steps={STEPS}", *SMALL,
                            "train.lr=3e-6", "refit.verify_dense=true", f"refit.receiver_dump_dir={d}/dump"])
    summary = demo.run(cfg)
    return d, cfg, summary


def _dense_refit_state(d, version: int) -> dict[str, torch.Tensor]:
    """A fresh receiver model, dense-loaded with the trainer's full gather of ``version``."""
    ref = HFTransformersAdapter.from_pretrained(str(d / "store" / "init"))
    load_dense(ref, load_file(str(d / "store" / dense_key(version))))
    return {k: v.clone() for k, v in module_state(ref.module).items()}


def test_every_refit_is_bit_exact_against_a_dense_refit(run):
    d, _cfg, summary = run
    assert summary["refits"] == STEPS and summary["committed"] == STEPS
    assert summary["bit_exact"] == STEPS  # the receiver's own check agrees
    assert 0 < summary["wire_bytes"] < summary["dense_bytes"] / 4
    previous = None
    for v in range(1, STEPS + 1):
        received = load_file(str(d / "dump" / "r0" / f"v{v}.safetensors"))
        expected = _dense_refit_state(d, v)
        assert len(received) == len(expected) > 0
        assert bit_differences(received, expected) == [], f"version {v}"
        if previous is not None:  # non-vacuous: every step changed some weights
            assert bit_differences(received, previous)
        previous = received


def test_negative_control_one_flipped_bit_fails_the_check(run):
    d, _cfg, _ = run
    received = load_file(str(d / "dump" / "r0" / f"v{STEPS}.safetensors"))
    expected = _dense_refit_state(d, STEPS)
    name = "model.layers.1.self_attn.o_proj.weight"
    flipped = received[name].clone()
    _int_bits(flipped).view(-1)[17] ^= 1
    assert bit_differences({**received, name: flipped}, expected) == [name]


# ---------------------------------------------------------------- bad input
@pytest.fixture
def fresh(run, tmp_path):
    """A copy of the run's store and a receiver at version 0 built from its init checkpoint."""
    d, cfg, _ = run
    shutil.copytree(d / "store", tmp_path / "store")
    store = LocalDirStore(str(tmp_path / "store"))
    adapter = HFTransformersAdapter.from_pretrained(str(tmp_path / "store" / "init"))
    applier = DeltaApplier(adapter)
    applier.prewarm()
    rx = Receiver(applier, store, ReceiverConfig(receiver_id="t0", model_id=cfg.refit.model_id))
    return store, rx, adapter


def _manifest(store, v):
    return Manifest.from_json(store.get(manifest_key(v)))


def _apply(rx, manifest):
    return rx.apply_tentative(manifest, "", run_id=manifest.run_id)


def _refused(rx, adapter, manifest, *needles):
    before = state_digest(adapter.module)
    ack = _apply(rx, manifest)
    assert not ack.ok and rx.held_version == 0
    for n in needles:
        assert n in ack.error, ack.error
    assert state_digest(adapter.module) == before  # nothing written
    return ack


def test_clean_replay_applies(fresh):
    """Control for the tests below: the untouched store applies and changes the weights."""
    store, rx, adapter = fresh
    before = state_digest(adapter.module)
    ack = _apply(rx, _manifest(store, 1))
    assert ack.ok, ack.error
    assert rx.held_version == 1 and state_digest(adapter.module) != before


def test_flipped_bit_in_chunk_is_refused_by_digest(fresh):
    store, rx, adapter = fresh
    m = _manifest(store, 1)
    key = m.chunks[0].key
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0x10
    store.put(key, bytes(blob))
    _refused(rx, adapter, m, key, "digest")


def test_receiver_that_diverged_from_the_base_refuses_context_chunks(fresh):
    """Context records are decoded against the bits the receiver holds.  Here those are
    not the trainer's committed base (the exponent of one element the step changes is
    flipped): the decoded content fails its checksum and the version is refused before
    any write.  (Divergence at an element the delta does not touch is invisible to any
    delta; see docs/protocol.md.)"""
    from nemo_dcr.codec import decode_chunk, read_chunk_index
    from nemo_dcr.receiver.held import HeldBits

    store, rx, adapter = fresh
    m = _manifest(store, 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    held = HeldBits(rx.served)
    changed = None
    for c in m.chunks:
        blob = store.get(c.key)
        if any(i.name == name and i.context for i in read_chunk_index(blob).records):
            changed = next(d.positions[0] for d in decode_chunk(blob, base=held).deltas if d.name == name)
    assert changed is not None  # column-parallel q_proj is coded in context mode
    with torch.no_grad():
        _int_bits(adapter.module.get_parameter(name)).view(-1)[int(changed)] ^= 1 << 14
    _refused(rx, adapter, m, "chunk v/00000001/chunks/")


def test_wrong_base_version_is_refused(fresh):
    store, rx, adapter = fresh
    _refused(rx, adapter, _manifest(store, 2), "base version 1", "holds version 0")


def test_truncated_chunk_is_refused(fresh):
    store, rx, adapter = fresh
    m = _manifest(store, 1)
    key = m.chunks[-1].key
    store.put(key, store.get(key)[:-7])
    _refused(rx, adapter, m, key, "bytes")


def test_truncated_chunk_with_matching_digest_is_refused_by_the_decoder(fresh):
    """Even a manifest that vouches for the truncated bytes cannot get them applied."""
    from nemo_dcr.codec import chunk_digest
    from nemo_dcr.protocol.manifest import ChunkRef

    store, rx, adapter = fresh
    m = _manifest(store, 1)
    ref = m.chunks[-1]
    short = store.get(ref.key)[:-7]
    store.put(ref.key, short)
    forged = ChunkRef(key=ref.key, nbytes=len(short), digest=chunk_digest(short), rank=ref.rank,
                      tensors=ref.tensors, changed=ref.changed)
    m2 = Manifest(run_id=m.run_id, model_id=m.model_id, version=m.version, base_version=m.base_version,
                  base_digest=m.base_digest, chunks=m.chunks[:-1] + (forged,), stats=m.stats)
    _refused(rx, adapter, m2, ref.key)


def test_chunk_of_another_version_is_refused(fresh):
    """A chunk moved under another version's name fails the header check."""
    store, rx, adapter = fresh
    m1, m2 = _manifest(store, 1), _manifest(store, 2)
    stray = m2.chunks[0]
    blob = store.get(stray.key)
    store.put(chunk_key(1, 7, 0), blob)
    from nemo_dcr.protocol.manifest import ChunkRef

    moved = ChunkRef(key=chunk_key(1, 7, 0), nbytes=stray.nbytes, digest=stray.digest, rank=7,
                     tensors=stray.tensors, changed=stray.changed)
    bad = Manifest(run_id=m1.run_id, model_id=m1.model_id, version=1, base_version=0, base_digest=m1.base_digest,
                   chunks=m1.chunks + (moved,), stats={})
    _refused(rx, adapter, bad, chunk_key(1, 7, 0), "disagrees")


def test_manifest_is_parsed_strictly(run):
    d, _cfg, _ = run
    raw = json.loads((d / "store" / manifest_key(1)).read_bytes())
    raw["surprise"] = 1
    from nemo_dcr.protocol.manifest import ManifestError

    with pytest.raises(ManifestError, match="unknown fields"):
        Manifest.from_json(json.dumps(raw).encode())
    raw.pop("surprise")
    raw["chunks"][0]["digest"] = "md5:abc"
    with pytest.raises(ManifestError, match="digest"):
        Manifest.from_json(json.dumps(raw).encode())
    assert Manifest.from_json((d / "store" / manifest_key(1)).read_bytes()).version == 1


def test_refit_through_s3(s3_bucket, tmp_path):
    """The same pipeline with chunks, manifests and acks on a real S3-compatible server."""
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={s3_bucket}/refit", "steps=2", *SMALL,
                            "model.num_layers=1", "train.lr=3e-6", "refit.verify_dense=true",
                            "refit.coding=plain"])  # the context-free coding path, end to end
    summary = demo.run(cfg)
    assert summary["refits"] == 2 and summary["committed"] == 2 and summary["bit_exact"] == 2
    from nemo_dcr.transport.store import open_store

    store = open_store(f"{s3_bucket}/refit")
    assert store.exists(manifest_key(2)) and store.exists("acks/r0/00000002.json")


def test_refit_with_pipeline_parallelism(tmp_path):
    """PP=2 (TP=1): each stage emits the layers it owns; layer indices come from Megatron's
    global offsets.  The receiver's own integer-view check against the dense refit must
    pass on every step."""
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"steps={STEPS}", *SMALL,
                            "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                            "train.lr=3e-6", "refit.verify_dense=true", f"refit.receiver_dump_dir={tmp_path}/dump"])
    summary = demo.run(cfg)
    assert summary["refits"] == STEPS and summary["committed"] == STEPS and summary["bit_exact"] == STEPS
    for v in range(1, STEPS + 1):
        received = load_file(str(tmp_path / "dump" / "r0" / f"v{v}.safetensors"))
        expected = _dense_refit_state(tmp_path, v)
        assert bit_differences(received, expected) == [], f"version {v}"


def test_data_parallel_replicas_emit_once_and_two_receivers_commit_jointly(tmp_path):
    """DP=2 (TP=1): both ranks hold the whole model; Megatron's replica_id makes rank 0 the
    only emitter, so no element is sent twice.  Two receivers: a version commits only
    after both acknowledged it, and both end bit-exact."""
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", "steps=2", *SMALL,
                            "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2",
                            "train.lr=3e-6", "refit.receivers=[r0,r1]", "refit.verify_dense=true"])
    summary = demo.run(cfg)
    assert summary["refits"] == 2 and summary["committed"] == 2 and summary["bit_exact"] == 2
    store = LocalDirStore(str(tmp_path / "store"))
    for v in (1, 2):
        m = _manifest(store, v)
        assert m.chunks and {c.rank for c in m.chunks} == {0}
        for rid in ("r0", "r1"):
            ack = Ack.from_json(store.get(ack_key(rid, v)))
            assert ack.ok and ack.stats["bit_exact"] is True
    rows = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [sorted(a["receiver"] for a in r["acks"]) for r in rows] == [["r0", "r1"]] * 2
    # read directly from the store (refit.transport=store, the default), each receiver made the
    # origin serve its own copy of the chunks: the negative control of
    # tests/integration/test_demo_relay.py's origin_read_bytes ~ wire_bytes under relays
    print(json.dumps({k: summary[k] for k in ("transport", "relays", "wire_bytes", "origin_read_bytes")}))
    assert summary["transport"] == "store" and summary["relays"] == 0
    assert summary["origin_read_bytes"] >= 2 * summary["wire_bytes"] * 0.9 > 1.2 * summary["wire_bytes"]
