"""The test lanes' own checks (tests/conftest.py): the auto-marker finds process-starting
tests, and the guard fails a test that starts a process without the ``spawns`` mark, however
the start is hidden from the marker or its error swallowed.  Runs a small pytest session on
planted tests, in a child process, with a copy of the real conftest."""
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent

PLANTED = '''
import os
import subprocess
import sys

import pytest

from helper import launch_something


def _hidden(module, name):
    # what the marker cannot see: the module and function names are built at run time
    return getattr(__import__(module[::-1]), name)


def test_plain_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_through_a_helper_in_another_module():
    launch_something()


@pytest.fixture
def server():
    return subprocess.Popen([sys.executable, "-c", "pass"])


def test_through_a_fixture(server):
    server.wait()


@pytest.fixture(params=["local", "remote"])
def store(request):
    if request.param == "remote":
        request.getfixturevalue("server").wait()
    return request.param


def test_only_the_remote_parameter_spawns(store):
    pass


def test_pure():
    assert sum(range(4)) == 6


def test_hidden_popen():
    _hidden("ssecorpbus", "run")([sys.executable, "-c", "pass"])


def test_hidden_popen_swallowed():
    try:
        _hidden("ssecorpbus", "check_output")([sys.executable, "-c", "pass"])
    except Exception:
        pass


def test_hidden_multiprocessing():
    _hidden("gnissecorpitlum", "Process")(target=print).start()


def test_hidden_fork():
    pid = getattr(os, "krof"[::-1])()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.spawns
def test_marked_by_hand():
    _hidden("ssecorpbus", "run")([sys.executable, "-c", "pass"])
'''

HELPER = '''
import subprocess
import sys


def launch_something():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''

SPAWNING = {"test_plain_subprocess", "test_through_a_helper_in_another_module", "test_through_a_fixture",
            "test_only_the_remote_parameter_spawns[remote]", "test_marked_by_hand"}
CAUGHT = {"test_hidden_popen", "test_hidden_popen_swallowed", "test_hidden_multiprocessing", "test_hidden_fork"}
PURE = {"test_pure", "test_only_the_remote_parameter_spawns[local]"}


def _session(tmp_path, *args) -> dict[str, str]:
    """name -> "passed" / failure message, for one pytest session over the planted tests."""
    d = tmp_path / "planted"
    d.mkdir(exist_ok=True)
    for f in ("conftest.py", "moto_helpers.py"):
        shutil.copy(HERE / f, d / f)
    (d / "test_planted.py").write_text(PLANTED)
    (d / "helper.py").write_text(HELPER)
    xml = tmp_path / f"r{len(args)}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                    f"--rootdir={d}", f"--junitxml={xml}", *args, str(d)],
                   capture_output=True, text=True, timeout=300, cwd=d)
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        out[case.get("name")] = "passed" if bad is None else bad.get("message", "")
    return out


def test_the_fast_lane_runs_exactly_the_tests_that_start_no_process(tmp_path):
    got = _session(tmp_path, "-m", "not spawns")
    assert set(got) == PURE | CAUGHT  # every spawning test the marker can see was deselected
    assert all(got[n] == "passed" for n in PURE), got
    for name in CAUGHT:  # hidden from the marker: the guard fails each one, with the message
        assert "spawns a process: mark it / fix the auto-marker" in got[name], (name, got[name])


def test_the_full_lane_runs_the_marked_tests_unguarded(tmp_path):
    got = _session(tmp_path)
    assert {n for n, r in got.items() if r == "passed"} == PURE | SPAWNING, got
    assert {n for n, r in got.items() if r != "passed"} == CAUGHT  # the guard is on in every lane
