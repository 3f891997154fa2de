"""The runtime registry: names, lazy resolution, refusals naming what is known."""
import subprocess
import sys

import pytest

from nemo_dcr.errors import DcrError, ValidationError
from nemo_dcr.receiver import registry
from nemo_dcr.receiver.registry import (RuntimeOptions, UnknownRuntimeError, check_options, runtime_factory,
                                        runtime_names)


def test_names_and_unknown_name():
    assert runtime_names() == ("hf", "vllm")
    with pytest.raises(UnknownRuntimeError, match=r"unknown runtime 'sglang' \(known: hf, vllm\)") as e:
        runtime_factory("sglang")
    assert isinstance(e.value, ValidationError) and isinstance(e.value, DcrError)
    with pytest.raises(UnknownRuntimeError):
        check_options("sglang", RuntimeOptions())


def test_listing_names_imports_no_runtime():
    code = ("import sys; from nemo_dcr.receiver.registry import runtime_names; runtime_names(); "
            "import nemo_dcr.receiver.bootstrap, nemo_dcr.receiver.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('nemo_dcr.runtimes') or m == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_every_row_resolves_to_a_callable():
    for name in runtime_names():
        assert callable(runtime_factory(name)), name


def test_options_checked_against_the_row(monkeypatch):
    check_options("hf", RuntimeOptions(persistent=True, reference=True))  # control: supported
    with pytest.raises(ValidationError, match="runtime 'hf' does not support tensor_parallel_size, sample_tokens"):
        check_options("hf", RuntimeOptions(tensor_parallel_size=2, sample_tokens=1))
    with pytest.raises(ValidationError, match="tensor_parallel_size must be >= 1"):
        RuntimeOptions(tensor_parallel_size=0)
    # a new runtime is one row: its name is then accepted, its options as the row says
    monkeypatch.setitem(registry._RUNTIMES, "fake", ("nemo_dcr.runtimes.hf:serve", frozenset({"sample_tokens"})))
    assert "fake" in runtime_names() and runtime_factory("fake") is runtime_factory("hf")
    check_options("fake", RuntimeOptions(sample_tokens=3))
    with pytest.raises(ValidationError, match="runtime 'fake' does not support persistent"):
        check_options("fake", RuntimeOptions(persistent=True))
