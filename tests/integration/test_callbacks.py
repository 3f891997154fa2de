"""The NeMo / Lightning callback ``RefitCallback`` drives the refit, called by a real
megatron-core training loop (TP=2 under torchrun) the way Lightning calls it.  NeMo is not
installed in this environment: this is a protocol test (NeMo's framework test is
``tests/nemo/test_nemo_recipe.py``, in the NeMo virtualenv).  The Megatron-Bridge callback's
tests, through Bridge's own callback machinery, are ``test_bridge_callback.py``.

A receiver process (``nemo-dcr receive``, transformers) follows every step; each version
it holds must equal, on integer views, transformers' own load of the dense reference the
trainer gathered from full Megatron tensors.  Every version's metrics reach the stand-in
trainer's Lightning-style loggers once, from rank 0, at step = the version (the pipelined
refit's last version through ``on_train_end``).  Bad settings fail before training.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from nemo_dcr.integrations.settings import RefitSettings, RefitSetupError, load_refit_settings

from .test_refit_e2e import bit_differences

HERE = os.path.dirname(__file__)
STEPS = 3


def _dense_hf_state(store, dense_file, work):
    import shutil

    from transformers import AutoModelForCausalLM

    from nemo_dcr.receiver.verify import module_state

    work.mkdir()
    shutil.copy(os.path.join(store, "init", "config.json"), work / "config.json")
    shutil.copy(dense_file, work / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(work), dtype=torch.bfloat16, local_files_only=True)
    return {k: v.clone() for k, v in module_state(model).items()}


def _wait_for_version0(trainer, store) -> None:
    deadline = time.monotonic() + 300
    while not (store / "init" / "model.safetensors").exists():
        assert trainer.poll() is None, trainer.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _receiver_cmd(store, dump, until: int) -> list[str]:
    return [sys.executable, "-m", "nemo_dcr.receiver.cli", "--store", str(store), "--receiver-id", "r0",
            "--model-id", "cb", "--init-dir", str(store / "init"), "--until-version", str(until),
            "--timeout-s", "300", "--dump-dir", str(dump)]


def _logged_refit_metrics(dense) -> dict[int, dict]:
    """What the callback gave the stand-in Lightning loggers (``callback_worker.py``), by step;
    each version logged once, by rank 0 alone, at step = the version."""
    import json

    rows = [json.loads(line) for line in (dense / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["sink"] == "lightning"]
    assert {r["rank"] for r in rows} == {0}, rows
    by_step = {r["step"]: r["data"] for r in rows}
    assert len(by_step) == len(rows), rows  # no version logged twice
    for step, m in by_step.items():
        assert m["refit/version"] == m["refit/committed_version"] == step, m
        assert m["refit/committed"] == 1.0 and m["refit/receivers"] == 1.0, m
        assert m["refit/wire_bytes"] > 0 and m["refit/compression"] > 0 and 0 < m["refit/changed_pct"] <= 100, m
        assert m["refit/refit_seconds"] > 0 and m["refit/trainer_pause_seconds"] >= 0, m
        assert (m["refit/joined"], m["refit/evicted"]) == (0.0, 0.0), m
    return by_step


def test_callback_refit_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    store, dense, dump = tmp_path / "store", tmp_path / "dense", tmp_path / "dump"
    dense.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    trainer = _torchrun("nemo", "--store", store, "--dense", dense, "--iters", STEPS, env=env)
    _wait_for_version0(trainer, store)
    receiver = subprocess.run(_receiver_cmd(store, dump, STEPS), capture_output=True, text=True, env=env,
                              timeout=600)
    out, _ = trainer.communicate(timeout=600)
    assert receiver.returncode == 0, receiver.stdout[-3000:] + receiver.stderr[-3000:]
    assert trainer.returncode == 0, out[-4000:]
    previous = None
    for v in range(1, STEPS + 1):
        got = load_file(str(dump / f"v{v}.safetensors"))
        want = _dense_hf_state(str(store), dense / f"v{v}.safetensors", tmp_path / f"hf{v}")
        assert bit_differences(got, want) == [], f"version {v}"
        if previous is not None:
            assert bit_differences(got, previous)
        previous = got
    # every version's metrics reached the loggers, the last one through on_train_end
    assert sorted(_logged_refit_metrics(dense)) == list(range(1, STEPS + 1))


def _torchrun(*args, env):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             os.path.join(HERE, "callback_worker.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_nemo_callback_resumes_its_run_from_the_checkpoint_not_the_pointer_files(tmp_path):
    """A NeMo job trains 2 steps and checkpoints (the callback's ``state_dict`` rides along);
    a store writer then deletes ``HEAD.json`` and ``COMMITTED.json``; the job restarts from
    the checkpoint with the same overrides (no run id typed) and trains 2 more.  One receiver
    follows both incarnations: every version bit-exact, numbers continuing at 3."""
    from safetensors.torch import load_file

    store, dense, dump, ckpt = tmp_path / "store", tmp_path / "dense", tmp_path / "dump", tmp_path / "ckpt"
    dense.mkdir()
    ckpt.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = _torchrun("nemo_save", "--store", store, "--dense", dense, "--iters", 2, "--ckpt", ckpt, env=env)
    _wait_for_version0(first, store)
    receiver = subprocess.Popen(_receiver_cmd(store, dump, 4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-4000:]
    state = __import__("json").loads((ckpt / "callbacks.json").read_text())["RefitCallback"]
    assert (state["committed_version"], state["published_version"]) == (2, 2)
    (store / "HEAD.json").unlink()
    (store / "COMMITTED.json").unlink()
    second = _torchrun("nemo_resume", "--store", store, "--dense", dense, "--iters", 2, "--ckpt", ckpt, env=env)
    out2, _ = second.communicate(timeout=600)
    rx_out, _ = receiver.communicate(timeout=600)
    assert second.returncode == 0, out2[-4000:]
    assert receiver.returncode == 0, rx_out[-4000:]
    assert "nemo_dcr: version" not in out2  # no aborted version, nothing reused
    previous = None
    for v in range(1, 5):
        got = load_file(str(dump / f"v{v}.safetensors"))
        want = _dense_hf_state(str(store), dense / f"v{v}.safetensors", tmp_path / f"hf{v}")
        assert bit_differences(got, want) == [], f"version {v}"
        if previous is not None:
            assert bit_differences(got, previous)  # control: every version changed something
        previous = got
    assert sorted(_logged_refit_metrics(dense)) == [1, 2, 3, 4]  # both incarnations, each drained


def test_settings_from_hydra_overrides():
    s = load_refit_settings(["refit.store_uri=s3://bucket/run", "refit.receivers=[r0,r1]", "refit.coding=plain"])
    assert s.store_uri == "s3://bucket/run" and s.receivers == ("r0", "r1") and s.coding == "plain"
    assert s.refit_options().receivers == ("r0", "r1")


@pytest.mark.parametrize("overrides,needle", [
    (["refit.receivers=[]"], "refit.receivers is empty"),
    (["refit.chunk_bytes=abc"], "refit.chunk_bytes=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["refit.coding=maybe"], "refit.coding must be one of ('auto', 'context', 'plain', 'fast'"),
    (["refit.receivers=2.5"], "refit.receivers=2.5: Invalid value assigned: float is not a ListConfig"),
    (["refit.colour=red"], "unknown config key 'refit.colour' (RefitSettings has no field 'colour')"),
    (["+refit.colour=red"], "unknown config key 'refit.colour' (RefitSettings has no field 'colour')"),
    (["refit.ack_pol_s=1"], "unknown config key 'refit.ack_pol_s' (RefitSettings has no field 'ack_pol_s'; did you mean 'refit.ack_poll_s'?)"),
])
def test_bad_settings_fail_with_one_message(overrides, needle):
    with pytest.raises(RefitSetupError) as e:
        load_refit_settings(overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unreachable_store_and_unmappable_model_fail_at_attach(tmp_path, monkeypatch):
    import socket

    from nemo_dcr.integrations.attach import RefitAttachment

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad_store = RefitSettings(store_uri=str(blocker / "store"), model_id="m", receivers=("r0",))
    with pytest.raises(RefitSetupError, match="is not usable"):
        RefitAttachment(bad_store).attach(torch.nn.Linear(2, 2))
    # an s3:// store is checked before anything is written (transport/preflight): an endpoint
    # nobody listens on is named, with where it came from
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s3 = RefitSettings(store_uri="s3://dcr-attach/run", model_id="m", receivers=("r0",))
    with pytest.raises(RefitSetupError, match=rf"is not usable: StoreUnusable: .*cannot reach the S3 endpoint "
                                              rf"http://127.0.0.1:{port} \(from \$AWS_ENDPOINT_URL\)"):
        RefitAttachment(s3).attach(torch.nn.Linear(2, 2))
    ok_store = RefitSettings(store_uri=str(tmp_path / "store"), model_id="m", receivers=("r0",))
    with pytest.raises(RefitSetupError, match="cannot map this model: no megatron GPTModel inside Linear"):
        RefitAttachment(ok_store).attach(torch.nn.Linear(2, 2))
    assert not (tmp_path / "store" / "init" / "model.safetensors").exists()


class _StubRefit:
    """Stands in for ``RefitAttachment``: a pipelined refit (version v decided at step v + 1,
    the last one by ``finish``)."""

    attached = True

    def __init__(self):
        from nemo_dcr.integrations.attach import RefitMetrics

        self.make = lambda v: RefitMetrics(version=v, committed=True, committed_version=v, wire_bytes=10 * v,
                                           dense_bytes=1000, changed=5, numel=100, receivers=1, joined=0,
                                           evicted=0, refit_s=0.5, pause_s=0.25, canonical_numel=100)
        self.published = None

    def after_step(self, step):
        decided, self.published = self.published, step
        return None if decided is None else self.make(decided)

    def finish(self):
        decided, self.published = self.published, None
        return None if decided is None else self.make(decided)


class _Logger:  # Lightning's Logger surface the callback uses
    def __init__(self):
        self.rows, self.saves = [], 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, metrics))

    def save(self):
        self.saves += 1


@pytest.mark.parametrize("global_zero", [True, False])
def test_nemo_callback_logs_each_decided_version_once_at_its_step(global_zero):
    from types import SimpleNamespace

    from nemo_dcr.integrations.nemo import RefitCallback

    cb = RefitCallback(RefitSettings(store_uri="memory://x", model_id="m", receivers=("r0",)))
    cb.refit = _StubRefit()
    loggers = [_Logger(), _Logger()]
    for step in (1, 2, 3):
        trainer = SimpleNamespace(global_step=step, is_global_zero=global_zero, loggers=loggers)
        cb.on_train_batch_end(trainer, None, None, None, 0)
        assert (cb.last_metrics is None) if step == 1 else (cb.last_metrics.version == step - 1)
    cb.on_train_end(trainer, None)
    assert cb.last_metrics.version == 3
    for logger in loggers:
        if not global_zero:  # Lightning's loggers write on global rank 0 only
            assert (logger.rows, logger.saves) == ([], 0)
            continue
        assert [step for step, _ in logger.rows] == [1, 2, 3] and logger.saves == 3
        assert [m["refit/version"] for _, m in logger.rows] == [1.0, 2.0, 3.0]
        assert logger.rows[2][1]["refit/wire_bytes"] == 30.0 and logger.rows[2][1]["refit/compression"] == 1000 / 30
    cb.on_train_end(trainer, None)  # nothing in flight: nothing more logged
    assert sum(len(logger.rows) for logger in loggers) == (6 if global_zero else 0)
