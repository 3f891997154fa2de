"""`nemo-dcr delta encode/apply/inspect` round trip and refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr.cli import main

from codec_helpers import needs_native


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
