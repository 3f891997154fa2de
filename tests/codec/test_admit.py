"""Admission of untrusted chunks (``decode_chunk(expect=..., budget=...)``): every record is
checked and charged from the directory alone, so a hostile chunk is refused in memory
proportional to its header, while honest chunks decode exactly as before."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import zstandard

from nemo_dcr.codec import (
    ChunkFormatError,
    ChunkValidationError,
    Coding,
    DecodeBudget,
    DeltaOp,
    TensorDelta,
    decode_chunk,
    encode_chunk,
    read_chunk_index,
)
from nemo_dcr.codec import chunk as chunk_mod
from nemo_dcr.codec.model import max_entries as model_max_entries
from nemo_dcr.codec.payload import RecordSpec, check_payload_size
from nemo_dcr.codec.raw import ZSTD_MAX_RATIO
from nemo_dcr.errors import ValidationError

from codec_helpers import entry_fields, forge_chunk, needs_native, random_bits, xor_delta

HERE = pathlib.Path(__file__).parent

SPECS = {"a.weight": ("bfloat16", (40, 64)), "b.bias": ("float32", (300,)), "c": ("float8_e4m3fn", (16, 16))}


def _honest(rng, context: bool = False, dense: str | None = None):
    """A chunk over SPECS (5-30% changed; ``dense`` changes every element of that tensor)."""
    bases, deltas = {}, []
    for name, (dtype, shape) in SPECS.items():
        n = int(np.prod(shape))
        b = random_bits(rng, dtype, n)
        t = b.copy()
        idx = np.arange(n) if name == dense else np.flatnonzero(rng.random(n) < 0.2)
        t[idx] = ~b[idx]  # every chosen element really changes
        bases[name] = b
        deltas.append(xor_delta(name, dtype, shape, b, t))
    return encode_chunk(deltas, meta={"v": "1"}, base=bases if context else None), bases, deltas


@pytest.fixture
def no_payload_decoding(monkeypatch):
    """Fails the test if any payload is decoded; ``calls`` counts attempts."""
    calls = []

    def spy(*a, **k):
        calls.append(a)
        raise AssertionError("a payload was decoded")

    monkeypatch.setattr(chunk_mod, "decode_payload", spy)
    return calls


# ------------------------------------------------------------------ honest chunks still decode

@pytest.mark.parametrize("context", [False, pytest.param(True, marks=needs_native)])
def test_honest_chunk_decodes_identically_with_admission(rng, context):
    data, bases, deltas = _honest(rng, context)
    plain = decode_chunk(data, base=bases)
    budget = DecodeBudget.for_tensors(SPECS)
    admitted = decode_chunk(data, base=bases, expect=SPECS, budget=budget)
    assert [d.name for d in admitted.deltas] == [d.name for d in plain.deltas] == list(SPECS)
    for a, p, want in zip(admitted.deltas, plain.deltas, deltas):
        assert np.array_equal(a.positions, p.positions) and np.array_equal(a.values, p.values)
        assert np.array_equal(a.positions, want.positions) and np.array_equal(a.values, want.values)
    assert budget.changed == sum(d.nnz for d in deltas) > 0
    assert budget.scanned == (sum(d.element_range[1] - d.element_range[0] for d in deltas) if context else 0)
    assert read_chunk_index(data, expect=SPECS).records == plain.records


def test_expect_accepts_objects_with_dtype_and_shape(rng):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Spec:  # the shape of a runtime's TensorSpec
        dtype: str
        shape: tuple[int, ...]

    data, _, deltas = _honest(rng)
    specs = {k: Spec(d, s) for k, (d, s) in SPECS.items()}
    got = decode_chunk(data, expect=specs, budget=DecodeBudget.for_tensors(specs))
    assert len(got.deltas) == len(deltas)


def test_spy_sees_decoding_of_an_admitted_chunk(rng, no_payload_decoding):
    """Control for the tests below: an admitted chunk does reach the payload decoder."""
    data, _, _ = _honest(rng)
    with pytest.raises(AssertionError, match="payload was decoded"):
        decode_chunk(data, expect=SPECS, budget=DecodeBudget.for_tensors(SPECS))
    assert len(no_payload_decoding) == 1


# ------------------------------------------------------------------ records that do not fit

@pytest.mark.parametrize("change, field", [
    (lambda s: {k: v for k, v in s.items() if k != "b.bias"}, "name"),
    (lambda s: {**s, "b.bias": ("bfloat16", (300,))}, "dtype"),
    (lambda s: {**s, "a.weight": ("bfloat16", (64, 40))}, "shape"),
    (lambda s: {**s, "c": ("float8_e4m3fn", (256,))}, "shape"),
])
def test_records_that_do_not_fit_expect_are_refused_before_decoding(rng, change, field, no_payload_decoding):
    data, _, _ = _honest(rng)
    expect = change(SPECS)
    with pytest.raises(ChunkValidationError, match=rf"^record '[a-z.]+': {field} ") as e:
        decode_chunk(data, expect=expect, budget=DecodeBudget.for_tensors(expect))
    assert isinstance(e.value, ValidationError) and "\n" not in str(e.value)
    with pytest.raises(ChunkValidationError, match=field):
        read_chunk_index(data, expect=expect)
    assert no_payload_decoding == []


def test_version_budget_bounds_the_sum_over_chunks(rng, monkeypatch):
    """One chunk changing every element of "a.weight" (2560) plus 20% of the rest: the budget
    of the version (all 3116 elements of SPECS) admits it once, not twice; a refused chunk
    charges nothing."""
    data, _, deltas = _honest(rng, dense="a.weight")
    per_chunk = sum(d.nnz for d in deltas)
    total = sum(int(np.prod(s)) for _, s in SPECS.values())
    assert 2 * per_chunk > total >= per_chunk  # the premise of the test
    budget = DecodeBudget.for_tensors(SPECS)
    assert budget.max_changed == total
    decode_chunk(data, expect=SPECS, budget=budget)
    monkeypatch.setattr(chunk_mod, "decode_payload", lambda *a, **k: pytest.fail("decoded over budget"))
    with pytest.raises(ChunkValidationError, match=rf"nnz \d+ brings the version's declared entries to \d+, "
                                                   rf"over its budget of {total}"):
        decode_chunk(data, expect=SPECS, budget=budget)
    assert budget.changed == per_chunk
    with pytest.raises(ChunkValidationError, match="over its budget of 10"):  # a caller-given limit
        decode_chunk(data, budget=DecodeBudget(10))


def test_budget_of_exactly_the_declared_entries_admits(rng):
    data, _, deltas = _honest(rng)
    n = sum(d.nnz for d in deltas)
    decode_chunk(data, budget=DecodeBudget(n))
    with pytest.raises(ChunkValidationError):
        decode_chunk(data, budget=DecodeBudget(n - 1))


@needs_native
def test_scan_budget_counts_context_ranges(rng):
    data, bases, deltas = _honest(rng, context=True)
    scan = sum(d.element_range[1] - d.element_range[0] for d in deltas)
    decode_chunk(data, base=bases, budget=DecodeBudget(10**9, max_scan=scan))
    with pytest.raises(ChunkValidationError, match="context range .* over its budget"):
        decode_chunk(data, base=bases, budget=DecodeBudget(10**9, max_scan=scan - 1))
    plain, _, _ = _honest(rng, context=False)  # context-free records are not charged for their range
    decode_chunk(plain, budget=DecodeBudget(10**9, max_scan=0))


# ------------------------------------------------------------------ hostile headers

N_BIG = 1 << 34


def _one(fields: dict, shape, payload: bytes, name: bytes = b"a.weight") -> bytes:
    return forge_chunk([(entry_fields(name_len=len(name), ndim=len(shape), **fields), name, shape, payload)])


HOSTILE = {
    # huge shape: not the receiver's tensor
    "huge shape": (_one(dict(hi=N_BIG, nnz=1 << 30, plen=0), (N_BIG,), b""), ChunkValidationError, "shape"),
    # right tensor, entries beyond its elements
    "nnz beyond numel": (_one(dict(lo=0, hi=2560, nnz=2561, plen=0), (40, 64), b""), ChunkFormatError, "nnz 2561"),
    "range beyond numel": (_one(dict(lo=0, hi=2561, nnz=1, plen=10), (40, 64), b"\0" * 10), ChunkFormatError,
                           "range"),
    # a payload shorter than the raw codings need
    "sparse raw short": (_one(dict(hi=2560, nnz=2000, plen=10), (40, 64), b"\0" * 10), ChunkFormatError,
                         "payload_len is 10"),
    "dense short": (_one(dict(coding=0, hi=2560, nnz=5, plen=10), (40, 64), b"\0" * 10), ChunkFormatError,
                    "payload_len is 10"),
    # a tiny zstd frame declaring more than zstd can inflate to
    "zstd expansion": (_one(dict(coding=2, hi=2560, nnz=2560, plen=0), (40, 64), b""), ChunkFormatError,
                       "zstd payload_len of 0"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_before_any_decoding(case, no_payload_decoding):
    data, err, what = HOSTILE[case]
    tracemalloc.start()
    try:
        with pytest.raises(err, match=what) as e:
            decode_chunk(data, expect=SPECS, budget=DecodeBudget.for_tensors(SPECS))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value).startswith("record 'a.weight': ")
    assert no_payload_decoding == []
    assert peak < 1 << 20, f"{peak} bytes traced refusing a {len(data)}-byte chunk"


def test_zstd_expansion_bound_is_checked_on_frames():
    """ZSTD_MAX_RATIO is sound: zstd's best case (zeros, highest level) stays under it, and
    a record declaring just over ratio * payload_len is refused, at it admitted."""
    raw = b"\0" * (64 << 20)
    frame = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(raw)
    assert len(raw) <= ZSTD_MAX_RATIO * len(frame)
    def spec(nnz):
        return RecordSpec(dtype="bfloat16", shape=(1 << 40,), op=DeltaOp.XOR, lo=0, hi=1 << 20, nnz=nnz)

    fits = ZSTD_MAX_RATIO * 100 // 6  # entries of 4 + 2 bytes that 100 bytes may inflate to
    check_payload_size(spec(fits), Coding.SPARSE_ZSTD, 100)
    with pytest.raises(ChunkFormatError, match="more than a zstd payload_len of 100"):
        check_payload_size(spec(fits + 1), Coding.SPARSE_ZSTD, 100)


@needs_native
def test_model_expansion_bound_is_sound_and_enforced():
    """The MODEL bound holds for the cheapest stream there is (all-zero overwrites, which the
    adaptive coder makes nearly free) and refuses a record declaring more than it."""
    n = 1 << 21
    d = TensorDelta(name="w", dtype="bfloat16", shape=(n,), op=DeltaOp.OVERWRITE,
                    positions=np.arange(n, dtype=np.int64), values=np.zeros(n, np.uint16))
    info = read_chunk_index(encode_chunk([d], codings=[Coding.MODEL])).records[0]
    assert info.coding is Coding.MODEL and info.payload_bytes < 16
    assert n <= model_max_entries("bfloat16", info.payload_bytes)
    cap = model_max_entries("bfloat16", 4)
    spec = dict(dtype="bfloat16", shape=(1 << 40,), op=DeltaOp.OVERWRITE, lo=0, hi=1 << 40)
    check_payload_size(RecordSpec(**spec, nnz=cap), Coding.MODEL, 4)
    with pytest.raises(ChunkFormatError, match=f"MODEL payload_len of 4 can code \\(at most {cap}\\)"):
        check_payload_size(RecordSpec(**spec, nnz=cap + 1), Coding.MODEL, 4)
    # through decode_chunk: a 4-byte stream declaring 2**30 entries (within the chunk limits)
    # of a tensor the receiver holds
    data = _one(dict(coding=3, op=1, hi=1 << 30, nnz=1 << 30, plen=4), (1 << 30,), b"\0" * 4, name=b"w")
    with pytest.raises(ChunkFormatError, match=f"record 'w': nnz {1 << 30} is more than a MODEL"):
        decode_chunk(data, expect={"w": ("bfloat16", (1 << 30,))}, budget=DecodeBudget(1 << 30))


# ------------------------------------------------------------------ the attack, measured

N_ATTACK = 1 << 23  # 8.4M bf16 entries: 84 MB decoded per copy


def _attack_chunk(n: int) -> bytes:
    """~100 bytes claiming ``n`` overwrite entries of "w" that a few-byte MODEL stream (of
    zeros) really codes, content CRC included: it decodes completely unless admission stops it.
    MODEL is the old default; an attacker picks whichever coding is cheapest to forge."""
    d = TensorDelta(name="w", dtype="bfloat16", shape=(n,), op=DeltaOp.OVERWRITE,
                    positions=np.arange(n, dtype=np.int64), values=np.zeros(n, np.uint16))
    data = encode_chunk([d], codings=[Coding.MODEL])
    (info,) = read_chunk_index(data).records
    assert info.coding is Coding.MODEL and info.nnz == n and len(data) < 256
    return data


def _probe(path, copies: int, expect: dict | None) -> dict:
    argv = [sys.executable, str(HERE / "rss_probe.py"), str(path), str(copies)]
    if expect is not None:
        argv.append(json.dumps(expect))
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout)


@needs_native
def test_tracemalloc_shows_what_the_old_path_allocates():
    """Without admission a small chunk claiming N entries gets N * 10 bytes allocated (the
    MODEL output arrays); with it, the same chunk at a receiver that does not hold "w" is
    refused having allocated next to nothing."""
    n = 1 << 20
    data = _attack_chunk(n)
    tracemalloc.start()
    try:
        decode_chunk(data)
        old_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        with pytest.raises(ChunkValidationError, match=r"record 'w': name is not one of the 3 expected"):
            decode_chunk(data, expect=SPECS, budget=DecodeBudget.for_tensors(SPECS))
        new_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert old_peak >= n * (8 + 2)
    assert new_peak < 1 << 20


@needs_native
def test_attack_chunk_listed_four_times_rss(tmp_path):
    """The issue's attack, scaled down: one small chunk listed 4 times in a version.  Peak
    RSS growth is measured in a fresh process per case (rss_probe.py)."""
    path = tmp_path / "attack.dcr"
    path.write_bytes(_attack_chunk(N_ATTACK))
    decoded_bytes = N_ATTACK * (8 + 2)

    old = _probe(path, 4, None)  # no admission: every copy decodes and is kept
    assert old["error"] is None and old["decoded_entries"] == 4 * N_ATTACK
    assert old["rss_growth_bytes"] >= 3 * decoded_bytes

    other = _probe(path, 4, {k: [d, list(s)] for k, (d, s) in SPECS.items()})  # "w" not held
    assert other["error"].startswith("ChunkValidationError: record 'w': name")
    assert other["decoded_entries"] == 0
    assert other["rss_growth_bytes"] < 16 << 20

    held = _probe(path, 4, {"w": ["bfloat16", [N_ATTACK]]})  # "w" held: one copy fits the budget
    assert held["error"].startswith("ChunkValidationError: record 'w': nnz") and "over its budget" in held["error"]
    assert held["decoded_entries"] == N_ATTACK
    assert held["rss_growth_bytes"] < 2 * decoded_bytes
