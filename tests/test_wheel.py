"""The plugin works as an installed package, not only from this checkout.

The sdist is built from a copy of the source tree (a build writes ``*.egg-info`` and
``build/`` where it runs, and ``make test`` installs this checkout into its other virtualenvs
while the suite runs) and the wheel from the unpacked sdist (so the wheel proves the sdist
holds what a build needs: the C sources and headers, the configs).  The
wheel goes into a fresh virtualenv that reuses .venv's site-packages for the heavy
dependencies (torch, megatron-core, transformers, hydra: nothing is downloaded) without
processing its .pth files, so the editable install of this checkout is not on the path.
From another directory, that venv then runs what ``RefitCallback(overrides=[...])`` does.
The test bed (testbed/, its own distribution) is in neither the sdist nor the wheel:
``nemo-dcr demo`` then says what to install, and with the test bed's own wheel installed
beside it, ``nemo-dcr demo steps=2`` must end bit-exact.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("nemo_dcr")
print(json.dumps({"origin": spec.origin, "path": sys.path}))
"""

CALLBACK = """
import json, sys
import nemo_dcr
from nemo_dcr.integrations.nemo import RefitCallback
cb = RefitCallback(overrides=[f"refit.store_uri={sys.argv[1]}", "refit.receivers=[r0,r1]", "refit.ack_poll_s=0.5"])
print(json.dumps({"file": nemo_dcr.__file__, "settings": cb.refit.settings.to_dict()}))
"""


def bed_members(names: list[str]) -> list[str]:
    """The archive members that belong to the test bed (its package, or the old in-product one)."""
    return [n for n in names if "nemo_dcr_testbed" in n or "nemo_dcr/testbed/" in n]


def _run(cmd, cwd, timeout=600, check=True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` without this checkout's Python settings in the environment (plus ``env``)."""
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "_NEMO_DCR_HIDDEN_PACKAGES")}, **(env or {})}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exit {p.returncode}\nstdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}")
    return p


def build_wheel(tmp: Path) -> tuple[Path, Path, list[str], Path]:
    """The sdist from a copy of this checkout, and the wheel from the unpacked sdist, under
    ``tmp``: (wheel, sdist, the sdist's member names, the copy of the checkout)."""
    dist = tmp / "dist"
    # the checkout without what builds and runs leave in it (virtualenvs, build outputs, caches)
    tree = tmp / "checkout"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".cache", ".*_cache",
        ".hypothesis", "runs"))
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
          "print(build_meta.build_sdist(sys.argv[1]))", str(dist)], cwd=tree)
    (sdist,) = dist.glob("nemo_dcr-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp / "src", filter="data")
    top = names[0].split("/")[0]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(tmp / "src" / top)], cwd=tmp)
    (wheel,) = dist.glob("nemo_dcr-*.whl")
    return wheel, sdist, names, tree


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from the sdist; returns its python."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel, sdist, names, tree = build_wheel(tmp)
    dist = wheel.parent
    top = names[0].split("/")[0]
    # every C source and header of the tree, and the configs, are in the sdist
    needed = [os.path.relpath(p, ROOT) for pat in ("nemo_dcr/**/csrc/*.[ch]", "nemo_dcr/configs/*.yaml")
              for p in glob.glob(str(ROOT / pat), recursive=True)]
    assert any(n.endswith(".h") for n in needed) and any(n.endswith(".yaml") for n in needed)
    assert sorted(set(needed) - {n.removeprefix(f"{top}/") for n in names}) == []
    assert not [n for n in names if n.endswith(".so")]
    assert bed_members(names) == [] and not [n for n in names if n.startswith(f"{top}/testbed/")]

    with zipfile.ZipFile(wheel) as z:
        members = z.namelist()
    assert "nemo_dcr/configs/refit.yaml" in members
    assert len([m for m in members if m.endswith(".so")]) == 3  # _cxor, _cans, _crans
    assert bed_members(members) == [], bed_members(members)
    # the test bed's own wheel, from the copy's testbed/; control: the check above
    # finds its modules there
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(tree / "testbed")], cwd=tmp)
    (testbed_wheel,) = dist.glob("nemo_dcr_testbed-*.whl")
    with zipfile.ZipFile(testbed_wheel) as z:
        bed = z.namelist()
    assert {"nemo_dcr_testbed/cpu_shim.py", "nemo_dcr_testbed/configs/demo.yaml"} <= set(bed_members(bed))

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).stdout.strip())
    # .venv's packages as a plain path entry: its .pth files (the editable install's finder
    # for this checkout among them) are not processed
    (site / "_heavy_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp)
    return py, testbed_wheel


def _origin(python, cwd) -> dict:
    return json.loads(_run([str(python), "-c", PROBE], cwd=cwd).stdout)


@pytest.mark.slow
def test_installed_wheel_loads_settings_and_runs_the_demo(installed, tmp_path):
    installed, testbed_wheel = installed
    venv_site = _run([str(installed), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip()
    probe = _origin(installed, tmp_path)
    assert probe["origin"].startswith(venv_site + os.sep), probe
    assert not [p for p in probe["path"] if p and Path(p).resolve() in (ROOT, ROOT / "nemo_dcr")], probe["path"]
    # negative control: the same probe with this checkout's .venv finds the source tree, so
    # the check above can tell the two apart
    control = _origin(sys.executable, tmp_path)
    assert Path(control["origin"]).resolve().is_relative_to(ROOT), control

    # what RefitCallback(overrides=[...]) does: the packaged refit.yaml, the strict loader
    out = json.loads(_run([str(installed), "-c", CALLBACK, str(tmp_path / "store")], cwd=tmp_path).stdout)
    assert out["file"].startswith(venv_site + os.sep)
    s = out["settings"]
    assert (s["store_uri"], s["receivers"], s["ack_poll_s"], s["model_id"]) == (
        str(tmp_path / "store"), ["r0", "r1"], 0.5, "my-policy")
    bad = _run([str(installed), "-c", CALLBACK.replace("refit.ack_poll_s", "refit.ack_pol_s"), "x"],
               cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "unknown config key 'refit.ack_pol_s'" in bad.stderr

    # without the test bed, `demo` is one line naming what to install
    script = str(installed.parent / "nemo-dcr")
    missing = _run([script, "demo", "steps=2"], cwd=tmp_path, check=False)
    assert missing.returncode == 2 and missing.stdout == "", missing
    assert missing.stderr.strip().splitlines() == [
        "nemo-dcr demo: the end-to-end demo is part of nemo_dcr's test bed, which is not installed "
        "(from a nemo_dcr checkout: pip install ./testbed, or make setup)"], missing.stderr
    _run([sys.executable, "-m", "pip", "--python", str(installed), "install", "--no-deps", "--no-index", "-q",
          str(testbed_wheel)], cwd=tmp_path)

    # the console script, from another directory: a two-step refit, bit-exact at the receiver
    demo = _run([script, "demo", "steps=2", f"run_dir={tmp_path}/run"], cwd=tmp_path)
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert (summary["refits"], summary["committed"], summary["bit_exact"], summary["verified"]) == (2, 2, 2, True)
    rows = [ln.split() for ln in demo.stdout.splitlines() if ln.split() and ln.split()[0] in ("1", "2")]
    assert [r[-1] for r in rows] == ["yes", "yes"], demo.stdout
    assert (tmp_path / "run" / "config.json").exists()
