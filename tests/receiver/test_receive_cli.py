"""``nemo-dcr receive``: bad input is one line on stderr and exit status 2, found before a
run is waited for or a model loaded; every runtime in the registry is accepted."""
import pytest

from nemo_dcr import cli
from nemo_dcr.receiver import cli as receive_cli
from nemo_dcr.receiver.registry import runtime_names


def _base(tmp_path) -> list[str]:
    return ["--store", str(tmp_path / "store"), "--receiver-id", "r0", "--model-id", "m"]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("change,needle", [
    ({"--receiver-id": "a b"}, "invalid receiver id 'a b'"),
    ({"--store": "nosuchproto://bucket/x"}, "--store: StoreError: nosuchproto://bucket/x: "),
    ({"--runtime": "sglang"}, "argument --runtime: invalid choice: 'sglang' (choose from"),
    ({"--tensor-parallel-size": "2"}, "runtime 'hf' does not support tensor_parallel_size"),
    ({"--sample-tokens": "4"}, "runtime 'hf' does not support sample_tokens"),
    ({"--runtime": "vllm", "--persistent-weights": None, "--state-dir": "{tmp}/s"},
     "runtime 'vllm' does not support persistent"),
    ({"--persistent-weights": None}, "--persistent-weights needs a --state-dir"),
    ({"--poll-s": "0"}, "poll_s must be positive"),
    ({"--poll-s": "soon"}, "argument --poll-s: invalid float value: 'soon'"),
    ({"--fetch-threads": "-1"}, "fetch_threads must be >= 0"),
    ({"--tensor-parallel-size": "0", "--runtime": "vllm"}, "tensor_parallel_size must be >= 1"),
    ({"--key-file": "{tmp}/no-such-key"}, "signing key"),
    ({"--bogus": None}, "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, change, needle):
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    argv = _base(tmp_path)
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag] if value is None else [flag, value.format(tmp=tmp_path)]
    assert cli.main(["receive", *argv]) == 2
    line = _err_line(capsys)
    assert line.startswith("nemo-dcr receive: ") and needle in line, line


def test_good_input_passes_the_checks_for_every_runtime(tmp_path, monkeypatch):
    """Control for the test above: the same arguments, valid, pass ``check_input`` (which
    loads nothing) for each registered runtime, with its own options."""
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    assert runtime_names()[:2] == ("hf", "vllm")
    extra = {"hf": ["--persistent-weights", "--state-dir", str(tmp_path / "s")],
             "vllm": ["--tensor-parallel-size", "2", "--sample-tokens", "4", "--max-model-len", "64"]}
    for name in runtime_names():
        args = receive_cli.parser().parse_args(_base(tmp_path) + ["--runtime", name, "--poll-s", "0.2",
                                                                  "--fetch-threads", "3", *extra.get(name, [])])
        store, sealer, cfg, options = receive_cli.check_input(args)
        assert (cfg.poll_s, cfg.fetch_threads, cfg.threads) == (0.2, 3, 3)
        assert not sealer.signed
    assert options.tensor_parallel_size == 2 and options.sample_tokens == 4 and options.max_model_len == 64


def test_a_run_that_fails_is_exit_1(tmp_path, capsys, monkeypatch):
    """Good input, but no run appears in the store within the timeout: a failure, not bad input."""
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    assert cli.main(["receive", *_base(tmp_path), "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nemo-dcr receive: ProtocolError: ") and "no run record" in err[-1], err
    assert not any("Traceback" in line for line in err)
