"""Inputs of the golden chunks in tests/codec/data/ (``<coding>_v1.npz``), and how they were
made: ``python tests/codec/golden.py CODING...`` (re)writes them with the encoder of the
checkout, so run it only for a coding that has no golden chunk yet.  test_golden.py decodes
the stored chunks (they must decode as they did when they were made) and re-encodes the
inputs (the current encoder must still write the same bytes).

The inputs are numpy-only (no torch), seeded, and cover one chunk per mode, each with several
records (so BUCKET's shared state carries): a bf16 XOR delta shaped like an AdamW step, a
bf16 overwrite, a float32 XOR delta over a sub-range and an int32 XOR delta."""
from __future__ import annotations

import pathlib
import sys

import numpy as np

from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, encode_chunk

DATA = pathlib.Path(__file__).parent / "data"
NAMES = ("a", "b", "c", "d")


def inputs() -> tuple[list[TensorDelta], dict[str, np.ndarray]]:
    rng = np.random.default_rng(20261202)
    n = 30_000
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    base_a = (w.view(np.uint32) >> 16).astype(np.uint16)
    step = (rng.standard_normal(n) * 6e-6).astype(np.float32)
    tgt = ((base_a.astype(np.uint32) << 16).view(np.float32) + step).view(np.uint32)
    tgt_a = ((tgt + 0x8000) >> 16).astype(np.uint16)  # round half up: deterministic everywhere
    pos_a = np.flatnonzero(tgt_a != base_a).astype(np.int64)
    a = TensorDelta(name="a", dtype="bfloat16", shape=(n // 100, 100), op=DeltaOp.XOR, positions=pos_a,
                    values=base_a[pos_a] ^ tgt_a[pos_a])
    pos_b = np.sort(rng.choice(n, 700, replace=False)).astype(np.int64)
    b = TensorDelta(name="b", dtype="bfloat16", shape=(n,), op=DeltaOp.OVERWRITE, positions=pos_b,
                    values=tgt_a[pos_b] ^ (rng.random(700) < 0.1).astype(np.uint16))
    m = 12_000
    base_c = (rng.standard_normal(m) * 0.05).astype(np.float32).view(np.uint32)
    pos_c = np.sort(rng.choice(np.arange(1000, 11_000), 400, replace=False)).astype(np.int64)
    c = TensorDelta(name="c", dtype="float32", shape=(m,), op=DeltaOp.XOR, positions=pos_c,
                    values=rng.integers(1, 1 << 12, 400).astype(np.uint32), element_range=(1000, 11_000))
    base_d = rng.integers(-(1 << 20), 1 << 20, 5000).astype(np.int32).view(np.uint32)
    pos_d = np.sort(rng.choice(5000, 90, replace=False)).astype(np.int64)
    d = TensorDelta(name="d", dtype="int32", shape=(5000,), op=DeltaOp.XOR, positions=pos_d,
                    values=rng.integers(1, 1 << 8, 90).astype(np.uint32))
    return [a, b, c, d], {"a": base_a, "b": base_a, "c": base_c, "d": base_d}


def encode(coding: Coding, context: bool) -> bytes:
    deltas, bases = inputs()
    return encode_chunk(deltas, base=bases if context else None, codings=[coding],
                        meta={"made_by": f"tests/codec/golden.py {coding.name}"})


def write(coding: Coding) -> pathlib.Path:
    out = DATA / f"{coding.name.lower()}_v1.npz"
    np.savez_compressed(out, **{f"chunk_{mode}": np.frombuffer(encode(coding, mode == "context"), dtype=np.uint8)
                                for mode in ("free", "context")})
    return out


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(write(Coding[name]))
