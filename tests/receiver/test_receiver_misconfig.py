"""A misconfigured receiver fails loudly (issue 35, scope 2): ``nemo-dcr receive`` run as a
process (``python -m nemo_dcr.receiver.cli``) against a real store on disk whose signed run
documents this project's own trainer code wrote (``RefitSender`` in this process, version 0
a real HF checkpoint).  Each case checks the exit status, that stderr has one line of the
receiver's (no traceback) naming the fix, and -- for bad input (exit 2) -- that nothing was
written to the store (every file's name, size and mtime unchanged; a missing store not
created).

What each misconfiguration did before: a wrong ``--model-id`` refused every version and
never exited (on a finished store: exit 0 after ``ok: false``); a mistyped ``--store`` was
created and waited on forever; ``--runtime vllm`` without vllm was a 9-frame traceback."""
import os
import subprocess
import sys
import threading

import pytest

NAME = "model.layers.0.mlp.down_proj.weight"
PROG = "nemo-dcr receive: "


def _trainer(tmp_path, *, target: str = NAME, max_failures: int = 3, ack_timeout_s: float = 120):
    """The real sender in this process over a fresh directory store: one trainer parameter
    mapped onto ``target`` (``NAME``: a tensor the receiver's model has), version 0 the HF
    checkpoint of a small llama (``receiver_helpers.one_tensor_trainer``)."""
    from receiver_helpers import llama, one_tensor_trainer

    return one_tensor_trainer(tmp_path, llama(seed=5), target=target, ack_timeout_s=ack_timeout_s,
                              max_consecutive_failures=max_failures)


def _refits(sender, w, versions, out: dict):
    from receiver_helpers import flip_refits

    return flip_refits(sender, w, versions, out)


def _finished(tmp_path, versions=(1, 2)):
    """A store whose versions were all committed by an in-process receiver (``Receiver`` +
    ``Follower`` over numpy arrays: the stand-in runtime of the protocol tests), the trainer
    done."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "protocol"))
    from protocol_helpers import ArrayRuntime

    from nemo_dcr.protocol.follower import Follower
    from nemo_dcr.protocol.history import init_digest
    from nemo_dcr.protocol.signing import Sealer, load_key
    from nemo_dcr.receiver.engine import Receiver, ReceiverConfig

    sender, w, key, store = _trainer(tmp_path, ack_timeout_s=30)
    sealer = Sealer(load_key(key))
    rx = Receiver(ArrayRuntime({NAME: w.clone()}), store, ReceiverConfig(receiver_id="r0", model_id="m", poll_s=0.01))
    events: list = []
    follower = Follower(rx, store, sealer, sender.run_id, receiver_id="r0", log=events.append,
                        committed_digest=init_digest(store, sealer, sender.run_id))
    follow = threading.Thread(target=follower.run, kwargs={"until_version": versions[-1], "timeout_s": 30,
                                                            "poll_s": 0.01}, daemon=True)
    follow.start()
    out: dict = {}
    _refits(sender, w, versions, out).join(60)
    follow.join(60)
    assert [out[v].committed for v in versions] == [True] * len(versions), (out, events)
    return sender, key, store


def _files(root) -> list:
    found = []
    for d, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(d, n))
            found.append((os.path.relpath(os.path.join(d, n), root), st.st_size, st.st_mtime_ns))
    return sorted(found)


def _receive(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    env.pop("NEMO_DCR_KEY_FILE", None)
    return subprocess.run([sys.executable, "-m", "nemo_dcr.receiver.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _our_line(proc) -> str:
    """The receiver's one error line: exactly one ``nemo-dcr receive:`` line, no traceback."""
    err = proc.stderr.strip().splitlines()
    ours = [x for x in err if x.startswith(PROG)]
    assert len(ours) == 1 and not [x for x in err if "Traceback" in x], proc.stderr[-3000:]
    return ours[0]


def _bad_input(proc, store_root, before, *needles) -> str:
    """Exit 2, one line holding every needle, nothing written to the store."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    line = _our_line(proc)
    assert all(n in line for n in needles), line
    assert _files(store_root) == before  # nothing written (no ack, no join request, no temporary file)
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished store for the start-up refusals (they read only RUN.json)."""
    tmp = tmp_path_factory.mktemp("finished")
    sender, key, store = _finished(tmp)
    return sender.run_id, key, store.root


def test_wrong_model_id_is_refused_at_start_exit_2(finished):
    run_id, key, root = finished
    before = _files(root)
    proc = _receive("--store", root, "--receiver-id", "r9", "--model-id", "other", "--key-file", key,
                    "--until-version", 2, "--timeout-s", 30)
    _bad_input(proc, root, before, f"the run at {root} serves model 'm'", "--model-id 'other'", "pass --model-id m")
    # control: the same receiver with the run's model id gets past the check and catches up
    ok = _receive("--store", root, "--receiver-id", "r9", "--model-id", "m", "--key-file", key,
                  "--until-version", 2, "--timeout-s", 60, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert '"caught up"' in ok.stdout and '"held": 2' in ok.stdout.strip().splitlines()[-1], ok.stdout[-2000:]


def test_wrong_run_id_is_refused_at_start_exit_2(finished):
    run_id, key, root = finished
    other = "0" * 32 if run_id != "0" * 32 else "1" * 32
    before = _files(root)
    proc = _receive("--store", root, "--receiver-id", "r9", "--model-id", "m", "--key-file", key,
                    "--run-id", other, "--timeout-s", 30)
    _bad_input(proc, root, before, f"holds run {run_id}", f"--run-id {other}", f"pass --run-id {run_id}")


def test_wrong_key_or_none_is_refused_at_start_exit_2(finished, tmp_path):
    from nemo_dcr.protocol.signing import new_key_file

    run_id, key, root = finished
    before = _files(root)
    wrong = new_key_file(str(tmp_path / "wrong"))
    proc = _receive("--store", root, "--receiver-id", "r9", "--model-id", "m", "--key-file", wrong, "--timeout-s", 30)
    _bad_input(proc, root, before, "is not signed with this key", "check the key file")
    proc = _receive("--store", root, "--receiver-id", "r9", "--model-id", "m", "--timeout-s", 30)
    _bad_input(proc, root, before, "is signed, and no key was given", "--key-file")


def test_a_store_that_does_not_exist_is_refused_not_created(tmp_path):
    typo = tmp_path / "stroe"
    proc = _receive("--store", typo, "--receiver-id", "r0", "--model-id", "m", "--timeout-s", 30)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _our_line(proc)
    assert f"no such directory ({typo})" in line and "never creates its store" in line, line
    assert not typo.exists() and os.listdir(tmp_path) == []
    (tmp_path / "afile").write_text("x")
    proc = _receive("--store", tmp_path / "afile", "--receiver-id", "r0", "--model-id", "m", "--timeout-s", 30)
    assert proc.returncode == 2 and "is not a directory" in _our_line(proc), proc.stderr[-3000:]


def test_an_empty_store_directory_is_waited_on(tmp_path):
    """Control for the test above: a directory that exists but holds no run yet (a receiver
    started before its trainer) is waited on, not refused: here until ``--timeout-s``, a
    failed run (exit 1), with nothing written."""
    (tmp_path / "store").mkdir()
    proc = _receive("--store", tmp_path / "store", "--receiver-id", "r0", "--model-id", "m", "--timeout-s", 1)
    assert proc.returncode == 1 and "no run record (RUN.json) within 1.0s" in _our_line(proc), proc.stderr[-3000:]
    assert os.listdir(tmp_path / "store") == []


def test_a_runtime_whose_engine_is_missing_names_the_extra(tmp_path):
    """``--runtime vllm`` where vllm cannot be imported (hidden from this interpreter by a
    ``sitecustomize`` that puts None in ``sys.modules['vllm']``, as for a package that is not
    installed): exit 2 before the store is read, one line naming the extra."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    (tmp_path / "store").mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = _receive("--store", tmp_path / "store", "--receiver-id", "r0", "--model-id", "m", "--runtime", "vllm",
                    "--timeout-s", 1, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _our_line(proc)
    assert "runtime 'vllm' needs the vllm package, which is not installed: pip install 'nemo-dcr[vllm]'" in line, line
    assert os.listdir(tmp_path / "store") == []
    # control: the same interpreter set-up with the hf runtime passes the check (and then
    # waits for a run: exit 1 at the timeout)
    proc = _receive("--store", tmp_path / "store", "--receiver-id", "r0", "--model-id", "m", "--timeout-s", 1, env=env)
    assert proc.returncode == 1 and "no run record" in _our_line(proc), proc.stderr[-3000:]


def test_repeated_misfit_refusals_end_the_receiver_and_the_trainer_says_who(tmp_path):
    """A live run whose trainer maps its parameter onto a tensor the receiver's model does not
    have (a trainer and receiver made for different models; the start check cannot see it:
    the model ids agree): the receiver refuses v1, v2, v3 -- each refusal naming the fix --
    and ends after the third (``--max-refusals`` 3, the default), exit 1, one line; the
    trainer (``max_consecutive_failures=3``) stops with ``ReceiverRefused``, one line naming
    the receiver and its reason.  Then, on the finished store, a receiver that could apply
    nothing exits 1, not 0."""
    import json

    from nemo_dcr.sender import ReceiverRefused

    missing = "model.layers.7.mlp.down_proj.weight"
    sender, w, key, store = _trainer(tmp_path, target=missing)
    out: dict = {}
    t = _refits(sender, w, (1, 2, 3, 4), out)
    proc = _receive("--store", store.root, "--receiver-id", "r0", "--model-id", "m", "--key-file", key,
                    "--until-version", 4, "--timeout-s", 120, timeout=400)
    t.join(200)
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    line = _our_line(proc)
    assert "RefusedTooOften: receiver r0 refused 3 versions in a row for the same reason (v1, v2, v3; " \
           "max_refusals=3)" in line, line
    assert f"{missing!r}: name is not one of the" in line and "start it from the run's own checkpoint" in line, line
    refusals = [e for e in map(json.loads, filter(None, proc.stdout.splitlines())) if e.get("ok") is False]
    assert [e["version"] for e in refusals] == [1, 2, 3], proc.stdout[-3000:]
    assert all("start it from the run's own checkpoint" in e["error"] for e in refusals)
    err = out.get("error")
    assert isinstance(err, ReceiverRefused), out
    msg = str(err)
    assert "\n" not in msg and msg.startswith("refit stopped: version 3 not committed (3 in a row, on_refusal=retry): "
                                              "receiver r0: chunk "), msg
    assert "name is not one of the" in msg, msg

    # the finished store: a receiver answers v3 (the trainer's latest), refuses it, sees the
    # abort and reaches --until-version -- having applied nothing: exit 1, not 0
    proc = _receive("--store", store.root, "--receiver-id", "r1", "--model-id", "m", "--key-file", key,
                    "--until-version", 3, "--timeout-s", 60, timeout=400)
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    line = _our_line(proc)
    assert "receiver r1 applied none of the versions it answered (1 refused; the last, v3: " in line, line
