"""The refit callback in a real NeMo 2 recipe: ``llm.llama3_8b.pretrain_recipe`` shrunk to a tiny
Llama 3 (``examples/nemo_llama3_refit.py``), trained by NeMo's own Lightning trainer and
``MegatronStrategy`` under torchrun at TP=2 x DP=2 (the recipe's distributed optimizer with
``overlap_param_gather``), in the NeMo virtualenv ``.venv-nemo`` (``make setup-nemo``).

A receiver in this (the main) environment, ``nemo-dcr receive`` with a transformers model
built from the ``config.json`` the hook derived from the NeMo model, applies every version;
each must equal, on integer views, transformers' own load of the dense reference gathered
from the NeMo model's full tensors (``nemo_worker.py``), with a one-bit negative control.
The HF model built from the exported weights gives NeMo's megatron logits (fp32).  Every
version's refit metrics are read back from the recipe's TensorBoard event files.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from integration.test_callbacks import _dense_hf_state
from integration.test_refit_e2e import bit_differences

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NEMO_TORCHRUN = os.path.join(ROOT, ".venv-nemo", "bin", "torchrun")
STEPS = 3
TP, DP = 2, 2
TOL = 2e-4  # as tests/integration/test_logits.py: fp32 reduction-order noise is ~1e-6

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nemo_run(tmp_path_factory):
    if not os.access(NEMO_TORCHRUN, os.X_OK):
        pytest.fail(f"{NEMO_TORCHRUN} is missing: the NeMo tests need the NeMo virtualenv; "
                    "run `make setup-nemo` (`make test` builds it)", pytrace=False)
    d = tmp_path_factory.mktemp("nemo")
    store, out, dump = d / "store", d / "oracle", d / "dump"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    trainer = subprocess.Popen(
        [NEMO_TORCHRUN, "--standalone", f"--nproc-per-node={TP * DP}", os.path.join(HERE, "nemo_worker.py"), str(out),
         "--tp", str(TP), "--dp", str(DP), "--steps", str(STEPS), "--log-dir", str(d / "logs"),
         f"refit.store_uri={store}", "refit.model_id=nemo-llama3", "refit.receivers=[r0]",
         "refit.ack_timeout_s=300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 400
    while not (store / "init" / "model.safetensors").exists():
        if trainer.poll() is not None:
            pytest.fail(f"NeMo trainer exited ({trainer.returncode}) before version 0:\n{trainer.stdout.read()[-6000:]}")
        if time.monotonic() > deadline:
            trainer.kill()
            pytest.fail(f"no version 0 after 400 s:\n{trainer.communicate()[0][-6000:]}")
        time.sleep(0.2)
    receiver = subprocess.run(
        [sys.executable, "-m", "nemo_dcr.cli", "receive", "--store", str(store), "--receiver-id", "r0",
         "--model-id", "nemo-llama3", "--init-dir", str(store / "init"), "--until-version", str(STEPS),
         "--timeout-s", "300", "--dump-dir", str(dump)],
        capture_output=True, text=True, env=env, timeout=600)
    try:
        log, _ = trainer.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        trainer.kill()
        log = trainer.communicate()[0]
    assert receiver.returncode == 0, receiver.stdout[-3000:] + receiver.stderr[-3000:]
    assert trainer.returncode == 0, log[-6000:]
    print(f"NeMo recipe TP={TP} x DP={DP}, {STEPS} steps + receiver: {time.monotonic() - t0:.0f} s")
    return d, store, out, dump, log


def test_recipe_ran_with_the_callback(nemo_run):
    _, _, out, _, log = nemo_run
    meta = json.loads((out / "meta.json").read_text())
    assert meta["versions"] == list(range(1, STEPS + 1)), meta
    # pipelined: each version decided one step later, the last one by on_train_end; all committed
    assert meta["decided"] == [[v, True] for v in range(1, STEPS + 1)], meta
    assert (meta["tp"], meta["dp"], meta["family"]) == (TP, DP, "llama"), meta
    # the recipe's distributed optimizer defers the param all-gather; the hook forced it
    assert meta["deferred_param_gathers"] == 1, meta
    assert "Trainer.fit` stopped: `max_steps=3` reached" in log


_READ_EVENTS = """
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = {}
for path in sys.argv[1:]:
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        out.setdefault(tag, []).extend([e.step, e.value] for e in acc.Scalars(tag))
print(json.dumps(out))
"""


def test_refit_metrics_are_in_the_recipes_tensorboard(nemo_run):
    """The recipe's own TensorBoard logger got every version's refit metrics at step = the
    version, once each, beside NeMo's training loss; read back with TensorBoard's own reader
    (``EventAccumulator``, in ``.venv-nemo``) from the event files the run wrote."""
    d, _, _, _, _ = nemo_run
    files = sorted(str(p) for p in (d / "logs").rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {d / 'logs'}"
    python = os.path.join(os.path.dirname(NEMO_TORCHRUN), "python")
    read = subprocess.run([python, "-c", _READ_EVENTS, *files], capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    scalars = json.loads(read.stdout)
    print("TensorBoard tags:", sorted(scalars))
    # NeMo's loss, in the same files: optimizer step k's at x = k - 1, so x = v holds the loss
    # computed on the weights of version v
    assert [int(step) for step, _ in scalars["reduced_train_loss"]] == list(range(STEPS))

    def by_step(tag):
        steps = [int(s) for s, _ in scalars[tag]]
        assert steps == list(range(1, STEPS + 1)), (tag, scalars[tag])  # every version once, none twice
        return [v for _, v in scalars[tag]]

    assert by_step("refit/version") == list(range(1, STEPS + 1))
    assert by_step("refit/committed") == [1.0] * STEPS
    assert by_step("refit/committed_version") == list(range(1, STEPS + 1))
    assert by_step("refit/receivers") == [1.0] * STEPS
    assert by_step("refit/joined") == by_step("refit/evicted") == [0.0] * STEPS
    assert all(v > 0 for v in by_step("refit/wire_bytes"))
    assert all(v > 0 for v in by_step("refit/compression"))
    assert all(0 < v <= 100 for v in by_step("refit/changed_pct"))
    assert all(v > 0 for v in by_step("refit/refit_seconds"))
    assert all(v >= 0 for v in by_step("refit/trainer_pause_seconds"))
    print("refit metrics in TensorBoard:", {t: scalars[t] for t in sorted(scalars) if t.startswith("refit/")})


def test_receiver_config_comes_from_the_nemo_model(nemo_run):
    from transformers import AutoConfig

    _, store, _, _, _ = nemo_run
    # as the receiver's transformers reads the config.json the hook wrote (in the NeMo env)
    cfg = AutoConfig.from_pretrained(str(store / "init"), local_files_only=True)
    assert cfg.architectures == ["LlamaForCausalLM"]
    # Llama3Config8B's RoPE base and norm epsilon; the tiny overrides; NullTokenizer(1000) -> 1001 ids
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert cfg.rms_norm_eps == 1e-5
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 128, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.vocab_size == 1001 and cfg.tie_word_embeddings is False


def test_every_version_is_bit_exact(nemo_run, tmp_path):
    from safetensors.torch import load_file

    _, store, out, dump, _ = nemo_run
    previous = None
    for v in range(1, STEPS + 1):
        got = load_file(str(dump / f"v{v}.safetensors"))
        want = _dense_hf_state(str(store), out / f"v{v}.safetensors", tmp_path / f"hf{v}")
        assert bit_differences(got, want) == [], f"version {v}"
        if previous is not None:
            assert bit_differences(got, previous), f"version {v} changed nothing"
        previous = got
    # negative control: one flipped bit must fail the same comparison
    name = "model.layers.1.self_attn.k_proj.weight"
    flipped = dict(got)
    bits = flipped[name].clone().view(torch.int16)
    bits.view(-1)[17] ^= 1
    flipped[name] = bits.view(torch.bfloat16)
    assert bit_differences(flipped, want) == [name]


def test_hf_logits_match_nemo(nemo_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _, store, out, _, _ = nemo_run
    ref = load_file(str(out / "logits.safetensors"))
    weights = load_file(str(out / "logits_weights.safetensors"))

    def hf_logits(state, name):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(store / "init" / "config.json", d / "config.json")
        save_file(state, str(d / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True).eval()
        with torch.no_grad():
            return model(ref["tokens"]).logits

    got = hf_logits(weights, "hf")
    assert got.shape == ref["logits"].shape == (2, 16, 1001)
    err = (got - ref["logits"]).abs().max().item()
    assert err < TOL
    # negative control: layer 0's gate and up projections swapped.  Llama3Config's init std
    # (0.01) keeps these logits small (|logit| < 0.5; the swap moves them by ~4e-3, the
    # residual above is ~1e-7), hence 10 x TOL here instead of test_logits.py's 100 x.
    swapped = dict(weights)
    swapped["model.layers.0.mlp.gate_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"]
    swapped["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.gate_proj.weight"]
    swapped_err = (hf_logits(swapped, "hf_swapped") - ref["logits"]).abs().max().item()
    print(f"HF vs NeMo logits: max |diff| {err:.2e}; with gate/up swapped {swapped_err:.2e}")
    assert swapped_err > 10 * TOL
