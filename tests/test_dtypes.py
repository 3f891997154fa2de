"""``nemo_dcr.dtypes`` is the one dtype table: its entries agree with torch, numpy,
safetensors and docs/wire-format.md, and no other module keeps a table of its own."""
from __future__ import annotations

import ast
import json
import math
import pathlib
import re
import struct

import numpy as np
import pytest
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import ValidationError

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = sorted(dtypes.DTYPES)


def _wire_doc_codes() -> dict[str, int]:
    """The "Dtypes" table of the normative wire-format document: ``| code | dtype | ...``."""
    text = (ROOT / "docs" / "wire-format.md").read_text()
    section = text[text.index("### Dtypes"):]
    section = section[: section.index("\n#", 1)]
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([a-z0-9_]+)\s*\|\s*(u\d+)\s*\|", section, re.M)
    return {name: int(code) for code, name, _ in rows}


def test_codes_are_the_documented_wire_codes():
    doc = _wire_doc_codes()
    assert len(doc) == 11  # the parse found the table (negative control for the regex)
    assert {d.name: d.code for d in dtypes.DTYPES.values()} == doc
    for name, code in doc.items():
        assert dtypes.from_code(code) is dtypes.DTYPES[name]
    assert dtypes.from_code(0) is None and dtypes.from_code(max(doc.values()) + 1) is None


def test_bits_width_is_the_documented_carrier():
    text = (ROOT / "docs" / "wire-format.md").read_text()
    for code, name, carrier in re.findall(r"^\|\s*(\d+)\s*\|\s*([a-z0-9_]+)\s*\|\s*u(\d+)\s*\|", text, re.M):
        assert dtypes.DTYPES[name].bits == np.dtype(f"u{int(carrier) // 8}"), name


@pytest.mark.parametrize("name", ALL)
def test_entry_matches_torch_and_numpy(name):
    d = dtypes.DTYPES[name]
    t = d.torch
    assert isinstance(t, torch.dtype) and str(t) == f"torch.{name}"
    assert torch.empty(0, dtype=t).element_size() == d.width == d.bits.itemsize
    assert d.bits.kind == "u"
    assert d.is_float == t.is_floating_point
    assert dtypes.from_torch(t) is d and dtypes.get(name) is d


@pytest.mark.parametrize("name", [n for n in ALL if dtypes.DTYPES[n].is_float])
def test_exponent_field_matches_finfo_and_bits(name):
    d = dtypes.DTYPES[name]
    fi = torch.finfo(d.torch)
    mant = round(-math.log2(fi.eps))
    assert d.exponent == (mant, fi.bits - 1 - mant)
    shift, ebits = d.exponent
    bias = (1 << (ebits - 1)) - 1
    # 1.0 has the biased exponent `bias` and a zero mantissa; 2.0 one more
    for value, e in ((1.0, bias), (2.0, bias + 1)):
        bits = int(dtypes.int_view(torch.tensor([value], dtype=d.torch)).numpy().view(d.bits)[0])
        assert bits == e << shift, (name, value, hex(bits))
    if name in ("float16", "float32"):  # numpy knows these two
        nf = np.finfo(np.dtype(name))
        assert (nf.nmant, nf.nexp) == d.exponent


@pytest.mark.parametrize("name", ALL)
def test_safetensors_tag(name):
    from safetensors.torch import save

    d = dtypes.DTYPES[name]
    blob = save({"x": torch.zeros(2, dtype=d.torch)})
    (n,) = struct.unpack("<Q", blob[:8])
    tag = json.loads(blob[8 : 8 + n])["x"]["dtype"]
    assert tag == d.safetensors
    assert dtypes.from_safetensors(tag) is d


def test_unknown_names_are_validation_errors():
    for bad in ("float64", "BF16", None):
        with pytest.raises(ValidationError):
            dtypes.get(bad)
    with pytest.raises(ValidationError):
        dtypes.from_torch(torch.float64)
    with pytest.raises(ValidationError):
        dtypes.from_safetensors("F64")
    with pytest.raises(ValidationError):
        dtypes.bits_of_width(3)
    with pytest.raises(ValueError):  # the family keeps the builtin older callers catch
        dtypes.get("complex64")


def test_table_is_read_only():
    with pytest.raises(TypeError):
        dtypes.DTYPES["float64"] = dtypes.DTYPES["float32"]  # type: ignore[index]
    with pytest.raises(Exception):
        dtypes.DTYPES["bfloat16"].code = 99  # type: ignore[misc]


@pytest.mark.parametrize("name", ALL)
def test_int_view_is_a_same_width_view(name):
    d = dtypes.DTYPES[name]
    t = torch.arange(6, dtype=torch.int64).to(d.torch).reshape(2, 3)
    v = dtypes.int_view(t)
    assert v.element_size() == d.width and v.shape == t.shape and not v.is_floating_point()
    assert v.data_ptr() == t.data_ptr()  # a view, not a copy
    arr = dtypes.int_view(v.numpy())
    assert arr.dtype == d.bits
    assert arr.dtype == dtypes.int_view(np.zeros(3, dtype=v.numpy().dtype)).dtype
    assert v.numpy().dtype == dtypes.torch_int_np(d.width)
    assert v.dtype == dtypes.torch_int_of_width(d.width)
    # negative control: a flipped bit shows in the view
    before = arr.copy()
    v.view(-1)[1] ^= 1
    assert not np.array_equal(before, dtypes.int_view(dtypes.int_view(t).numpy()))


def test_int_view_refuses_other_objects():
    with pytest.raises(ValidationError):
        dtypes.int_view([1, 2])


def test_codec_keeps_working_without_torch():
    # the codec never imports torch; the table must not make it
    import subprocess
    import sys

    code = ("import sys, nemo_dcr.codec.chunk, nemo_dcr.dtypes as d; "
            "assert d.DTYPES['bfloat16'].width == 2; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- no other module keeps a dtype table ----------------------------------------------

_NAMES = set(dtypes.DTYPES) | {d.safetensors for d in dtypes.DTYPES.values()}

def _is_dtype_expr(node: ast.AST) -> bool:
    """``torch.int16``, ``np.uint8``, ``np.dtype(...)``: a dtype written out."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in ("torch", "np", "numpy"))


def tables_in(source: str) -> list[int]:
    """Line numbers of dict literals that are dtype tables: keyed by two or more dtype names
    or safetensors tags, by torch dtypes, or by element widths mapping to dtypes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Dict):
            continue
        keys = [k for k in node.keys if k is not None]
        named = sum(isinstance(k, ast.Constant) and k.value in _NAMES for k in keys)
        torch_keyed = sum(isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name)
                          and k.value.id == "torch" and k.attr in dtypes.DTYPES for k in keys)
        width_keyed = (len(keys) >= 2
                       and all(isinstance(k, ast.Constant) and k.value in (1, 2, 4, 8) for k in keys)
                       and sum(_is_dtype_expr(v) for v in node.values) >= 2)
        if named >= 2 or torch_keyed >= 2 or width_keyed:
            found.append(node.lineno)
    return found


def _sources():
    for top in ("nemo_dcr", "scripts"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel != "nemo_dcr/dtypes.py":
                yield rel, p.read_text()


def test_detector_finds_tables():
    # negative controls: each form the detector must catch, and a derived view it must not
    assert tables_in('X = {"bfloat16": 2, "float16": 2}') == [1]
    assert tables_in('X = {"BF16": "bfloat16", "F16": "float16"}') == [1]
    assert tables_in("X = {torch.bfloat16: 'b', torch.float16: 'h'}") == [1]
    assert tables_in("def f(t):\n    return {1: torch.uint8, 2: torch.int16}[t]") == [2]
    assert tables_in("X = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}") == [1]
    assert tables_in("X = {d.name: d.code for d in DTYPES.values()}") == []
    assert tables_in('X = {"bfloat16": 1}') == []


def test_no_module_keeps_its_own_table():
    offenders = {rel: lines for rel, src in _sources() if (lines := tables_in(src))}
    assert not offenders, f"dtype tables outside nemo_dcr/dtypes.py: {offenders}"
