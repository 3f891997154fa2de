"""A receiver killed (SIGKILL) in the middle of writing a version restarts over its own
weights, repairs the half-written version from its journal, and continues: no checkpoint
reload, no replay from version 0.

Real parts: a transformers Llama receiver process (``nemo-dcr receive
--persistent-weights``) and the real sender/commit path in this process (one trainer
parameter mapped onto the receiver's ``down_proj`` of layer 0; no torch.distributed).
The kill is injected by ``killing_worker.py`` (test-only launcher).
"""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import torch
from safetensors.torch import load_file

from nemo_dcr.integrations.hf_export import write_checkpoint
from nemo_dcr.sender import RefitOptions, RefitSender
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.protocol.manifest import Decision, decision_key
from nemo_dcr.protocol.signing import new_key_file
from nemo_dcr.transport.store import LocalDirStore

from receiver_helpers import bits, llama

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "model.layers.0.mlp.down_proj.weight"
DIMS = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                 ffn_hidden_size=8, vocab_size=8)


def _step(w: torch.Tensor, rng, frac=0.05):
    b = w.view(torch.int16).reshape(-1)
    idx = torch.from_numpy(rng.choice(b.numel(), int(b.numel() * frac), replace=False))
    b[idx] ^= torch.from_numpy(rng.integers(1, 1 << 14, idx.numel()).astype(np.int16))


def _receiver(tmp_path, key, *, kill_at=None):
    args = ["--store", str(tmp_path / "store"), "--receiver-id", "r0", "--model-id", "m", "--key-file", key,
            "--state-dir", str(tmp_path / "state"), "--persistent-weights", "--until-version", "3",
            "--timeout-s", "60", "--dump-dir", str(tmp_path / "dump")]
    cmd = [sys.executable, os.path.join(HERE, "killing_worker.py")]
    cmd += ["--kill-at-apply", str(kill_at), "--", *args] if kill_at else ["--kill-at-apply", "0", "--", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _file_tensor(tmp_path, name: str) -> np.ndarray:
    meta = json.load(open(tmp_path / "state" / "weights" / "weights.json"))
    e = next(e for e in meta["layout"] if e["name"] == name)
    raw = np.fromfile(tmp_path / "state" / "weights" / "weights.bin", dtype=np.uint8)
    return raw[e["offset"]: e["offset"] + e["nbytes"]].view(np.uint16)


def test_sigkill_mid_apply_then_restart_repairs_in_place(tmp_path):
    key = new_key_file(str(tmp_path / "key"))
    model = llama(seed=3)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    w = state[NAME].clone()
    spec = ShardSpec(key="w", local_shape=tuple(w.shape), global_shape=tuple(w.shape), global_offset=(0, 0),
                     prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    store = LocalDirStore(str(tmp_path / "store"))
    sender = RefitSender({"w": w}, {"w": [ParamView("w", 0, spec)]},
                         CanonicalProjector((Rule("w", {"": NAME}),), DIMS), store,
                         RefitOptions(model_id="m", receivers=("r0",), key_file=key, ack_timeout_s=120,
                                      ack_poll_s=0.02))
    sender.set_root(write_checkpoint(store, model.config.to_dict(), state, sealer=sender.sealer,
                                     run_id=sender.claim()))
    rng = np.random.default_rng(0)

    first = _receiver(tmp_path, key, kill_at=2)  # dies while writing version 2
    _step(w, rng)
    assert sender.refit(1).committed
    v1 = bits(w)
    _step(w, rng)
    v2 = bits(w)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("s2", sender.refit(2)))
    t.start()
    log1, _ = first.communicate(timeout=120)
    assert first.returncode == -9 and "KILLING after" in log1, log1
    # the weights file really holds a half-written version: neither v1 nor v2
    half = _file_tensor(tmp_path, NAME)
    assert not np.array_equal(half, v1) and not np.array_equal(half, v2)
    assert (half != v1).sum() < (v2 != v1).sum()

    second = _receiver(tmp_path, key)  # restart over the same weights
    t.join(timeout=120)
    _step(w, rng)
    assert sender.refit(3).committed
    log2, _ = second.communicate(timeout=120)
    assert second.returncode == 0, log2
    events = [json.loads(line) for line in log2.splitlines() if line.startswith("{")]
    repaired = [e for e in events if e.get("event") == "repaired"]
    assert repaired and repaired[0]["version"] == 2 and repaired[0]["held"] == 1, events
    ready = next(e for e in events if e.get("ready"))
    assert ready["held"] == 1  # restarted at v1 from its own weights, not at v0
    assert not [e for e in events if e.get("event") == "caught up"]  # nothing replayed from v0
    committed2 = Decision.from_json(store.get(decision_key(2))).commit
    # integer-view check of every parameter at v3 against the trainer (and v0 elsewhere)
    got = load_file(str(tmp_path / "dump" / "v3.safetensors"))
    want = {k: v for k, v in state.items()}
    want[NAME] = w
    diff = [k for k in want if not torch.equal(got[k].view(torch.int16), want[k].view(torch.int16))]
    assert diff == [], (diff, committed2)
    # negative control: one flipped bit is caught by the same comparison
    flipped = got[NAME].clone()
    flipped.view(torch.int16).view(-1)[5] ^= 1
    assert not torch.equal(flipped.view(torch.int16), want[NAME].view(torch.int16))
