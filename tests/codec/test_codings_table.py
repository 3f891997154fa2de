"""The codings table's decode contract (``codec/codings.py``): whatever payload a row's
``decode`` accepts, honest or damaged, it returns positions strictly increasing inside the
record's range.  The chunk decoder relies on it to build its ``TensorDelta`` without checking
the order again.

Each row decodes its own honest payload (the arrays back, bit for bit) and then a few hundred
damaged copies (bytes flipped, cut, repeated), through ``decode_payload`` as the chunk decoder
calls it (the directory's size check first); every copy it accepts must keep the contract.
Negative control: the contract check refuses arrays that break it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nemo_dcr.codec import ChunkFormatError
from nemo_dcr.codec.codings import CODINGS
from nemo_dcr.codec.model import ModelStates
from nemo_dcr.codec.payload import decode_payload
from nemo_dcr.codec.record import RecordSpec
from nemo_dcr.codec.types import DeltaOp

from codec_helpers import random_bits

N, LO, HI = 6000, 37, 5900
DAMAGED = 250


def _keeps_contract(pos: np.ndarray, lo: int, hi: int) -> bool:
    return pos.dtype == np.int64 and (pos.size == 0 or (pos[0] >= lo and pos[-1] < hi and bool(np.all(np.diff(pos) > 0))))


def test_contract_check_can_fail():
    assert _keeps_contract(np.array([LO, LO + 5, HI - 1], np.int64), LO, HI)
    assert not _keeps_contract(np.array([LO, LO + 5, LO + 5], np.int64), LO, HI)
    assert not _keeps_contract(np.array([LO + 9, LO + 5], np.int64), LO, HI)
    assert not _keeps_contract(np.array([LO - 1, LO + 5], np.int64), LO, HI)
    assert not _keeps_contract(np.array([LO, HI], np.int64), LO, HI)


def _damaged(rng: np.random.Generator, payload: bytes):
    for _ in range(DAMAGED):
        b = bytearray(payload)
        kind = rng.integers(3)
        if kind == 0 and b:  # flip 1-3 bytes
            for i in rng.integers(0, len(b), rng.integers(1, 4)):
                b[i] ^= int(rng.integers(1, 256))
        elif kind == 1 and b:  # cut
            del b[int(rng.integers(0, len(b))):]
        else:  # repeat a piece
            i = int(rng.integers(0, len(b) + 1))
            b[i:i] = b[max(0, i - 16):i]
        yield memoryview(bytes(b))


@pytest.mark.parametrize("context", [False, True])
@pytest.mark.parametrize("op", [DeltaOp.XOR, DeltaOp.OVERWRITE])
@pytest.mark.parametrize("coding", list(CODINGS), ids=lambda c: c.name)
def test_every_accepted_payload_keeps_positions_increasing_in_range(coding, op, context):
    row = CODINGS[coding]
    if not row.available():
        pytest.skip(f"{coding.name}: {row.native} not built")
    if context and not row.context:
        pytest.skip(f"{coding.name} has no context mode")
    rng = np.random.default_rng(int(coding) * 4 + 2 * (op is DeltaOp.OVERWRITE) + context)
    base = random_bits(rng, "bfloat16", N)
    pos = (np.flatnonzero(rng.random(HI - LO) < 0.05) + LO).astype(np.int64)
    new = random_bits(rng, "bfloat16", pos.size)
    vals = base[pos] ^ new if op is DeltaOp.XOR else new
    keep = vals != 0
    pos, vals = pos[keep], np.ascontiguousarray(vals[keep])
    spec = RecordSpec(dtype="bfloat16", shape=(N,), op=op, lo=LO, hi=HI, nnz=pos.size)
    b = base if context else None
    trial = row.trial(spec, pos, vals, b, ModelStates()) if row.trial else None
    if trial is None:
        pytest.skip(f"{coding.name} does not code this record")
    payload = trial.payload if trial.payload is not None else row.materialize(spec, pos, vals)
    spec = dataclasses.replace(spec, param=trial.param)
    got_pos, got_val = row.decode(spec, memoryview(payload), b, ModelStates())
    assert np.array_equal(got_pos, pos) and np.array_equal(got_val, vals)
    for bad in _damaged(rng, payload):
        try:
            p, v = decode_payload(spec, coding, bad, b, ModelStates())  # the size check, then the row's decode
        except (ChunkFormatError, ValueError):
            continue
        assert p.size == v.size
        assert _keeps_contract(p, LO, HI), f"{coding.name} returned positions out of order or range"
