"""scripts/codec_compare.py: the median is taken per pair over the runs (not over the rounds of
one run), the table names each pair once with before → after, and runs over different pairs
are refused."""
from __future__ import annotations

import json

import pytest
from script_module import script_module

FORMATS = ("nemo_dcr context", "lanes context", "gap16+xor+zstd1")


@pytest.fixture(scope="module")
def cc():
    with script_module("codec_compare") as mod:
        yield mod


def _run(tmp_path, name: str, speed: dict[str, float], pairs=("a", "b")) -> str:
    d = tmp_path / name
    d.mkdir()
    rows = [{"pair": p, "changed_pct": 1.5, "formats": {f: {"x_bound": 0.6, "encode_gbps": speed[p],
                                                            "decode_gbps": 2 * speed[p]} for f in FORMATS}}
            for p in pairs]
    meta = {"bucket_simd": "avx2", "load_avg_start": 0.5}
    (d / "codec.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(d)


def test_medians_over_runs(cc, tmp_path, capsys):
    before = [_run(tmp_path, f"b{i}", {"a": s, "b": 10 * s}) for i, s in enumerate((1.0, 5.0, 2.0))]
    after = [_run(tmp_path, f"a{i}", {"a": s, "b": 10 * s}) for i, s in enumerate((3.0, 9.0, 4.0, 100.0))]
    assert cc.main(["--before", *before, "--after", *after]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| a ") or line.startswith("| b ")}
    assert set(rows) == {"a", "b"}
    # pair a: encode medians 2.00 (of 1, 5, 2) and 6.50 (of 3, 9, 4, 100); decode twice that
    assert "2.00 → **6.50**" in rows["a"] and "4.00 → **13.00**" in rows["a"]
    assert "20.00 → **65.00**" in rows["b"]
    assert "3 runs before, 4 after" in out


def test_different_pairs_are_refused(cc, tmp_path, capsys):
    before = [_run(tmp_path, "b", {"a": 1.0, "b": 1.0})]
    after = [_run(tmp_path, "a", {"a": 1.0, "c": 1.0}, pairs=("a", "c"))]
    assert cc.main(["--before", *before, "--after", *after]) == 2
    assert "different pairs" in capsys.readouterr().err
