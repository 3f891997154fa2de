"""The `nemo-dcr` console script as a user meets it: --version, --help on every built-in
sub-command, help text that names docs (not source files a wheel user lacks), output cut
short by its reader, and keygen's messages.  Each runs the installed script in a process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("nemo-dcr")


def nemo_dcr(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "nemo_dcr.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _distribution_version() -> str:
    from importlib.metadata import version

    return version("nemo-dcr")


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    p = nemo_dcr(flag)
    assert (p.returncode, p.stderr) == (0, ""), p
    assert p.stdout == f"nemo-dcr {_distribution_version()}\n"
    # and it is pyproject's version, the one a wheel is built with
    assert re.search(rf'^version = "{re.escape(_distribution_version())}"$',
                     (ROOT / "pyproject.toml").read_text(), re.M)


def test_top_help_lists_every_built_in_and_names_no_source_file():
    from nemo_dcr.cli import BUILT_IN

    assert "status" in BUILT_IN
    for flag in ("--help", "-h"):
        p = nemo_dcr(flag)
        assert (p.returncode, p.stderr) == (0, ""), p
        for cmd in BUILT_IN:
            assert f"nemo-dcr {cmd} " in p.stdout, cmd
        assert "--version" in p.stdout
        # doc files (README.md, docs/*.md) are fine; a source path is not (the wheel has no sources a
        # user reads, and a path inside the package is no help)
        assert not re.findall(r"[\w/]+\.py\b", p.stdout), re.findall(r"[\w/]+\.py\b", p.stdout)


BUILT_IN_HELP = {
    "receive": "--receiver-id", "status": "--store", "checkpoint": "--out", "relay": "--upstream",
    "keygen": "PATH", "delta": "{encode,apply,inspect}",
}


@pytest.mark.parametrize("cmd", sorted(BUILT_IN_HELP))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_built_in_has_help(cmd, flag):
    from nemo_dcr.cli import BUILT_IN

    assert set(BUILT_IN) == set(BUILT_IN_HELP)  # a new built-in gets a row here
    p = nemo_dcr(cmd, flag)
    assert (p.returncode, p.stderr) == (0, ""), p
    assert p.stdout.startswith(f"usage: nemo-dcr {cmd}"), p.stdout[:200]
    assert BUILT_IN_HELP[cmd] in p.stdout
    assert not re.findall(r"[\w/]+\.py\b", p.stdout), (cmd, re.findall(r"[\w/]+\.py\b", p.stdout))
    assert "``" not in p.stdout, (cmd, p.stdout[:400])  # docstring markup is not help text


@pytest.mark.parametrize("sub", ["encode", "apply", "inspect"])
def test_delta_sub_commands_have_help(sub):
    p = nemo_dcr("delta", sub, "--help")
    assert (p.returncode, p.stderr) == (0, ""), p
    assert p.stdout.startswith(f"usage: nemo-dcr delta {sub}")


def test_unknown_command_is_one_line():
    p = nemo_dcr("stauts")
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and "status" in p.stderr, p.stderr


@pytest.fixture(scope="module")
def delta_file(tmp_path_factory) -> Path:
    """A delta file whose ``inspect --json`` is far larger than a pipe's buffer (64 KiB)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("delta")
    g = torch.Generator().manual_seed(0)
    a = {f"layer.{i}.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16) for i in range(1500)}
    b = {k: (v.view(torch.int16) ^ (torch.rand(v.shape, generator=g) < 0.1).to(torch.int16)).view(torch.bfloat16)
         for k, v in a.items()}
    save_file(a, str(d / "a.safetensors"))
    save_file(b, str(d / "b.safetensors"))
    p = nemo_dcr("delta", "encode", "--base", str(d / "a.safetensors"), "--target", str(d / "b.safetensors"),
                 "--out", str(d / "d.dcr"))
    assert p.returncode == 0, p
    return d / "d.dcr"


def _first_line_then_close(*args: str) -> tuple[int, str, str]:
    """``nemo-dcr ARGS | head -1``: read one line, close the pipe, wait."""
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "nemo_dcr.cli"]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline().decode()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), first, err


def test_output_cut_short_by_its_reader_is_quiet(delta_file):
    full = nemo_dcr("delta", "inspect", "--json", str(delta_file))
    assert full.returncode == 0 and len(full.stdout) > 4 * 65536, len(full.stdout)  # more than a pipe holds
    rc, first, err = _first_line_then_close("delta", "inspect", "--json", str(delta_file))
    assert first == "{\n"
    assert err == "", err  # no BrokenPipeError, no "Exception ignored"
    assert rc == 141  # a shell's status for a tool stopped by SIGPIPE
    # the table too
    rc, first, err = _first_line_then_close("delta", "inspect", str(delta_file))
    assert (rc, err) == (141, ""), err
    assert first.split()[:2] == ["tensor", "dtype"]


def test_keygen_messages(tmp_path):
    key = tmp_path / "run.key"
    p = nemo_dcr("keygen", str(key))
    assert (p.returncode, p.stdout, p.stderr) == (0, f"{key}\n", "")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert len(bytes.fromhex(key.read_text().strip())) == 32
    before = key.read_text()

    cases = {
        str(key): f"nemo-dcr keygen: {key}: exists: an existing key is never overwritten",
        str(tmp_path / "no" / "such" / "k"): (f"nemo-dcr keygen: {tmp_path}/no/such/k: the folder "
                                               f"{tmp_path}/no/such does not exist (create it first)"),
        str(tmp_path): f"nemo-dcr keygen: {tmp_path}: is a folder: give the path of the key file to create in it",
        str(key / "k"): f"nemo-dcr keygen: {key}/k: {key} is not a folder",
    }
    for arg, line in cases.items():
        p = nemo_dcr("keygen", arg)
        assert (p.returncode, p.stdout) == (2, ""), p
        assert p.stderr.splitlines() == [line], p.stderr
    assert key.read_text() == before  # never overwritten
    assert sorted(os.listdir(tmp_path)) == ["run.key"]  # nothing created, no folder made

    for args in ([], ["a", "b"], ["--force"]):
        p = nemo_dcr("keygen", *args)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "keygen --help" in p.stderr, p


def test_keygen_relative_path_in_the_working_folder(tmp_path):
    p = nemo_dcr("keygen", "k", cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "k").exists(), p


def test_status_is_dispatched(tmp_path):
    """`status` reaches nemo_dcr.status_cli: a store that is not there is its one-line refusal."""
    p = nemo_dcr("status", "--store", str(tmp_path / "missing"))
    assert p.returncode == 2 and p.stdout == "", p
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("nemo-dcr status"), p.stderr
