"""Golden chunks (tests/codec/data/<coding>_v1.npz, written by tests/codec/golden.py when the
coding was added): each still decodes to the inputs it was made from, compared as integer
views, and the current encoder still writes the same bytes.  Negative controls: a decoded
array with one bit flipped no longer compares equal, and the re-encoding of an input with one
value changed differs from the golden bytes."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, bucket, decode_chunk, read_chunk_index

import golden

CODINGS = [c for c in (Coding.BUCKET, getattr(Coding, "LANES", None)) if c is not None]
pytestmark = pytest.mark.skipif(not bucket.available(), reason="native rANS coder (_crans) not built")


def _load(coding: Coding, mode: str) -> bytes:
    path = golden.DATA / f"{coding.name.lower()}_v1.npz"
    return np.load(path)[f"chunk_{mode}"].tobytes()


def _ints(a: np.ndarray) -> np.ndarray:
    return a.view(f"<u{a.dtype.itemsize}")


@pytest.mark.parametrize("coding", CODINGS, ids=lambda c: c.name)
@pytest.mark.parametrize("mode", ["free", "context"])
def test_golden_chunk_decodes_to_its_inputs(coding, mode):
    chunk = _load(coding, mode)
    deltas, bases = golden.inputs()
    infos = read_chunk_index(chunk).records
    assert [i.coding for i in infos] == [coding] * len(deltas)
    assert all(i.context is (mode == "context") for i in infos)
    out = decode_chunk(chunk, base=bases if mode == "context" else None)
    assert out.meta["made_by"] == f"tests/codec/golden.py {coding.name}"
    for want, got in zip(deltas, out.deltas):
        assert got.name == want.name and got.dtype == want.dtype and got.op is want.op
        keep = want.values != 0 if want.op is DeltaOp.XOR else slice(None)
        assert np.array_equal(got.positions, want.positions[keep])
        assert got.values.dtype == want.values.dtype
        assert np.array_equal(_ints(got.values), _ints(want.values[keep]))
    # negative control: the comparison sees one flipped bit
    flipped = out.deltas[0].values.copy()
    flipped[-1] ^= 1
    assert not np.array_equal(_ints(flipped), _ints(deltas[0].values))


@pytest.mark.parametrize("coding", CODINGS, ids=lambda c: c.name)
@pytest.mark.parametrize("mode", ["free", "context"])
def test_current_encoder_writes_the_golden_bytes(coding, mode):
    chunk = _load(coding, mode)
    assert golden.encode(coding, mode == "context") == chunk
    # negative control: one value changed gives other bytes
    deltas, bases = golden.inputs()
    d = deltas[0]
    vals = d.values.copy()
    vals[0] ^= 3
    deltas[0] = TensorDelta(name=d.name, dtype=d.dtype, shape=d.shape, op=d.op, positions=d.positions, values=vals)
    from nemo_dcr.codec import encode_chunk
    other = encode_chunk(deltas, base=bases if mode == "context" else None, codings=[coding],
                         meta={"made_by": f"tests/codec/golden.py {coding.name}"})
    assert other != chunk
