"""What the demo says while it waits (issue 35): progress lines on stderr during the initial
checkpoint and the first commit, and whether (with which key) the run is signed; stdout keeps
the table (its header with the first row) and the JSON summary only (``main`` prints that)."""
import os
import re

import pytest

from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config

from .test_refit_e2e import SMALL

STAGES = ["starting (loading the model)", "ready (holds v0)", "acked v1", "holds v1"]
FIRST = re.compile(r"^\[nemo-dcr demo\] waiting for the first commit \((\d+) s\): "
                   r"trainer (?:on step 1|published v1, waiting for the acks|decided v1); r0 (.+)$")


def test_a_run_says_how_it_is_signed_and_what_it_waits_for(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "PROGRESS_EVERY_S", 0.5)  # a line every 0.5 s: every stage of a fast machine too
    run_dir = tmp_path / "run"
    summary = demo.run(load_demo_config([f"run_dir={run_dir}", f"store.uri={tmp_path}/store", "steps=1", *SMALL,
                                         "refit.verify_dense=false"]))
    assert summary["committed"] == 1
    out, err = capsys.readouterr()
    err = err.splitlines()
    key = run_dir / "refit.key"
    assert f"[nemo-dcr demo] run signed with a generated key {key} (a receiver started by hand needs it: " \
           f"nemo-dcr receive --key-file {key})" in err, err
    from nemo_dcr.protocol.signing import load_key

    assert load_key(str(key)) is not None  # the key it names is the run's key file
    v0 = [ln for ln in err if ln.startswith("[nemo-dcr demo] waiting for the initial checkpoint (version 0) (")]
    assert v0 and all(ln.endswith("2 trainer rank(s) starting, building the model") for ln in v0), err
    first = [FIRST.match(ln) for ln in err if "waiting for the first commit" in ln]
    assert first and all(first), err
    stages = [STAGES.index(m.group(2)) for m in first]  # each line names a known stage ...
    assert stages == sorted(stages), err  # ... and a receiver never goes back a stage
    secs = [int(m.group(1)) for m in first]
    assert secs == sorted(secs)
    # stdout: the table (header first, with the row) and the summary, no progress
    lines = out.splitlines()
    assert lines[0].split() == [name for name, _ in demo.COLUMNS]
    assert len(lines) == 2 and lines[1].split()[0] == "1"
    assert not [ln for ln in lines if "waiting" in ln or "signed" in ln]


class Launched(Exception):
    pass


def test_a_given_key_is_named(tmp_path, capsys, monkeypatch):
    """``refit.key_file=KEY``: the line names that file (said before any process starts)."""
    from nemo_dcr.protocol.signing import new_key_file

    key = new_key_file(str(tmp_path / "mine.key"))

    def start(self, cmd, log, env):
        raise Launched(cmd[:4])

    monkeypatch.setattr(demo._Children, "start", start)
    with pytest.raises(Launched):
        demo.main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"refit.key_file={key}"])
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[nemo-dcr demo] run signed with refit.key_file {os.path.abspath(key)}"], err
    assert not (tmp_path / "run" / "refit.key").exists()  # control: no key generated
