"""`nemo-dcr delta encode/apply/inspect` round trip and refusals."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr import dtypes
from nemo_dcr.cli import main
from nemo_dcr.codec import BITS_DTYPE, Coding, DeltaOp, TensorDelta, decode_chunk, encode_chunk, read_chunk_index
from nemo_dcr.codec.bound import _entropy_bits, symbol_counts
from nemo_dcr.codec.cli import INSPECT_MAX_DECODE

from codec_helpers import entry_fields, forge_chunk, needs_native


def _ints(t: torch.Tensor) -> np.ndarray:
    return dtypes.int_view(t.contiguous()).numpy().copy()


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {
        "emb.weight": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16),
        "ln.bias": torch.randn(32, generator=g).to(torch.float32),
        "head.weight": (torch.randn(16, 32, generator=g)).to(torch.float16),
        "steps": torch.tensor([7], dtype=torch.int64),
    }
    target = {k: v.clone() for k, v in base.items()}
    m = torch.rand(64, 32, generator=g) < 0.05
    target["emb.weight"][m] = (target["emb.weight"][m].float() * 1.01).to(torch.bfloat16)
    target["ln.bias"][3] = float("nan")
    target["head.weight"][:] = (target["head.weight"].float() + 1).to(torch.float16)
    target["steps"] += 1
    paths = {"base": tmp_path / "a.safetensors", "target": tmp_path / "b.safetensors"}
    save_file(base, str(paths["base"]))
    save_file(target, str(paths["target"]))
    return tmp_path, paths, base, target


@pytest.mark.parametrize("context", [False, pytest.param(True, marks=needs_native)])
def test_encode_apply_inspect_round_trip(files, context, capsys):
    tmp, p, base, target = files
    d, out = tmp / "d.dcr", tmp / "c.safetensors"
    argv = ["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]
    assert main(argv + (["--context"] if context else [])) == 0
    assert main(["delta", "apply", "--base", str(p["base"]), "--delta", str(d), "--out", str(out)]) == 0
    got = load_file(str(out))
    assert set(got) == set(target)
    for k in target:
        assert got[k].dtype == target[k].dtype
        assert np.array_equal(_ints(got[k]), _ints(target[k])), k
    # negative control: the comparison sees a single flipped bit
    flipped = _ints(got["emb.weight"])
    flipped.reshape(-1)[5] ^= 1
    assert not np.array_equal(flipped, _ints(target["emb.weight"]))

    capsys.readouterr()
    extra = ["--base", str(p["base"])] if context else []
    assert main(["delta", "inspect", str(d), "--json"] + extra) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rep["records"]} == set(target)
    assert rep["total"]["chunk_bytes"] == d.stat().st_size
    changed = sum(int((_ints(base[k]) != _ints(target[k])).sum()) for k in target)
    assert rep["total"]["changed"] == changed
    assert rep["total"]["ratio_to_bound"] is not None
    assert any(r["context"] for r in rep["records"]) == context
    assert main(["delta", "inspect", str(d)] + extra) == 0
    assert "x the i.i.d. bound" in capsys.readouterr().out


def test_wrong_base_is_refused_and_nothing_written(files, capsys):
    tmp, p, base, target = files
    d, out = tmp / "d.dcr", tmp / "c.safetensors"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    other = {k: v.clone() for k, v in base.items()}
    other["emb.weight"][0, 0] = 1.0
    wrong = tmp / "wrong.safetensors"
    save_file(other, str(wrong))
    capsys.readouterr()
    assert main(["delta", "apply", "--base", str(wrong), "--delta", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not this delta's base" in err
    assert not out.exists()
    assert sorted(x.name for x in tmp.iterdir()) == ["a.safetensors", "b.safetensors", "d.dcr", "wrong.safetensors"]


def test_corrupt_delta_is_refused_and_nothing_written(files, capsys):
    tmp, p, base, target = files
    d, out = tmp / "d.dcr", tmp / "c.safetensors"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    data = bytearray(d.read_bytes())
    data[len(data) // 2] ^= 0x10
    d.write_bytes(bytes(data))
    assert main(["delta", "apply", "--base", str(p["base"]), "--delta", str(d), "--out", str(out)]) == 2
    assert "checksum" in capsys.readouterr().err
    assert not out.exists()


def test_mismatched_files_are_refused(files, tmp_path):
    tmp, p, base, target = files
    odd = dict(target)
    odd["extra"] = torch.zeros(3)
    q = tmp / "odd.safetensors"
    save_file(odd, str(q))
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(q), "--out", str(tmp / "x.dcr")]) == 2
    assert not (tmp / "x.dcr").exists()


# ----------------------------------------------------------------- --out naming an input

def _snapshot(tmp):
    return {p.name: p.read_bytes() for p in sorted(tmp.iterdir()) if p.is_file() and not p.is_symlink()}


def _one_line_error(err: str, code_seen: int, want_code: int, *needles: str) -> None:
    assert code_seen == want_code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nemo-dcr delta "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_encode_out_naming_an_input_is_refused(files, capsys):
    tmp, p, base, target = files
    (tmp / "link.safetensors").symlink_to(p["target"])
    os.link(p["base"], tmp / "hard.safetensors")
    before = _snapshot(tmp)
    enc = ["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out"]
    for out, flag in [(str(p["base"]), "--base"), (str(tmp / "." / "b.safetensors"), "--target"),
                      (str(tmp / "link.safetensors"), "--target"), (str(tmp / "hard.safetensors"), "--base")]:
        capsys.readouterr()
        code = main(enc + [out])
        _one_line_error(capsys.readouterr().err, code, 2, "same file as " + flag, "refusing to overwrite an input")
        assert _snapshot(tmp) == before  # nothing written, nothing replaced
    # control: a fresh output path is accepted
    assert main(enc + [str(tmp / "d.dcr")]) == 0


def test_apply_out_naming_an_input_is_refused(files, capsys):
    tmp, p, base, target = files
    d = tmp / "d.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    before = _snapshot(tmp)
    for out, flag in [(d, "--delta"), (p["base"], "--base")]:
        capsys.readouterr()
        code = main(["delta", "apply", "--base", str(p["base"]), "--delta", str(d), "--out", str(out)])
        _one_line_error(capsys.readouterr().err, code, 2, "same file as " + flag)
        assert _snapshot(tmp) == before


def test_unreadable_inputs_are_one_line_errors(files, capsys):
    tmp, p, base, target = files
    code = main(["delta", "inspect", str(tmp / "missing.dcr")])
    _one_line_error(capsys.readouterr().err, code, 2, "missing.dcr")
    (tmp / "junk.dcr").write_bytes(b"not a chunk at all" * 8)
    code = main(["delta", "apply", "--base", str(p["base"]), "--delta", str(tmp / "junk.dcr"),
                 "--out", str(tmp / "c.safetensors")])
    _one_line_error(capsys.readouterr().err, code, 2, "bad magic")
    assert not (tmp / "c.safetensors").exists()
    code = main(["delta", "apply", "--base", str(tmp / "missing.safetensors"), "--delta", str(tmp / "junk.dcr"),
                 "--out", str(tmp / "c.safetensors")])
    _one_line_error(capsys.readouterr().err, code, 2)
    code = main(["delta", "encode", "--base", str(p["base"]), "--target", str(tmp / "missing.safetensors"),
                 "--out", str(tmp / "x.dcr")])
    _one_line_error(capsys.readouterr().err, code, 2, "missing.safetensors")
    assert not (tmp / "c.safetensors").exists() and not (tmp / "x.dcr").exists()


def test_corrupt_delta_is_bad_input_and_an_unwritable_output_is_not(files, capsys):
    """Exit 2 is the input's fault (a corrupt or missing delta), 1 a failure to write the
    output: the same good delta to an output directory that does not exist."""
    tmp, p, base, target = files
    d = tmp / "d.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    capsys.readouterr()
    data = bytearray(d.read_bytes())
    data[-6] ^= 0x01  # inside the trailer's chunk CRC
    (tmp / "corrupt.dcr").write_bytes(bytes(data))
    for cmd in (["apply", "--base", str(p["base"]), "--delta", str(tmp / "corrupt.dcr"), "--out", str(tmp / "c.st")],
                ["inspect", str(tmp / "corrupt.dcr")],
                ["apply", "--base", str(p["base"]), "--delta", str(tmp / "gone.dcr"), "--out", str(tmp / "c.st")]):
        code = main(["delta", *cmd])
        _one_line_error(capsys.readouterr().err, code, 2, "nemo-dcr delta " + cmd[0])
    assert not (tmp / "c.st").exists()
    code = main(["delta", "apply", "--base", str(p["base"]), "--delta", str(d),
                 "--out", str(tmp / "no-such-dir" / "c.st")])
    _one_line_error(capsys.readouterr().err, code, 1, "no-such-dir")


# ----------------------------------------------------------------- hostile delta files

def _hostile_delta(good: bytes, records) -> bytes:
    """A delta file carrying ``good``'s metadata (so its base digest matches) and forged records."""
    from nemo_dcr.codec import read_chunk_index
    from nemo_dcr.codec.encode import _encode_meta

    return forge_chunk(records, meta=_encode_meta(read_chunk_index(good).meta))


def _rec(name: str, shape, nnz: int, payload: bytes, coding: int = 1, op: int = 0, dtype: int = 1):
    n = int(np.prod(shape))
    return (entry_fields(name_len=len(name), dtype=dtype, op=op, ndim=len(shape), coding=coding, lo=0, hi=n,
                         nnz=nnz, plen=len(payload)), name.encode(), tuple(shape), payload)


def _sparse_raw(n: int) -> bytes:
    return np.arange(n, dtype="<i8").tobytes() + np.ones(n, "<u2").tobytes()


@pytest.mark.parametrize("case, needle", [
    ("foreign tensor", "record 'evil': name is not one of the 4 expected tensors"),
    ("huge shape", "record 'emb.weight': shape [1073741824], expected [64, 32]"),
    ("wrong dtype", "record 'emb.weight': dtype float32, expected bfloat16"),
    ("over budget", "over its budget of 2593"),
])
def test_hostile_delta_is_refused_by_apply_before_decoding(files, capsys, monkeypatch, case, needle):
    from nemo_dcr.codec import chunk as chunk_mod

    tmp, p, base, target = files
    good = tmp / "d.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(good)]) == 0
    records = {
        "foreign tensor": [_rec("evil", (1 << 30,), 1, _sparse_raw(1))],
        "huge shape": [_rec("emb.weight", (1 << 30,), 1, _sparse_raw(1))],
        "wrong dtype": [_rec("emb.weight", (64, 32), 1, _sparse_raw(1)[:8] + b"\0\0\0\1", dtype=3)],
        # two records of every emb.weight element: 4096 declared entries, the base has 2593
        "over budget": [_rec("emb.weight", (64, 32), 2048, _sparse_raw(2048))] * 2,
    }[case]
    hostile = tmp / "h.dcr"
    hostile.write_bytes(_hostile_delta(good.read_bytes(), records))
    monkeypatch.setattr(chunk_mod, "decode_payload", lambda *a, **k: pytest.fail("a payload was decoded"))
    out = tmp / "c.safetensors"
    capsys.readouterr()
    code = main(["delta", "apply", "--base", str(p["base"]), "--delta", str(hostile), "--out", str(out)])
    _one_line_error(capsys.readouterr().err, code, 2, needle)
    assert not out.exists()
    code = main(["delta", "inspect", str(hostile), "--base", str(p["base"])])
    _one_line_error(capsys.readouterr().err, code, 2, needle)


def test_inspect_decodes_only_records_within_max_decode(files, capsys):
    """``--max-decode`` caps each record (it capped the sum before inspect streamed): the
    biggest record over it loses its bound, the others keep theirs."""
    tmp, p, base, target = files
    d = tmp / "d.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    capsys.readouterr()
    assert main(["delta", "inspect", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    full = rep["total"]
    assert full["not_decoded"] is None and full["ratio_to_bound"] is not None
    changed = full["changed"]
    biggest = max(rep["records"], key=lambda r: r["changed"])
    assert main(["delta", "inspect", str(d), "--json", "--max-decode", str(biggest["changed"])]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["ratio_to_bound"] == full["ratio_to_bound"]
    assert main(["delta", "inspect", str(d), "--json", "--max-decode", str(biggest["changed"] - 1)]) == 0
    limited = json.loads(capsys.readouterr().out)
    assert limited["total"]["ratio_to_bound"] is None and "--max-decode" in limited["total"]["not_decoded"]
    assert limited["total"]["changed"] == changed  # the header facts are still reported
    for r, f in zip(limited["records"], rep["records"]):
        if r["name"] == biggest["name"]:
            assert r["bound_bytes"] is None and biggest["name"] in r["not_decoded"]
        else:  # its own coder state (one record per dtype here): still decoded
            assert r["not_decoded"] is None and r["bound_bytes"] == f["bound_bytes"] is not None
    # a hostile file claiming 2**29 entries of a 2**30-element tensor (a MODEL stream of 32
    # bytes could code that many): listed, not decoded
    hostile = tmp / "h.dcr"
    hostile.write_bytes(_hostile_delta(d.read_bytes(), [_rec("evil", (1 << 30,), 1 << 29, b"\0" * 32, coding=3)]))
    assert main(["delta", "inspect", str(hostile)]) == 0
    outp = capsys.readouterr().out
    assert "i.i.d. bound n/a: not decoded: record 'evil': nnz 536870912" in outp


# ----------------------------------------------------------------- inspect: streaming, bounded memory

HERE = pathlib.Path(__file__).parent

#: Peak-RSS growth ``inspect`` may reach on any file: one record of ``INSPECT_MAX_DECODE``
#: int64 entries is 256 MiB of positions and values; these files stay far below.
RSS_LIMIT = 300 * 10**6


def _inspect_probe(*args) -> dict:
    """``nemo-dcr delta inspect *args`` in a fresh process (inspect_probe.py)."""
    argv = [sys.executable, str(HERE / "inspect_probe.py"), *map(str, args)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout)


def _old_bound(n: int, values: np.ndarray) -> float:
    """The bound as inspect computed it before it streamed (``symbol_counts``, one dict)."""
    return _entropy_bits(np.fromiter(symbol_counts(n, values).values(), dtype=np.int64)) / 8


def test_inspect_of_a_tiny_file_claiming_1e8_changes_is_bounded(files):
    """The issue's file: a few hundred bytes whose one record claims 10**8 changed elements.
    inspect lists it from its header and does not decode it (it used to take 1.6 GB and
    5.6 s decoding it for the bound); asked to decode it, it fails in one line."""
    tmp, p, base, target = files
    d, hostile = tmp / "d.dcr", tmp / "h.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    n = 10**8
    hostile.write_bytes(_hostile_delta(d.read_bytes(), [_rec("evil", (n,), n, b"\0" * 32, coding=3)]))
    assert hostile.stat().st_size < 400
    got = _inspect_probe(hostile)
    assert got["rc"] == 0 and got["stderr"] == ""
    assert "100000000 changed (100.000%)" in got["stdout"]
    assert ("i.i.d. bound n/a: not decoded: record 'evil': nnz 100000000 is over --max-decode "
            f"{INSPECT_MAX_DECODE} entries per record") in got["stdout"]
    assert got["rss_growth_bytes"] < RSS_LIMIT
    got = _inspect_probe(hostile, "--max-decode", n)  # the user's knob: decode it anyway
    _one_line_error(got["stderr"], got["rc"], 2, "record 'evil'")
    assert got["rss_growth_bytes"] < RSS_LIMIT


@needs_native
def test_inspect_decodes_one_record_at_a_time(tmp_path):
    """Six real records of 2**22 entries (42 MB decoded each, all under --max-decode): inspect
    holds one at a time (all at once, as before, is 250 MB), and each bound is the one the
    all-at-once computation gives."""
    n, k = 1 << 22, 6
    pos = np.arange(n, dtype=np.int64)
    values = [(np.arange(n) % (i + 2) + 1).astype(np.uint16) for i in range(k)]
    deltas = [TensorDelta(name=f"w{i}", dtype="bfloat16", shape=(n,), op=DeltaOp.XOR, positions=pos, values=v)
              for i, v in enumerate(values)]
    path = tmp_path / "big.dcr"
    path.write_bytes(encode_chunk(deltas))
    got = _inspect_probe(path, "--json")
    assert got["rc"] == 0, got["stderr"]
    rep = json.loads(got["stdout"])
    assert [r["bound_bytes"] for r in rep["records"]] == [_old_bound(n, v) for v in values]
    assert rep["total"]["changed"] == n * k and rep["total"]["not_decoded"] is None
    per_record = n * (8 + 2)
    assert got["rss_growth_bytes"] < 2 * per_record, got["rss_growth_bytes"]


@pytest.mark.parametrize("context", [False, pytest.param(True, marks=needs_native)])
def test_inspect_report_matches_the_all_at_once_computation(files, capsys, context):
    """Positive control: on an honest file the streamed report's bounds and totals are, to
    the bit, what decoding the whole chunk and counting symbols per record gives."""
    from nemo_dcr.codec import cli as delta_cli

    tmp, p, base, target = files
    d = tmp / "d.dcr"
    argv = ["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]
    assert main(argv + (["--context"] if context else [])) == 0
    capsys.readouterr()
    assert main(["delta", "inspect", str(d), "--json"] + (["--base", str(p["base"])] if context else [])) == 0
    rep = json.loads(capsys.readouterr().out)
    data = d.read_bytes()
    decoded = decode_chunk(data, base=delta_cli._bits(base) if context else None)
    want = [_old_bound(hi - lo, dl.values) for dl in decoded.deltas for lo, hi in [dl.element_range]]
    assert [r["bound_bytes"] for r in rep["records"]] == want
    assert [r["changed"] for r in rep["records"]] == [dl.nnz for dl in decoded.deltas]
    assert [r["bytes"] for r in rep["records"]] == [i.payload_bytes for i in decoded.records]
    assert rep["total"]["bound_bytes"] == sum(want)
    assert rep["total"]["ratio_to_bound"] == len(data) / sum(want)
    assert rep["total"]["changed"] == sum(dl.nnz for dl in decoded.deltas)
    assert any(r["context"] for r in rep["records"]) == context
    # negative control: the comparison sees two symbols of one record merged into one
    dl = max(decoded.deltas, key=lambda x: x.nnz)
    lo, hi = dl.element_range
    merged = dl.values.copy()
    merged[merged == merged[0]] = merged[merged != merged[0]][0]
    assert _old_bound(hi - lo, merged) != _old_bound(hi - lo, dl.values)


def test_inspect_skips_what_continues_a_skipped_coder_state(tmp_path, capsys):
    """Two records of one dtype share their adaptive coder state: when the first is over
    --max-decode, the second cannot be decoded either; a record of another dtype can."""
    rng = np.random.default_rng(3)
    deltas = []
    for name, dtype, nnz in [("a", "bfloat16", 300), ("b", "bfloat16", 100), ("c", "float32", 100)]:
        deltas.append(TensorDelta(name=name, dtype=dtype, shape=(4096,), op=DeltaOp.XOR,
                                  positions=np.sort(rng.choice(4096, nnz, replace=False)).astype(np.int64),
                                  values=np.full(nnz, 1 + np.arange(nnz) % 5, dtype=BITS_DTYPE[dtype])))
    path = tmp_path / "s.dcr"
    path.write_bytes(encode_chunk(deltas))
    codings = [r.coding for r in read_chunk_index(path.read_bytes()).records]
    assert codings[0] == codings[1] and codings[0] in (Coding.MODEL, Coding.BUCKET, Coding.SPARSE_ZSTD)
    assert main(["delta", "inspect", str(path), "--json", "--max-decode", "200"]) == 0
    rows = json.loads(capsys.readouterr().out)["records"]
    assert "nnz 300 is over --max-decode 200" in rows[0]["not_decoded"]
    if codings[0] is Coding.SPARSE_ZSTD:  # no native coders: no shared state
        assert rows[1]["not_decoded"] is None
    else:
        assert "coder state follows record 'a'" in rows[1]["not_decoded"]
        assert rows[1]["bound_bytes"] is None
    assert rows[2]["not_decoded"] is None and rows[2]["bound_bytes"] is not None
