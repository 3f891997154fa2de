#!/usr/bin/env bash
# One prepared GPU check of the Triton XOR diff (both implementations), to run on a machine
# with a CUDA device, e.g. a lent H200:
#
#     bash scripts/gpu_check.sh              # results under benchmarks/results/
#     OUT=/some/dir bash scripts/gpu_check.sh   # results under $OUT (the device tool's folder)
#
# Installs nothing. It needs what `pip install -e '.[dev]'` provides (torch with CUDA,
# triton, numpy, pytest, matplotlib; a C compiler for the native helpers) or an image that
# already has them: the repo root goes on PYTHONPATH, and the C helpers (the CPU reference
# path the GPU results are compared with) are built in place if they are not importable.
#
#   1. environment: python, torch, triton, device; exits 2 at once without a CUDA device;
#   2. `pytest -m gpu tests/kernels` (test_xor_diff_triton_gpu.py: both implementations vs
#      the C path up to 2**26 elements, determinism, overflow completion; test_xor_diff_cpu.py's
#      CUDA test), at most 180 s: a single-pass look-back that deadlocks shows as a timeout;
#   3. scripts/bench_xor_gpu.py (0.25/1/4 GiB BF16 x 0..100 % x tiles 1-4K, both
#      implementations side by side, bit-checked), at most 150 s.
# Expected total on an H200: ~3-5 minutes, most of it Triton compilation and CPU-side checks.
# Writes gpu_check.log, gpu_tests.xml, bench_xor_gpu.json, bench_xor_gpu.png; exits non-zero
# if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

main() {
    echo "== environment"
    if ! "$PY" - <<'EOF'
import platform, sys
import torch, triton
print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}")
if not torch.cuda.is_available():
    print("gpu_check: FAILED: no CUDA device visible to torch; nothing checked", file=sys.stderr)
    sys.exit(2)
print(f"device {torch.cuda.get_device_name()}  capability {torch.cuda.get_device_capability()}")
import triton.language as tl
print("tl.atomic_load:", hasattr(tl, "atomic_load"), "(else the single pass probes with RMW atomics)")
EOF
    then
        exit 2
    fi

    if ! "$PY" -c "import nemo_dcr.kernels._cxor" 2>/dev/null; then
        echo "== building the C helpers in place (setup.py build_ext --inplace)"
        "$PY" setup.py -q build_ext --inplace || { echo "gpu_check: FAILED: C helpers did not build"; exit 3; }
    fi

    echo "== pytest -m gpu tests/kernels"
    start=$SECONDS
    timeout 180 "$PY" -m pytest -m gpu tests/kernels -q -p no:cacheprovider --junitxml="$DEST/gpu_tests.xml"
    tests_rc=$?
    echo "pytest exit $tests_rc after $((SECONDS - start)) s (124 = timed out: suspect a look-back deadlock)"

    echo "== scripts/bench_xor_gpu.py"
    start=$SECONDS
    timeout 150 "$PY" scripts/bench_xor_gpu.py --out "$DEST"
    bench_rc=$?
    echo "bench exit $bench_rc after $((SECONDS - start)) s"

    if [ "$tests_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ]; then
        echo "gpu_check: FAILED (tests $tests_rc, bench $bench_rc)"
        exit 1
    fi
    echo "gpu_check: passed (tests and benchmark); results in $DEST"
}

main 2>&1 | tee "$DEST/gpu_check.log"
exit "${PIPESTATUS[0]}"
