"""``nemo-dcr demo``: end-to-end refit on the embedded default store.

Launches the trainer ranks with torchrun (Megatron-Core, gloo on CPU) and the receiver
processes (a transformers model or a vLLM engine each, ``receiver.runtime``), prints one table row per refit as it lands, and
ends with ONE JSON summary line on stdout.  Logs go to ``<run_dir>/*.log``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from nemo_dcr.testbed.config import DemoConfig, load_demo_config
from nemo_dcr.testbed.run_trainer import receiver_ids

STORE_MARKER = ".nemo-dcr-store"
COLUMNS = [
    ("step", 4), ("loss", 7), ("changed%", 8), ("wire_B", 9), ("dense_B", 10), ("ratio", 7),
    ("B/chg", 6), ("diff_ms", 7), ("proj_ms", 7), ("enc_ms", 7), ("up_ms", 6), ("rx_ms", 7),
    ("commit_ms", 9), ("bit_exact", 9),
]


def _err(msg: str) -> None:
    print(f"[nemo-dcr demo] {msg}", file=sys.stderr, flush=True)


def _prepare_store(cfg: DemoConfig) -> str | None:
    """Returns the local store root (None for a remote URI)."""
    uri = cfg.store.uri
    if "://" in uri and not uri.startswith("file://"):
        return None
    root = os.path.abspath(uri.removeprefix("file://"))
    if os.path.isdir(root) and os.listdir(root):
        if not os.path.exists(os.path.join(root, STORE_MARKER)):
            raise SystemExit(f"store {root} is a non-empty directory that is not a nemo_dcr demo store; "
                             f"refusing to touch it (choose another store.uri)")
        if not cfg.store.reset:
            raise SystemExit(f"store {root} holds a previous run and store.reset=false")
        shutil.rmtree(root)
    os.makedirs(root, exist_ok=True)
    open(os.path.join(root, STORE_MARKER), "w").close()
    return root


def _row(r: dict) -> dict[str, str]:
    acks = r.get("acks", [])
    rx_ms = max((sum(a["stats"].get(k, 0.0) for k in ("download_s", "decode_s", "apply_s")) for a in acks),
                default=0.0) * 1e3
    exact = [a["stats"].get("bit_exact") for a in acks]
    bit = "yes" if exact and all(e is True for e in exact) else ("n/a" if all(e is None for e in exact) else "NO")
    changed = r["changed"]
    return {
        "step": str(r["step"]), "loss": f"{r['loss']:.4f}",
        "changed%": f"{100 * changed / r['canonical_numel']:.3f}",
        "wire_B": str(r["wire_bytes"]), "dense_B": str(r["dense_bytes"]),
        "ratio": f"{r['dense_bytes'] / max(r['wire_bytes'], 1):.1f}x",
        "B/chg": f"{r['wire_bytes'] / max(changed, 1):.2f}",
        "diff_ms": f"{r['diff_s'] * 1e3:.1f}", "proj_ms": f"{r['project_s'] * 1e3:.1f}",
        "enc_ms": f"{r['encode_s'] * 1e3:.1f}", "up_ms": f"{r['upload_s'] * 1e3:.1f}",
        "rx_ms": f"{rx_ms:.1f}", "commit_ms": f"{r['commit_wait_s'] * 1e3:.1f}", "bit_exact": bit,
    }


def _print_row(cells: dict[str, str]) -> None:
    print(" ".join(cells[name].rjust(w) for name, w in COLUMNS), flush=True)


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run(cfg: DemoConfig) -> dict:
    os.makedirs(cfg.run_dir, exist_ok=True)
    local_root = _prepare_store(cfg)
    cfg_path = os.path.join(cfg.run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    steps_path = os.path.join(cfg.run_dir, "steps.jsonl")
    if os.path.exists(steps_path):
        os.unlink(steps_path)

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    world = cfg.parallel.world_size
    t_start = time.perf_counter()
    trainer_log = open(os.path.join(cfg.run_dir, "trainer.log"), "w")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
         "-m", "nemo_dcr.testbed.run_trainer", "--config", cfg_path],
        stdout=trainer_log, stderr=subprocess.STDOUT, env=env,
    )
    _err(f"trainer: {cfg.model.family}, {world} ranks (TP={cfg.parallel.tensor_model_parallel_size}, "
         f"PP={cfg.parallel.pipeline_model_parallel_size}, DP={cfg.parallel.data_parallel_size}, "
         f"EP={cfg.parallel.expert_model_parallel_size}), log {trainer_log.name}")

    from nemo_dcr.integrations.hf_export import WEIGHTS_KEY, download_checkpoint
    from nemo_dcr.transport.store import open_store

    store = open_store(cfg.store.uri)
    while not store.exists(WEIGHTS_KEY):
        if trainer.poll() is not None:
            raise RuntimeError(f"trainer exited ({trainer.returncode}) before writing the initial "
                               f"checkpoint:\n{_tail(trainer_log.name)}")
        time.sleep(0.2)
    init_dir = os.path.join(local_root, "init") if local_root else download_checkpoint(
        store, os.path.join(cfg.run_dir, "init"))
    _err(f"initial checkpoint written ({time.perf_counter() - t_start:.1f}s); starting "
         f"{cfg.refit.receivers} receiver(s)")

    receivers = []
    for rid in receiver_ids(cfg.refit.receivers):
        log = open(os.path.join(cfg.run_dir, f"receiver-{rid}.log"), "w")
        cmd = [sys.executable, "-m", "nemo_dcr.receiver.worker", "--store", cfg.store.uri,
               "--receiver-id", rid, "--model-id", cfg.model_id, "--until-version", str(cfg.steps),
               "--init-dir", init_dir, "--timeout-s", str(cfg.refit.ack_timeout_s)]
        if cfg.refit.verify_dense:
            cmd.append("--verify-dense")
        if cfg.refit.receiver_dump_dir:
            cmd += ["--dump-dir", os.path.join(cfg.refit.receiver_dump_dir, rid)]
        if cfg.receiver.runtime == "vllm":
            cmd += ["--runtime", "vllm", "--tensor-parallel-size", str(cfg.receiver.tensor_parallel_size),
                    "--max-model-len", str(cfg.model.seq_length), "--sample-tokens", str(cfg.receiver.sample_tokens)]
        receivers.append((rid, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))

    print(" ".join(name.rjust(w) for name, w in COLUMNS), flush=True)
    rows: list[dict] = []
    cells: list[dict[str, str]] = []
    seen = 0
    while True:
        done = trainer.poll() is not None
        if os.path.exists(steps_path):
            with open(steps_path) as f:
                lines = f.read().splitlines()
            for line in lines[seen:]:
                rows.append(json.loads(line))
                cells.append(_row(rows[-1]))
                _print_row(cells[-1])
                for a in rows[-1].get("acks", []):
                    if a["stats"].get("sample") is not None:
                        print(f"     {a['receiver']} greedy after v{rows[-1]['step']}: {a['stats']['sample']}",
                              flush=True)
            seen = len(lines)
        if done:
            break
        for rid, p, log in receivers:
            if p.poll() not in (None, 0):
                trainer.terminate()
                raise RuntimeError(f"receiver {rid} failed ({p.returncode}):\n{_tail(log.name)}")
        time.sleep(0.2)
    if trainer.returncode != 0:
        for _, p, _ in receivers:
            p.terminate()
        raise RuntimeError(f"trainer failed ({trainer.returncode}):\n{_tail(trainer_log.name)}")
    for rid, p, log in receivers:
        if p.wait(timeout=cfg.refit.ack_timeout_s) != 0:
            raise RuntimeError(f"receiver {rid} failed ({p.returncode}):\n{_tail(log.name)}")

    bit_exact = sum(1 for c in cells if c["bit_exact"] == "yes")
    wire = sum(r["wire_bytes"] for r in rows)
    dense = sum(r["dense_bytes"] for r in rows)
    changed = sum(r["changed"] for r in rows)
    return {
        "refits": len(rows),
        "committed": sum(1 for r in rows if r["committed"]),
        "bit_exact": bit_exact,
        "verified": cfg.refit.verify_dense,
        "wire_bytes": wire,
        "dense_bytes": dense,
        "compression": round(dense / max(wire, 1), 2),
        "bytes_per_changed": round(wire / max(changed, 1), 3),
        "changed_pct_mean": round(100 * changed / max(sum(r["canonical_numel"] for r in rows), 1), 4),
        "family": rows[0]["family"] if rows else cfg.model.family,
        "num_moe_experts": cfg.model.num_moe_experts,
        "tied_embeddings": cfg.model.share_embeddings_and_output_weights,
        "distributed_optimizer": cfg.train.use_distributed_optimizer,
        "tp": cfg.parallel.tensor_model_parallel_size,
        "pp": cfg.parallel.pipeline_model_parallel_size,
        "dp": cfg.parallel.data_parallel_size,
        "ep": cfg.parallel.expert_model_parallel_size,
        "receivers": cfg.refit.receivers,
        "runtime": cfg.receiver.runtime,
        "receiver_tp": cfg.receiver.tensor_parallel_size,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "store": cfg.store.uri,
    }


def main(argv: list[str]) -> int:
    try:
        cfg = load_demo_config(argv)
    except Exception as e:  # a config error is the user's: one line, no traceback
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (ValueError, TypeError, HydraException, OmegaConfBaseException)):
            raise
        msg = " ".join(str(e).split())
        _err(f"invalid configuration: {msg}")
        return 2
    summary = run(cfg)
    print(json.dumps(summary), flush=True)
    ok = summary["refits"] == cfg.steps and summary["committed"] == cfg.steps
    if cfg.refit.verify_dense:
        ok = ok and summary["bit_exact"] == cfg.steps
    return 0 if ok else 1
