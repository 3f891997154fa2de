"""A demo run never overwrites a previous run's files, and refuses unusable inputs with
one line on stderr and exit status 2 before it starts a process or writes a file.

Each refusal has a control: the same check passes once the input is fixed (an empty or
new run_dir, ``force=true``, ``store.reset=true``, an openable store URI).
"""
import os

import pytest

from nemo_dcr_testbed import demo


def _snapshot(root) -> dict[str, tuple[bytes, int]]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (fh.read(), os.stat(p).st_mtime_ns)
    return out


class Launched(Exception):
    """Raised instead of starting the first process: the demo got past its input checks."""


@pytest.fixture
def no_launch(monkeypatch):
    def start(self, cmd, log, env):
        raise Launched(cmd[:4])

    monkeypatch.setattr(demo._Children, "start", start)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def previous_run(tmp_path):
    """What a previous demo run left in ``runs/x``: its files and its store."""
    run = tmp_path / "runs" / "x"
    (run / "store").mkdir(parents=True)
    (run / "store" / demo.STORE_MARKER).write_text("")
    (run / "store" / "v").mkdir()
    (run / "store" / "v" / "MANIFEST.json").write_text("{}")
    for name in ("config.json", "steps.jsonl", "trainer.log", "receiver-r0.log"):
        (run / name).write_text(f"previous {name}\n")
    return run


def test_a_non_empty_run_dir_is_refused_and_left_untouched(previous_run, no_launch, capsys):
    before = _snapshot(previous_run)
    assert demo.main([f"run_dir={previous_run}", "steps=1"]) == 2
    line = _one_error_line(capsys)
    assert f"run_dir {previous_run} is not empty" in line and "force=true" in line, line
    assert _snapshot(previous_run) == before  # same files, same bytes, same mtimes


def test_a_new_or_empty_run_dir_or_force_gets_to_the_launch(previous_run, tmp_path, no_launch):
    # control for the refusal above: these get as far as starting the trainer
    (tmp_path / "empty").mkdir()
    for overrides in ([f"run_dir={tmp_path}/new"], [f"run_dir={tmp_path}/empty"],
                      [f"run_dir={previous_run}", "force=true"]):
        with pytest.raises(Launched):
            demo.main([*overrides, "steps=1"])


def test_a_store_holding_a_previous_run_is_refused_unless_reset(previous_run, tmp_path, no_launch, capsys):
    store = previous_run / "store"
    before = _snapshot(store)
    assert demo.main([f"run_dir={tmp_path}/new", f"store.uri={store}"]) == 2
    line = _one_error_line(capsys)
    assert f"store {store} holds a previous run" in line and "store.reset=true" in line, line
    assert _snapshot(store) == before and not (tmp_path / "new").exists()
    # control: with store.reset=true the same store is emptied for the new run
    with pytest.raises(Launched):
        demo.main([f"run_dir={tmp_path}/new", f"store.uri={store}", "store.reset=true"])
    assert sorted(os.listdir(store)) == [demo.STORE_MARKER]


def test_a_foreign_directory_is_never_used_as_a_store(tmp_path, no_launch, capsys):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "a.jpg").write_bytes(b"\xff\xd8")
    assert demo.main([f"run_dir={tmp_path}/run", f"store.uri={mine}", "force=true", "store.reset=true"]) == 2
    assert "is a non-empty directory that is not a nemo_dcr demo store" in _one_error_line(capsys)
    assert os.listdir(mine) == ["a.jpg"]


@pytest.mark.parametrize("uri,needle", [
    ("nosuchproto://bucket/x", "store.uri: store nosuchproto://bucket/x: cannot open store: ValueError: Protocol not "
                               "known: nosuchproto: check the URI's scheme"),
    ("{blocker}/store", "cannot create"),
])
def test_a_store_uri_that_cannot_be_opened_is_one_line(tmp_path, no_launch, capsys, uri, needle):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    uri = uri.format(blocker=blocker)
    assert demo.main([f"run_dir={tmp_path}/run", f"store.uri={uri}"]) == 2
    line = _one_error_line(capsys)
    assert needle in line, line
    assert not (tmp_path / "run").exists()


def test_an_s3_store_nobody_serves_is_refused_before_anything_is_written(tmp_path, no_launch, capsys,
                                                                         monkeypatch):
    """An ``s3://`` store is checked (``configs/check.check_store_uri``) before the run_dir or
    any process exists: an endpoint on a closed loopback port is one line, exit 2."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with block ends: nobody listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert demo.main([f"run_dir={tmp_path}/run", "store.uri=s3://dcr-demo-inputs/x"]) == 2
    line = _one_error_line(capsys)
    assert "store.uri: store s3://dcr-demo-inputs/x: cannot reach the S3 endpoint" in line, line
    assert f"127.0.0.1:{port}" in line and "AWS_ENDPOINT_URL" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("runtime", ["hf", "vllm", "vllm_serve"])
def test_every_receiver_runtime_gets_past_the_installed_check(tmp_path, no_launch, runtime):
    # control for the engine check before launch (registry.check_installed): vllm_serve (the
    # demo's `vllm serve` engines, not a registry runtime) needs the vllm package too
    pytest.importorskip("vllm") if runtime != "hf" else None
    with pytest.raises(Launched):
        demo.main([f"run_dir={tmp_path}/run", f"receiver.runtime={runtime}", "steps=1"])


def test_an_openable_store_uri_gets_to_the_launch(tmp_path, no_launch):
    # control for the refusals above (no server is needed to open an s3:// URI)
    for uri in ("memory://demo-inputs/x", f"{tmp_path}/store"):
        with pytest.raises(Launched):
            demo.main([f"run_dir={tmp_path}/run-{len(uri)}", f"store.uri={uri}"])


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path, no_launch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert demo.main([f"run_dir={blocker}/run", f"store.uri={tmp_path}/store"]) == 2
    assert f"run_dir {blocker}/run cannot be created" in _one_error_line(capsys)
    assert not (tmp_path / "store").exists()
    with pytest.raises(Launched):  # control
        demo.main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store"])


def test_refit_key_file_is_the_runs_key_and_a_bad_one_is_refused(tmp_path, monkeypatch, capsys):
    """``refit.key_file`` (README: "Runs, keys, faults") works in the demo: a key that does not
    load is refused before anything is written; a good one signs the run (trainer and
    receivers get it) instead of a new per-run key."""
    import json
    from nemo_dcr.protocol.signing import KEY_ENV, new_key_file

    too_open = tmp_path / "open.key"
    new_key_file(str(too_open))
    os.chmod(too_open, 0o644)
    for key, needle in ((tmp_path / "no.key", "No such file"), (too_open, "are too open")):
        assert demo.main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"refit.key_file={key}"]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"[nemo-dcr demo] refit.key_file: signing key '{key}'") and needle in line, line
        assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()

    key = tmp_path / "run.key"  # control: a private key file
    new_key_file(str(key))
    started = []

    def start(self, cmd, log, env):
        started.append(env)
        raise Launched(cmd[:4])

    monkeypatch.setattr(demo._Children, "start", start)
    with pytest.raises(Launched):
        demo.main([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", f"refit.key_file={key}"])
    assert [env[KEY_ENV] for env in started] == [str(key)]
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["refit"]["key_file"] == str(key)  # what the trainer's RefitOptions is built from
    assert not (tmp_path / "run" / "refit.key").exists()
