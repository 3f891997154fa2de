"""``RefitBridgeCallback`` under Megatron-Bridge 0.6.2's own callback machinery.

Bridge's ``megatron/bridge/training/callbacks.py`` comes from the released wheel (sha256
pinned, ``testbed/nemo_dcr_testbed/bridge_release.py``); ``import megatron.bridge`` itself cannot run
here (Transformer Engine).  Its ``normalize_callbacks`` / ``CallbackManager`` register the
callback, and ``testbed/bridge_loop.py`` fires the events in ``train.py``'s order:
``on_train_step_end`` BEFORE ``train_state.step += 1``, ``on_checkpoint_save`` after a save.

Fast tests pin the callback's contract with a recording stand-in for the refit; the two
torchrun tests train a real megatron-core model (2 ranks, gloo) with a receiver
(``nemo-dcr receive``, transformers) that must equal, on integer views, transformers' load
of the dense reference at every version:
* TP=2: iteration 3 skipped (not published; version 4's delta covers it), a checkpoint every
  2 iterations, the job SIGKILLed after the checkpoint of iteration 4 and restarted from it
  with the same settings (no run id typed; the pointer files deleted in between): versions
  1, 2, 4, 5, 6, the refit's metrics in TensorBoard / W&B at those steps;
* PP=2 x VPP=2 model chunks with ``every_n_steps=2``: versions 2 and 4.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from nemo_dcr.integrations.attach import RefitMetrics
from nemo_dcr.integrations.bridge import STATE_FILE, RefitBridgeCallback
from nemo_dcr.integrations.settings import RefitSettings, RefitSetupError
from nemo_dcr_testbed import bridge_loop, bridge_release

from .test_callbacks import _dense_hf_state
from .test_refit_e2e import bit_differences

HERE = os.path.dirname(__file__)
EVENTS = {"on_train_start", "on_train_step_end", "on_train_end", "on_checkpoint_save"}


@pytest.fixture(scope="module")
def bridge():
    """Megatron-Bridge 0.6.2's ``callbacks`` module (fetched into ``.cache/`` by ``make setup``)."""
    return bridge_release.load()


class RecordingRefit:
    """Stands in for ``RefitAttachment``: records the calls; every ``after_step`` publishes."""

    def __init__(self, settings: RefitSettings):
        self.settings = settings
        self.calls: list = []
        self.attached = False
        self.restored = False
        self.published = 0

    def load_state_dict(self, state: dict) -> None:
        self.calls.append(("load_state_dict", state))
        self.restored = True

    def attach(self, model) -> None:
        self.calls.append(("attach", model))
        self.attached = True

    def after_step(self, step: int) -> RefitMetrics:
        self.calls.append(("after_step", step))
        self.published = step
        return RefitMetrics(version=step, committed=True, committed_version=step, wire_bytes=100 + step,
                            dense_bytes=1000, changed=7, numel=100, receivers=1, joined=0, evicted=0,
                            refit_s=0.5, pause_s=0.75, canonical_numel=100)

    def finish(self) -> None:
        self.calls.append(("finish",))

    def state_dict(self) -> dict:
        return {"published": self.published}


class Sink:
    def __init__(self):
        self.rows = []

    def add_scalar(self, tag, value, step):
        self.rows.append(("tb", tag, value, step))

    def log(self, data, step=None):
        self.rows.append(("wandb", data, step))


def _callback(tmp_path, **settings) -> RefitBridgeCallback:
    s = RefitSettings(store_uri=str(tmp_path / "store"), model_id="m", receivers=("r0",), **settings)
    cb = RefitBridgeCallback(s)
    cb.refit = RecordingRefit(s)
    return cb


def _state(tmp_path, step=0, **ckpt) -> bridge_loop.GlobalState:
    state = bridge_loop.GlobalState(cfg=bridge_loop.Config(checkpoint=bridge_loop.CheckpointConfig(**ckpt)))
    state.train_state.step = step
    return state


def test_bridge_registers_exactly_the_events_it_handles(bridge, tmp_path):
    cb = _callback(tmp_path)
    added = bridge.CallbackManager()
    added.add(cb)
    for manager in (bridge.normalize_callbacks([cb]), added):  # pretrain(callbacks=[...]) / manager.add
        assert {e for e in bridge.VALID_EVENTS if bridge.should_fire(manager, e)} == EVENTS
        for e in EVENTS:
            assert manager.list_callbacks(e) == [getattr(cb, e)]
    # control: Bridge's own base class, overriding nothing, registers nothing
    base = bridge.normalize_callbacks([bridge.Callback()])
    assert not [e for e in bridge.VALID_EVENTS if bridge.should_fire(base, e)]
    assert not [m for m in sys.modules if m == "megatron.bridge" or m.startswith("megatron.bridge.")]


def test_a_cached_callbacks_py_that_is_not_the_releases_is_refused(bridge, tmp_path):
    with open(bridge.__file__, "rb") as f:
        (tmp_path / "callbacks.py").write_bytes(f.read().replace(b"on_train_step_end", b"on_train_step_END"))
    with pytest.raises(bridge_release.BridgeReleaseError, match="pinned"):
        bridge_release.load(str(tmp_path))
    assert bridge_release.load() is bridge  # control: the pinned file passes


def test_versions_are_bridge_iterations_and_a_skipped_one_publishes_nothing(bridge, tmp_path):
    cb = _callback(tmp_path)
    state = _state(tmp_path)
    state.tensorboard_logger = state.wandb_logger = sink = Sink()
    model = [object()]
    bridge_loop.train(bridge=bridge, callbacks=[cb], state=state, model=model, optimizer=None, train_iters=5,
                      step_fn=lambda i: bridge_loop.Iteration(loss_dict={}, grad_norm=1.0, skipped=i == 3))
    assert cb.refit.calls == [("attach", model)] + [("after_step", v) for v in (1, 2, 4, 5)] + [("finish",)]
    assert state.train_state.step == 5
    tb = [r for r in sink.rows if r[0] == "tb"]
    assert sorted({r[3] for r in tb}) == [1, 2, 4, 5]
    assert ("tb", "refit/wire_bytes", 104, 4) in tb and ("tb", "refit/trainer_pause_seconds", 0.75, 4) in tb
    wandb = [r for r in sink.rows if r[0] == "wandb"]
    assert [r[2] for r in wandb] == [1, 2, 4, 5]
    assert wandb[2][1] == {"refit/version": 4, "refit/committed": 1.0, "refit/committed_version": 4,
                           "refit/wire_bytes": 104, "refit/refit_seconds": 0.5, "refit/trainer_pause_seconds": 0.75,
                           "refit/compression": 1000 / 104, "refit/changed_pct": 7.0, "refit/receivers": 1,
                           "refit/joined": 0, "refit/evicted": 0}


def test_checkpoint_save_writes_the_state_of_the_saved_step(bridge, tmp_path):
    ckpt = tmp_path / "ckpt"
    cb = _callback(tmp_path)
    state = _state(tmp_path, save=str(ckpt), load=str(ckpt), save_interval=2)
    bridge_loop.train(bridge=bridge, callbacks=[cb], state=state, model=[object()], optimizer=None, train_iters=5,
                      step_fn=lambda i: bridge_loop.Iteration(loss_dict={}, grad_norm=None, skipped=i == 4),
                      save_fn=lambda directory, step: None)
    for step, published in ((2, 2), (4, 3)):  # iteration 4 was skipped: its weights are step 3's
        d = ckpt / f"iter_{step:07d}"
        assert json.loads((d / STATE_FILE).read_text()) == {"published": published}
        assert sorted(os.listdir(d)) == [STATE_FILE]  # no temporary file left
    assert not (ckpt / "iter_0000005").exists()


def test_an_async_save_finalized_later_gets_its_own_steps_state(bridge, tmp_path):
    ckpt = tmp_path / "ckpt"
    cb = _callback(tmp_path)
    state = _state(tmp_path, save=str(ckpt), async_save=True)
    ctx = lambda **kw: bridge.CallbackContext(state=state, model=[object()], **kw)  # noqa: E731
    cb.on_train_start(ctx())
    for _ in range(3):
        cb.on_train_step_end(ctx(skipped_iter=False))
        state.train_state.step += 1
        if state.train_state.step == 1:  # the save of iteration 1 starts; it finalizes two iterations later
            (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / bridge_loop.TRACKER).write_text("1")
    cb.on_checkpoint_save(ctx())
    assert json.loads((ckpt / "iter_0000001" / STATE_FILE).read_text()) == {"published": 1}
    # a synchronous save is the one of train_state.step
    (ckpt / "iter_0000003").mkdir()
    state.cfg.checkpoint.async_save = False
    cb.on_checkpoint_save(ctx())
    assert json.loads((ckpt / "iter_0000003" / STATE_FILE).read_text()) == {"published": 3}


def test_a_restarted_job_continues_the_run_its_checkpoint_carries(bridge, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004").mkdir(parents=True)
    saved = {"format": "nemo-dcr-refit-state/1", "run_id": "0" * 32, "committed_version": 4}
    (ckpt / "iter_0000004" / STATE_FILE).write_text(json.dumps(saved))
    cb = _callback(tmp_path)
    model = [object()]
    cb.on_train_start(bridge.CallbackContext(state=_state(tmp_path, 4, save=str(ckpt), load=str(ckpt)), model=model))
    assert cb.refit.calls == [("load_state_dict", saved), ("attach", model)]


@pytest.mark.parametrize("content,needle", [
    (None, "iter_0000004 has no refit state (nemo_dcr_refit.json: not saved with RefitBridgeCallback); to "
           "continue a refit run from it, give refit.resume_run_id and refit.resume_version"),
    (b"{not json", "is unreadable: refit state"),
])
def test_a_restart_from_a_checkpoint_without_refit_state_is_refused(bridge, tmp_path, content, needle):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004").mkdir(parents=True)
    if content is not None:
        (ckpt / "iter_0000004" / STATE_FILE).write_bytes(content)
    cb = _callback(tmp_path)
    with pytest.raises(RefitSetupError) as e:
        cb.on_train_start(bridge.CallbackContext(state=_state(tmp_path, 4, save=str(ckpt)), model=[object()]))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert cb.refit.calls == []


def test_settings_that_name_the_run_replace_a_missing_state_file(bridge, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004").mkdir(parents=True)
    cb = _callback(tmp_path, export_initial=False, resume_run_id="0" * 32, resume_version=4)
    cb.on_train_start(bridge.CallbackContext(state=_state(tmp_path, 4, save=str(ckpt)), model=[object()]))
    assert [c[0] for c in cb.refit.calls] == ["attach"]


def _torchrun(*args, env):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             os.path.join(HERE, "callback_worker.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _receiver(store, dump, until: int, env):
    return subprocess.Popen(
        [sys.executable, "-m", "nemo_dcr.receiver.cli", "--store", str(store), "--receiver-id", "r0",
         "--model-id", "cb", "--init-dir", str(store / "init"), "--until-version", str(until),
         "--timeout-s", "300", "--dump-dir", str(dump)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for_version0(store, trainer) -> None:
    deadline = time.monotonic() + 300
    while not (store / "init" / "model.safetensors").exists():
        assert trainer.poll() is None, trainer.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _check_versions(tmp_path, store, dense, dump, versions) -> None:
    from safetensors.torch import load_file

    assert sorted(int(f[1:-12]) for f in os.listdir(dump)) == versions  # v<n>.safetensors
    assert sorted(int(d) for d in os.listdir(store / "v")) == versions  # nothing else was published
    previous = None
    for v in versions:
        got = load_file(str(dump / f"v{v}.safetensors"))
        want = _dense_hf_state(str(store), dense / f"v{v}.safetensors", tmp_path / f"hf{v}")
        assert bit_differences(got, want) == [], f"version {v}"
        if previous is not None:
            assert bit_differences(got, previous), f"version {v} changed nothing"  # control
        previous = got


def _clean(out: str) -> None:
    assert "nemo_dcr: version" not in out  # no aborted version
    assert "is not published" not in out  # no version number met twice


def test_bridge_tp2_skipped_iteration_kill_and_restart_bit_exact(bridge, tmp_path):
    store, dense, dump, ckpt = tmp_path / "store", tmp_path / "dense", tmp_path / "dump", tmp_path / "ckpt"
    dense.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ("bridge", "--store", store, "--dense", dense, "--iters", 6, "--ckpt", ckpt, "--save-interval", 2,
            "--skip", 3)
    first = _torchrun(*args, "--kill-after-save", 4, env=env)
    _wait_for_version0(store, first)
    receiver = _receiver(store, dump, 6, env)
    out1, _ = first.communicate(timeout=600)
    assert first.returncode != 0 and "worker: killed after the checkpoint of iteration 4" in out1, out1[-4000:]
    for step, committed in ((2, 2), (4, 4)):
        saved = json.loads((ckpt / f"iter_{step:07d}" / STATE_FILE).read_text())
        assert (saved["committed_version"], saved["published_version"], saved["weights_version"]) == (committed,) * 3
    (store / "HEAD.json").unlink()
    (store / "COMMITTED.json").unlink()
    second = _torchrun(*args, env=env)  # the same command: Bridge restarts from the latest checkpoint
    out2, _ = second.communicate(timeout=600)
    rx_out, _ = receiver.communicate(timeout=600)
    assert second.returncode == 0, out2[-4000:]
    assert "worker: restarted from iteration 4" in out2
    assert receiver.returncode == 0, rx_out[-4000:]
    _clean(out1)
    _clean(out2)
    _check_versions(tmp_path, store, dense, dump, [1, 2, 4, 5, 6])
    rows = [json.loads(line) for line in (dense / "metrics.jsonl").read_text().splitlines()]
    tb = [r for r in rows if r["sink"] == "tensorboard"]
    # pipelined: a version's metrics are logged at the next iteration's event (or at train end);
    # version 4 was decided (its checkpoint's save waited for it) but the job was killed before
    # the event that would have logged it, so the metrics of 4 are lost, not its version
    for tag in ("refit/version", "refit/committed", "refit/committed_version", "refit/wire_bytes",
                "refit/refit_seconds", "refit/trainer_pause_seconds"):
        assert [r["step"] for r in tb if r["tag"] == tag] == [1, 2, 5, 6], tag
    for r in rows:
        if r["sink"] == "wandb":
            m = r["data"]
            assert m["refit/version"] == m["refit/committed_version"] == r["step"] and m["refit/committed"] == 1.0
            assert m["refit/wire_bytes"] > 0 and m["refit/refit_seconds"] > 0 and m["refit/trainer_pause_seconds"] > 0
    assert [r["step"] for r in rows if r["sink"] == "wandb"] == [1, 2, 5, 6]


def test_bridge_vpp_every_second_iteration_bit_exact(bridge, tmp_path):
    store, dense, dump = tmp_path / "store", tmp_path / "dense", tmp_path / "dump"
    dense.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    trainer = _torchrun("bridge_vpp", "--store", store, "--dense", dense, "--iters", 4, "--every-n", 2, env=env)
    _wait_for_version0(store, trainer)
    receiver = _receiver(store, dump, 4, env)
    out, _ = trainer.communicate(timeout=600)
    rx_out, _ = receiver.communicate(timeout=600)
    assert trainer.returncode == 0, out[-4000:]
    assert receiver.returncode == 0, rx_out[-4000:]
    _clean(out)
    _check_versions(tmp_path, store, dense, dump, [2, 4])


@pytest.mark.parametrize("settle", [True, False], ids=["exit-settle", "control-no-exit-settle"])
def test_bridge_exit_condition_sys_exit_before_on_train_end_leaves_the_last_version_decided(bridge, tmp_path,
                                                                                           settle):
    """Bridge 0.6.2's ``train.py`` on an exit condition (``exit_duration_in_mins``,
    ``exit_interval``, a signal): break, then ``sys.exit()`` before ``on_train_end``, with the
    pipelined refit's last version (3) in flight.  The refit settles it at interpreter exit:
    the receiver ends on version 3, committed and bit-exact, and the trainer exits within the
    exit settle's bound (a bounded wait).  Control, the exit settle switched off (the
    behaviour before it): the job exits at once and version 3 has no decision record, so a
    receiver waiting on it would wait until its own timeout (this one stops at version 2)."""
    from nemo_dcr.sender import exit_settle_bound_s
    from nemo_dcr.protocol.manifest import Decision, decision_key
    from nemo_dcr.transport.store import LocalDirStore

    store, dense, dump = tmp_path / "store", tmp_path / "dense", tmp_path / "dump"
    dense.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(HERE, "bridge_exit_worker.py"), "--store", str(store), "--dense", str(dense),
           "--iters", "5", "--exit-after", "3", *([] if settle else ["--no-exit-settle"])]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _wait_for_version0(store, trainer)
    receiver = _receiver(store, dump, 3 if settle else 2, env)
    out, _ = trainer.communicate(timeout=300 + exit_settle_bound_s(300))  # start-up + the exit settle's bound
    rx_out, _ = receiver.communicate(timeout=600)
    # the control's job may even fail: a rank's background refit still inside a gloo collective
    # when the interpreter ends is killed by std::terminate (seen: rank 1 SIGABRT)
    assert trainer.returncode == 0 or not settle, out[-4000:]
    assert "worker: exit condition after iteration 3; version 3 in flight (decided: 2)" in out, out[-4000:]
    assert "on_train_end fired" not in out  # Bridge's order: sys.exit first
    assert receiver.returncode == 0, rx_out[-4000:]
    _clean(out)
    decisions = LocalDirStore(str(store))
    assert Decision.from_json(decisions.get(decision_key(2))).commit
    if settle:
        _check_versions(tmp_path, store, dense, dump, [1, 2, 3])
        assert Decision.from_json(decisions.get(decision_key(3))).commit
        assert "nemo_dcr: at interpreter exit, after" in out and "version 3 committed" in out, out[-4000:]
        done = [json.loads(line) for line in rx_out.splitlines() if line.startswith("{") and '"done"' in line]
        assert done and done[-1]["held"] == 3, rx_out[-4000:]
    else:
        assert not decisions.exists(decision_key(3)), out[-4000:]
        assert sorted(os.listdir(dump)) == ["v1.safetensors", "v2.safetensors"]
