"""`nemo-dcr delta encode/apply/inspect` round trip and refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr.cli import main

from codec_helpers import entry_fields, forge_chunk, needs_native


def _ints(t: torch.Tensor) -> np.ndarray:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width).numpy().copy()


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
    assert main(["delta", "apply", "--base", str(wrong), "--delta", str(d), "--out", str(out)]) == 1
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
    assert main(["delta", "apply", "--base", str(p["base"]), "--delta", str(d), "--out", str(out)]) == 1
    assert "checksum" in capsys.readouterr().err
    assert not out.exists()


def test_mismatched_files_are_refused(files, tmp_path):
    tmp, p, base, target = files
    odd = dict(target)
    odd["extra"] = torch.zeros(3)
    q = tmp / "odd.safetensors"
    save_file(odd, str(q))
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(q), "--out", str(tmp / "x.dcr")]) == 1
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
    _one_line_error(capsys.readouterr().err, code, 1, "missing.dcr")
    (tmp / "junk.dcr").write_bytes(b"not a chunk at all" * 8)
    code = main(["delta", "apply", "--base", str(p["base"]), "--delta", str(tmp / "junk.dcr"),
                 "--out", str(tmp / "c.safetensors")])
    _one_line_error(capsys.readouterr().err, code, 1, "bad magic")
    assert not (tmp / "c.safetensors").exists()


# ----------------------------------------------------------------- hostile delta files

def _hostile_delta(good: bytes, records) -> bytes:
    """A delta file carrying ``good``'s metadata (so its base digest matches) and forged records."""
    from nemo_dcr.codec import read_chunk_index
    from nemo_dcr.codec.chunk import _encode_meta

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
    _one_line_error(capsys.readouterr().err, code, 1, needle)
    assert not out.exists()
    code = main(["delta", "inspect", str(hostile), "--base", str(p["base"])])
    _one_line_error(capsys.readouterr().err, code, 1, needle)


def test_inspect_without_base_decodes_only_within_max_decode(files, capsys):
    tmp, p, base, target = files
    d = tmp / "d.dcr"
    assert main(["delta", "encode", "--base", str(p["base"]), "--target", str(p["target"]), "--out", str(d)]) == 0
    capsys.readouterr()
    assert main(["delta", "inspect", str(d), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["total"]
    assert full["not_decoded"] is None and full["ratio_to_bound"] is not None
    changed = full["changed"]
    assert main(["delta", "inspect", str(d), "--json", "--max-decode", str(changed)]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["ratio_to_bound"] == full["ratio_to_bound"]
    assert main(["delta", "inspect", str(d), "--json", "--max-decode", str(changed - 1)]) == 0
    limited = json.loads(capsys.readouterr().out)["total"]
    assert limited["ratio_to_bound"] is None and "--max-decode" in limited["not_decoded"]
    assert limited["changed"] == changed  # the header facts are still reported
    # a hostile file claiming 2**29 entries of a 2**30-element tensor (a MODEL stream of 32
    # bytes could code that many): listed, not decoded
    hostile = tmp / "h.dcr"
    hostile.write_bytes(_hostile_delta(d.read_bytes(), [_rec("evil", (1 << 30,), 1 << 29, b"\0" * 32, coding=3)]))
    assert main(["delta", "inspect", str(hostile)]) == 0
    outp = capsys.readouterr().out
    assert "i.i.d. bound n/a: not decoded: record 'evil': nnz 536870912" in outp
