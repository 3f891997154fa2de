"""``nemo-dcr receive``: bad input is one line on stderr and exit status 2, found before a
run is waited for or a model loaded; every runtime in the registry is accepted."""
import os
import time

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
    """Good input, but no run appears in the store within the timeout: a failure, not bad input.
    (The store's directory exists: a receiver refuses a missing one as bad input,
    test_receiver_misconfig.py.)"""
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    (tmp_path / "store").mkdir()
    assert cli.main(["receive", *_base(tmp_path), "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nemo-dcr receive: ProtocolError: ") and "no run record" in err[-1], err
    assert not any("Traceback" in line for line in err)


# --- a run followed in this process: the `done` line, a full --state-dir -----------------------

NAME = "model.layers.0.mlp.down_proj.weight"


def _trainer(tmp_path):
    """The real sender in this process (no torch.distributed): one trainer parameter mapped
    onto the receiver's ``down_proj`` of layer 0 (as in test_persistent_restart.py)."""
    from receiver_helpers import llama, one_tensor_trainer

    sender, w, key, _ = one_tensor_trainer(tmp_path, llama(seed=5), ack_timeout_s=60)
    return sender, w, key


def _refits(sender, w, versions, out: dict):
    from receiver_helpers import flip_refits

    return flip_refits(sender, w, versions, out)


def _events(text: str) -> list[dict]:
    import json

    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_done_line_names_the_version_held_at_the_end(tmp_path, capsys, monkeypatch):
    """The last JSON line, ``done``, prints the committed version the receiver ended on (3),
    not the one it started on (0: the ``ready`` line's, which the done line repeated)."""
    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    sender, w, key = _trainer(tmp_path)
    out: dict = {}
    t = _refits(sender, w, (1, 2, 3), out)
    argv = [*_base(tmp_path), "--key-file", key, "--until-version", "3", "--timeout-s", "60"]
    t0 = time.time()
    assert receive_cli.main(argv) == 0
    t1 = time.time()
    t.join(60)
    assert [out[v].committed for v in (1, 2, 3)] == [True, True, True]
    events = _events(capsys.readouterr().out)
    ready = next(e for e in events if e.get("ready"))
    done = events[-1]
    assert done["done"] is True and done["held"] == 3, events
    assert ready["held"] == 0  # control: the held version the session started with differs
    # every line (the CLI's and the follower's) carries its wall-clock time, in print order
    stamps = [e["ts"] for e in events]
    assert len(events) > 4 and stamps == sorted(stamps) and t0 - 0.001 <= stamps[0] and stamps[-1] <= t1 + 0.001
    assert {"committed"} <= {e.get("event") for e in events}  # the follower's events are among them


def test_a_full_state_dir_is_one_line_exit_1_and_a_restart_repairs(tmp_path, capsys, monkeypatch):
    """ENOSPC on the state dir with --persistent-weights, while the receiver records the
    version it committed (``journal.write_committed``): one line on stderr, exit status 1
    (a run that failed), nothing half-written left behind, and a restart over the same
    weights repairs from the journal and ends on the committed version, bit-exact.

    A full disk cannot be made here (no tmpfs of our own): the fault is injected at the
    journal's one file-writing seam, ``journal.write_text`` (it writes half the text, then
    raises ``OSError(ENOSPC)`` as a full disk would), for ``committed.json`` only."""
    import errno

    import torch
    from safetensors.torch import load_file

    from nemo_dcr.receiver import journal

    monkeypatch.delenv("NEMO_DCR_KEY_FILE", raising=False)
    sender, w, key = _trainer(tmp_path)
    real = journal.write_text
    hits = []

    def full_disk(path: str, text: str) -> None:
        if os.path.basename(path).startswith("committed.json"):
            hits.append(path)
            real(path, text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, text)

    monkeypatch.setattr(journal, "write_text", full_disk)
    out: dict = {}
    t = _refits(sender, w, (1,), out)
    state = tmp_path / "state"
    argv = [*_base(tmp_path), "--key-file", key, "--until-version", "1", "--timeout-s", "60",
            "--persistent-weights", "--state-dir", str(state), "--dump-dir", str(tmp_path / "dump")]
    assert receive_cli.main(argv) == 1
    t.join(60)
    assert out[1].committed  # the receiver had acknowledged it: the trainer committed v1
    err = capsys.readouterr().err.strip().splitlines()  # also transformers' "Loading weights" progress
    ours = [x for x in err if x.startswith("nemo-dcr receive:")]
    assert len(ours) == 1 and err[-1] == ours[0] and not [x for x in err if "Traceback" in x], err
    line = ours[0]
    assert line.startswith(f"nemo-dcr receive: --state-dir {state} is full (OSError: [Errno 28] No space left on "
                           "device: "), line
    assert "repaired from the apply journal at the restart" in line, line
    assert hits and not os.path.exists(hits[0]) and not (state / "committed.json").exists()
    assert (state / "journal" / "journal.json").exists()  # v1's journal: what the restart repairs from

    monkeypatch.setattr(journal, "write_text", real)  # space freed: the same command again
    assert receive_cli.main(argv) == 0
    events = _events(capsys.readouterr().out)
    repaired = [e for e in events if e.get("event") == "repaired"]
    assert repaired and repaired[0]["version"] == 1 and repaired[0]["held"] == 0, events
    assert events[-1]["done"] and events[-1]["held"] == 1, events
    got = load_file(str(tmp_path / "dump" / "v1.safetensors"))[NAME]
    assert torch.equal(got.view(torch.int16), w.view(torch.int16))
    flipped = got.clone()
    flipped.view(torch.int16).view(-1)[3] ^= 1  # control: one flipped bit is seen
    assert not torch.equal(flipped.view(torch.int16), w.view(torch.int16))
    assert (state / "committed.json").exists()
