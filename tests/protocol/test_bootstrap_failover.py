"""Bootstrap through a lying relay: a receiver starting from nothing reads ``RUN.json``,
``init/INIT.json`` and the version-0 files through its upstream list (a liar first, the
origin after it, ``protocol_helpers.Liar``).  A flipped, swapped or hidden copy is asked of
the origin, the genuine one is used and the liar is left; each case has a control without
the second upstream, where the same lie is refused (or waited out) as before.
"""
from __future__ import annotations

import os
import re
import time

import pytest
from protocol_helpers import Liar, key  # noqa: F401 - key is a fixture

from nemo_dcr.errors import DcrError, FormatError, ProtocolError
from nemo_dcr.protocol import run as run_mod
from nemo_dcr.protocol.run import wait_for_run
from nemo_dcr.protocol.manifest import INIT_RECORD_KEY, RUN_KEY
from nemo_dcr.protocol.run import ForeignRunError, claim_store
from nemo_dcr.protocol.version0 import read_init_record, write_init_record
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver import bootstrap
from nemo_dcr.receiver.bootstrap import fetch_version_zero
from nemo_dcr.transport.failover import FailoverStore
from nemo_dcr.transport.store import LocalDirStore

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(1 << 16)}


def _run(tmp_path, key):
    """A run on a directory store with version 0 published; (origin, sealer, run id)."""
    sealer = Sealer(load_key(key))
    origin = LocalDirStore(str(tmp_path / "store"))
    run_id = claim_store(origin, sealer, "m").run_id
    for name, blob in FILES.items():
        origin.put(f"init/{name}", blob)
    write_init_record(origin, sealer, run_id, FILES)
    return origin, sealer, run_id


def _through(origin, rules, *, failover=True):
    liar = Liar(LocalDirStore(origin.uri))
    for pattern, kind in rules:
        liar.lie(re.escape(pattern), kind, None)
    return liar, (FailoverStore([liar, LocalDirStore(origin.uri + "/.")], lag_grace_s=0.1) if failover else liar)


@pytest.mark.parametrize("kind", ["garble", "swap:" + INIT_RECORD_KEY])
def test_a_flipped_run_record_is_read_from_the_next_upstream(tmp_path, key, kind):
    origin, sealer, run_id = _run(tmp_path, key)
    liar, fs = _through(origin, [(RUN_KEY, kind)])
    assert wait_for_run(fs, sealer, run_id=None, timeout_s=10) == run_id
    assert liar.lies >= 1 and fs.upstream_stats()[0]["bad_bytes"] == 1
    with pytest.raises((ForeignRunError, FormatError)):  # control: the liar alone
        wait_for_run(_through(origin, [(RUN_KEY, kind)], failover=False)[1], sealer, run_id=None, timeout_s=1)


def test_a_hidden_run_record_is_asked_of_the_next_upstream(tmp_path, key, monkeypatch):
    monkeypatch.setattr(run_mod, "RUN_PROBE_S", 0.2)
    origin, sealer, run_id = _run(tmp_path, key)
    liar, fs = _through(origin, [(RUN_KEY, "hide")])
    assert wait_for_run(fs, sealer, run_id=run_id, timeout_s=10) == run_id
    with pytest.raises(ProtocolError, match="no run record"):  # control: the liar alone
        wait_for_run(_through(origin, [(RUN_KEY, "hide")], failover=False)[1], sealer, run_id=run_id, timeout_s=0.5)


@pytest.mark.parametrize("kind", ["garble", "hide", "413"])
def test_a_bad_init_record_is_read_from_the_next_upstream(tmp_path, key, kind, monkeypatch):
    monkeypatch.setattr(bootstrap, "INIT_PROBE_S", 0.2)
    origin, sealer, run_id = _run(tmp_path, key)
    liar, fs = _through(origin, [(INIT_RECORD_KEY, kind)])
    d, root = fetch_version_zero(fs, sealer, run_id, state_dir=str(tmp_path / "rx"), timeout_s=10)
    assert root == read_init_record(origin, sealer, run_id)[1]
    assert {n: open(os.path.join(d, n), "rb").read() for n in FILES} == FILES
    _, alone = _through(origin, [(INIT_RECORD_KEY, kind)], failover=False)
    with pytest.raises(DcrError):  # control: refused, or never published as far as it can tell
        fetch_version_zero(alone, sealer, run_id, state_dir=str(tmp_path / "rx2"), timeout_s=0.5)


@pytest.mark.parametrize("kind", ["garble", "hide", "413", "swap:init/config.json"])
def test_a_bad_init_model_is_downloaded_from_the_next_upstream(tmp_path, key, kind):
    """The weights file the relay serves is flipped, missing, claimed too large or another
    file: the download leaves the liar and takes the bytes INIT.json lists from the origin."""
    origin, sealer, run_id = _run(tmp_path, key)
    liar, fs = _through(origin, [("init/model.safetensors", kind)])
    d, _ = fetch_version_zero(fs, sealer, run_id, state_dir=str(tmp_path / "rx"), timeout_s=10)
    assert open(os.path.join(d, "model.safetensors"), "rb").read() == FILES["model.safetensors"]
    time.sleep(0.15)  # a hidden file: demoted when it still has none lag_grace_s later (next call)
    fs.current
    assert fs.upstream_stats()[0]["bad_bytes"] == 1
    _, alone = _through(origin, [("init/model.safetensors", kind)], failover=False)
    with pytest.raises(Exception, match="not this run.s version 0|no such object|over the limit of 65536"):
        fetch_version_zero(alone, sealer, run_id, state_dir=str(tmp_path / "rx2"), timeout_s=5)


def test_the_download_is_bounded_by_the_recorded_size(tmp_path, key):
    """Each version-0 file is read with max_bytes = the size INIT.json records (an upstream
    that claims more is refused before its body: a stall costs timeout + size / min rate)."""
    origin, sealer, run_id = _run(tmp_path, key)
    asked = {}

    class Spy(LocalDirStore):
        def get_with_info(self, k, *, max_bytes=None):
            asked[k] = max_bytes
            return super().get_with_info(k, max_bytes=max_bytes)

    fetch_version_zero(Spy(origin.uri), sealer, run_id, state_dir=str(tmp_path / "rx"), timeout_s=10)
    assert {k: asked[f"init/{k}"] for k in FILES} == {k: len(b) for k, b in FILES.items()}
