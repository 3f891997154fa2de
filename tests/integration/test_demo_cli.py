"""`nemo-dcr` input errors are one line on stderr, exit status 2, no traceback."""
import pytest

from nemo_dcr import cli


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("uri,needle", [
    ("nosuchproto://bucket/x", "cannot open store: ValueError: Protocol not known: nosuchproto"),
    ("{blocker}/store", "cannot open store: NotADirectoryError"),
])
def test_receive_with_a_store_that_cannot_be_opened(tmp_path, capsys, uri, needle):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    uri = uri.format(blocker=blocker)
    assert cli.main(["receive", "--store", uri, "--receiver-id", "r0", "--model-id", "m"]) == 2
    line = _err_line(capsys)
    assert line.startswith(f"nemo-dcr receive: --store: StoreError: {uri}: ") and needle in line, line
    # control: an openable store passes the same check (the receiver itself is not started)
    from nemo_dcr.receiver import cli as receive_cli

    args = receive_cli.parser().parse_args(["--store", str(tmp_path / "ok"), "--receiver-id", "r0", "--model-id", "m"])
    assert receive_cli.check_input(args)[0].uri.endswith("ok")


def test_unknown_command_and_demo_config_errors(capsys):
    assert cli.main(["bogus"]) == 2
    assert _err_line(capsys) == "nemo-dcr: unknown command 'bogus' (commands: checkpoint, delta, demo, keygen, receive, relay; see nemo-dcr --help)"
    assert cli.main(["demo", "+colour=red"]) == 2
    assert "unknown config key 'colour'" in _err_line(capsys)
    assert cli.main(["--help"]) == 0  # control
    assert "nemo-dcr demo" in capsys.readouterr().out


def test_keygen_creates_a_key_once(tmp_path, capsys):
    from nemo_dcr.cli import main
    from nemo_dcr.protocol.signing import load_key

    path = str(tmp_path / "run.key")
    assert main(["keygen", path]) == 0
    key = load_key(path)
    assert key is not None and len(key) == 32
    assert main(["keygen", path]) == 2  # never overwritten
    assert "never overwritten" in _err_line(capsys)
    assert load_key(path) == key
