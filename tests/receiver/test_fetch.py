"""fetch_chunks: chunks downloaded, verified and decoded on a thread pool come back in
manifest order, identical to one thread, and the first bad chunk refuses the version."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import DecodeBudget, TensorDelta, DeltaOp, chunk_digest, encode_chunk
from nemo_dcr.protocol.manifest import ChunkRef, chunk_key
from nemo_dcr.receiver.fetch import RefitRefused, fetch_chunks
from nemo_dcr.transport.store import open_store

WANT = {"run_id": "r", "model_id": "m", "version": "1", "base_version": "0"}


def _setup(tmp_path, n_chunks=6, n=50_000):
    rng = np.random.default_rng(0)
    store = open_store(str(tmp_path / "store"))
    held, specs, refs = {}, {}, []
    for i in range(n_chunks):
        name = f"t{i}"
        base = rng.integers(0x3C00, 0x3F80, n, dtype=np.uint16)
        pos = np.flatnonzero(rng.random(n) < 0.02).astype(np.int64)
        d = TensorDelta(name=name, dtype="bfloat16", shape=(n,), op=DeltaOp.XOR, positions=pos,
                        values=rng.integers(1, 4, pos.size).astype(np.uint16))
        held[name], specs[name] = base, ("bfloat16", (n,))
        blob = encode_chunk([d], base={name: base}, meta=WANT)
        key = chunk_key(1, 0, i)
        store.put(key, blob)
        refs.append(ChunkRef(key=key, nbytes=len(blob), digest=chunk_digest(blob), rank=0, tensors=1,
                             changed=d.nnz))
    return store, held, specs, refs


def _fetch(store, held, specs, refs, threads):
    return fetch_chunks(store, refs, held=held, specs=specs, budget=DecodeBudget.for_tensors(specs), want=WANT,
                        threads=threads)


def test_threads_give_the_same_deltas_in_manifest_order(tmp_path):
    store, held, specs, refs = _setup(tmp_path)
    one = _fetch(store, held, specs, refs, 1)
    many = _fetch(store, held, specs, refs, 4)
    assert [c.deltas[0].name for c in many.chunks] == [f"t{i}" for i in range(len(refs))]
    for a, b in zip(one.chunks, many.chunks):
        assert np.array_equal(a.deltas[0].positions, b.deltas[0].positions)
        assert np.array_equal(a.deltas[0].values.view(np.int16), b.deltas[0].values.view(np.int16))
    assert many.decoded_param_bytes == sum(2 * 50_000 for _ in refs) and many.decode_gbps > 0


def test_first_bad_chunk_in_manifest_order_refuses(tmp_path):
    store, held, specs, refs = _setup(tmp_path)
    blob = bytearray(store.get(refs[4].key))
    blob[100] ^= 1
    store.put(refs[4].key, bytes(blob))
    store.put(refs[2].key, b"")  # shorter than the manifest says
    with pytest.raises(RefitRefused, match=r"chunk v/00000001/chunks/r000-00002.dcr: 0 bytes, manifest says"):
        _fetch(store, held, specs, refs, 4)
    with pytest.raises(RefitRefused, match=r"chunk v/00000001/chunks/r000-00004.dcr: digest mismatch"):
        _fetch(store, held, specs, refs[3:], 4)
