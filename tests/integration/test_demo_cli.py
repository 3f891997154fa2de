"""`nemo-dcr` input errors are one line on stderr, exit status 2, no traceback."""
import re

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
    assert _err_line(capsys) == "nemo-dcr: unknown command 'bogus' (commands: checkpoint, delta, demo, keygen, receive, relay, status; see nemo-dcr --help)"
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


def _leaf_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["steps=3", "--help"]])
def test_demo_help_lists_every_config_key_with_its_doc(capsys, argv):
    """``nemo-dcr demo --help`` (Hydra's override parser took it for a key: a lexer error) is a
    usage text, exit 0: every key the demo's configuration has (the composed config, not the
    help's own list), each with the demo's value and a doc line."""
    from nemo_dcr_testbed.config import load_demo_config

    assert cli.main(["demo", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: nemo-dcr demo [KEY=VALUE ...]"), (out[:200], err)
    lines = out.splitlines()
    listed = {}
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("   ") and " (" in line and ") = " in line:
            key = line.split(" (")[0].strip()
            doc = lines[i + 1] if i + 1 < len(lines) else ""
            listed[key] = (line, doc)
    keys = _leaf_keys(load_demo_config([]).to_dict())
    assert len(keys) > 40 and sorted(listed) == sorted(keys)
    assert all(doc.startswith("      ") and doc.strip() for _, doc in listed.values()), \
        [k for k, (_, doc) in listed.items() if not doc.startswith("      ")]
    # the demo's values (demo.yaml over the schema), docs from the schema (a refit key's from RefitOptions)
    assert listed["steps"][0] == "  steps (int) = 4" and "a refit follows every step" in listed["steps"][1]
    assert listed["model.num_layers"][0].endswith("= 4")  # demo.yaml's 4, not the schema's 2
    assert listed["refit.receivers"][0] == "  refit.receivers (tuple[str, ...]) = [r0]"
    assert listed["refit.verify_dense"][0].endswith("(bool) = true")
    assert "How chunks are coded" in listed["refit.coding"][1]
    assert listed["store.uri"][0].endswith("= ${run_dir}/store")
    # docs named by section, not by source files a wheel user does not have; no RST markup
    assert not re.findall(r"[\w/]+\.py\b", out), re.findall(r"[\w/]+\.py\b", out)
    assert "``" not in out


def test_demo_help_control_an_unknown_key_still_fails(capsys):
    """Control: without --help the same parser still refuses a key the help does not list."""
    assert cli.main(["demo", "steps=3", "model.famly=llama"]) == 2
    assert "model.famly" in _err_line(capsys)
