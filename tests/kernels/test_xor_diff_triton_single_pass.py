"""The single-pass (decoupled look-back) Triton kernel vs the C path, the reference and the
two-pass kernels, on CPU through the Triton interpreter (triton_single_pass_cases.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_single_pass_cases.py")


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_check_passed_and_every_negative_control_was_detected(results):
    assert [r for r in results if not r["ok"]] == []
    assert [r for r in results if not r["negative_control_detected"]] == []


def test_cases_cover_sizes_widths_and_both_probe_forms(results):
    cases = [r for r in results if r["check"] == "case"]
    import triton.language as tl

    forms = {True, False} if hasattr(tl, "atomic_load") else {False}
    assert {r["atomic_load"] for r in cases} == forms
    assert len(cases) == 12 * len(forms)
    assert {0, 1}.issubset({r["numel"] for r in cases})  # empty and one element
    assert any(r["changed"] == r["numel"] > 1000 for r in cases)  # all changed
    assert any(r["changed"] == 0 and r["numel"] > 0 for r in cases)  # none changed
    assert {"torch.bfloat16", "torch.float16", "torch.float32", "torch.float8_e4m3fn"} <= {r["dtype"] for r in cases}


def test_overflow_completion_ran_below_at_and_above_the_total(results):
    caps = [r for r in results if r["check"] == "capacity"]
    assert any(r["capacity"] < r["changed"] for r in caps)
    assert any(r["capacity"] == r["changed"] for r in caps)
    assert any(r["capacity"] > r["changed"] for r in caps)


def test_look_back_step_met_not_ready_and_whole_aggregate_windows(results):
    steps = [r for r in results if r["check"] == "look_back"]
    assert {r["window"] for r in steps} == {4, 32}
    assert all(r["not_ready_seen"] > 0 and r["aggregate_windows"] > 0 for r in steps)


def test_interpreter_runs_programs_in_program_id_order(results):
    assert [r["ok"] for r in results if r["check"] == "interpreter_order"] == [True]


@pytest.mark.parametrize("atomic_load", [True, False])
def test_single_pass_kernel_compiles_for_sm90_with_ordered_probes(atomic_load):
    """Compile (no device needed; Triton ships ptxas) what the interpreter cannot check:
    the loop-carried types of the look-back and the lowering of its atomics.  Publishes must
    carry release semantics and every probe acquire semantics, and the probe must sit inside
    the spin loop (after the loop's label), not be hoisted above it."""
    import re

    import triton
    import triton.language as tl

    if atomic_load and not hasattr(tl, "atomic_load"):
        pytest.skip("this Triton has no tl.atomic_load")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no GPUTarget/ASTSource")
    from nemo_dcr.kernels import triton_xor as tx

    sig = {"a_ptr": "*i16", "b_ptr": "*i16", "ctrl_ptr": "*i64", "pos_ptr": "*i64", "val_ptr": "*i16",
           "numel": "i32", "capacity": "i64", "block_counts_offset": "i32", "tiles_per_block": "i32",
           "TILE": "constexpr", "WINDOW": "constexpr", "COUNT_BLOCKS": "constexpr", "ATOMIC_LOAD": "constexpr"}
    consts = {"TILE": 4096, "WINDOW": tx.LOOK_BACK_WINDOW, "COUNT_BLOCKS": True, "ATOMIC_LOAD": atomic_load}
    try:
        kernel = triton.compile(ASTSource(fn=tx._single_pass_kernel, signature=sig, constexprs=consts),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas in this Triton build
        if "ptxas" not in str(e):
            raise
        pytest.skip(f"cannot assemble for sm_90 here: {e}")
    # instructions and labels only (no comments, debug locations or inline-asm markers)
    ptx = "\n".join(c for line in kernel.asm["ptx"].splitlines()
                    if (c := line.split("//")[0].strip()) and not c.startswith(".loc"))
    if atomic_load:
        publish = r"fence\.release\.gpu;\n(?:mov[^\n]*\n)?@%p\d+ st\.relaxed\.gpu\.global\.b64"
        probe = r"ld\.relaxed\.gpu\.global\.b64[^\n]*\nfence\.acquire\.gpu"
    else:
        publish, probe = r"atom\.global\.gpu\.release\.exch\.b64", r"atom\.global\.gpu\.acquire\.add\.u64"
    assert len(re.findall(publish, ptx)) == 2  # AGGREGATE, then INCLUSIVE

    def probe_in_loop(code: str) -> bool:
        loop = re.search(r"\n\$L__BB0_(\d+):(.*?)bra\s+\$L__BB0_\1;", code, re.S)  # first backward branch
        return bool(loop and re.search(probe, loop.group(2)))

    assert probe_in_loop(ptx), "the look-back probe is not inside the spin loop"
    hoisted = re.sub(probe, "", ptx)  # negative control: the same code without its probe in the loop
    assert not probe_in_loop(hoisted)
    assert re.search(r"atom\.global\.gpu\.relaxed\.add\.u64", ptx)  # the ticket
