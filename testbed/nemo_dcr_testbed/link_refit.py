"""Processes of the rate-limited-link benchmark (``scripts/bench_refit_link.py``): test bed only.

Two refits of every step, through the same store, the same link and the same receiver
process, one after the other:

* **nemo_dcr**: the product's ``MegatronRefitHook`` after the optimizer step (diff, project,
  encode, upload; manifest; the receiver's download, decode, in-place apply, ack; the
  trainer's commit decision).  Wall = end of the optimizer step -> joint commit recorded.
  The receiver process polls the store the whole time (``Follower.step`` every poll
  interval while idle), so with streaming receive (the default; ``--no-stream`` turns it
  off) it downloads and decodes each chunk as it lands, during the trainer's upload, and
  after the manifest only checks digests and fetches what it has not got.
* **dense**: what a user does without nemo_dcr.  The trainer gathers the canonical
  (Hugging Face) state (``hook.dense_state()``, the same gather that writes version 0),
  serialises it as one safetensors file and puts it on the store (``v/<v>/dense.safetensors``,
  the key verification mode uses); the receiver downloads it and loads every tensor into a
  second transformers model of the same class through the same loader
  (``receiver.verify.load_dense``: ``HFTransformersAdapter.load_weights``), then acknowledges.
  Wall = start of the gather -> the trainer has read every receiver's acknowledgement (the
  same end point as the joint commit's ack collection).

After its dense ack the receiver compares its delta-refit model with the densely loaded one
bit for bit (integer views, every parameter and buffer: ``compare_modules``, the check
``nemo-dcr demo``'s ``refit.verify_dense`` runs) and reports it; on its first dense refit it
also flips one bit of the dense model and checks the comparison sees it (negative control).
The comparison is outside both timed windows.

Driver protocol (files in ``--dir``, same machine): the driver shapes the link for step
``s``, then writes ``go/<s>.json`` (``{"lr": float, "dense": bool, "link_mbit": float}``);
every rank waits for it, sets the learning rate (and ``refit.coding``, if the plan has a
``"coding"``), trains one step and runs the nemo_dcr refit, then the dense one if the plan
says ``"dense"``, else (``"verify"``) the bit-exact check alone: the gathered state goes to a
local file (``local_state_path``) the receiver compares against, off the link; rank
0 appends one JSON row to ``steps.jsonl``.  Before ``go/<s>.json`` the driver writes
``rxplan/<s>.json`` (``{"stream": bool}``) and waits for the receiver's ``rxplan/<s>.ok``:
the receiver sets streaming receive for version ``s`` while idle, before any of its chunks
exist.  The receiver writes ``ready`` once it holds version 0 and stops when ``stop`` appears.

    torchrun --nproc-per-node 2 -m nemo_dcr_testbed.link_refit trainer --config C --dir D
    python -m nemo_dcr_testbed.link_refit receiver --store URI --receiver-id r0 --model-id M --dir D

Timestamps crossing processes are ``time.monotonic()`` (one CLOCK_MONOTONIC per machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict

DENSE_ACK_PREFIX = "bench/dense-acks"
VERIFY_PREFIX = "bench/dense-verify"


def dense_ack_key(receiver: str, version: int) -> str:
    return f"{DENSE_ACK_PREFIX}/{receiver}/{version:08d}.json"


def verify_key(receiver: str, version: int) -> str:
    return f"{VERIFY_PREFIX}/{receiver}/{version:08d}.json"


def _driver_gone(pid: int) -> bool:
    """True once the driver process ``pid`` (0: none given) no longer exists: a driver that
    was killed outright (SIGKILL) cannot stop its children, so they stop themselves."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _wait_json(path: str, driver_pid: int, poll_s: float = 0.01) -> dict | None:
    """The JSON the driver renames into place at ``path``; None if the driver died first."""
    while True:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            if _driver_gone(driver_pid):
                return None
            time.sleep(poll_s)


def _await_objects(store, keys: list[str], timeout_s: float, what: str, poll_s: float) -> dict[str, dict]:
    """Read each key once it exists; returns key -> JSON, timing nothing."""
    from nemo_dcr.transport.store import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    got: dict[str, dict] = {}
    while len(got) < len(keys):
        for k in keys:
            if k not in got:
                try:
                    got[k] = json.loads(store.get(k))
                except ObjectNotFound:
                    pass
        if len(got) < len(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {sorted(set(keys) - set(got))} not written within {timeout_s:g}s")
            time.sleep(poll_s)
    return got


# ----------------------------------------------------------------------------- trainer
def local_state_path(local_dir: str, version: int) -> str:
    return os.path.join(local_dir, f"{version:08d}.safetensors")


def _dense_refit(hook, version: int, receivers: tuple[str, ...], timeout_s: float,
                 local_dir: str | None = None) -> dict | None:
    """Collective: the dense refit of ``version`` (see the module docstring); rank 0 returns
    its timings and the receivers' reports, other ranks None.  ``local_dir``: the check
    only, off the link: the state goes to a local file (``local_state_path``) that the
    receiver on this machine loads and compares, not through the store (its times are not
    a dense refit's and are not reported as one)."""
    import torch.distributed as dist
    from safetensors.torch import save as save_safetensors

    from nemo_dcr.protocol.manifest import dense_key

    t0 = time.monotonic()
    state = hook.dense_state()  # every rank's main-replica shards -> canonical tensors on rank 0
    if dist.get_rank() != 0:
        return None
    t1 = time.monotonic()
    blob = save_safetensors({k: v.contiguous() for k, v in sorted(state.items())})  # as hf_export writes init/
    del state
    t2 = time.monotonic()
    if local_dir is not None:
        tmp = local_state_path(local_dir, version) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, local_state_path(local_dir, version))
    else:
        hook.store.put(dense_key(version), blob)
    t3 = time.monotonic()
    poll_s = hook.sender.cfg.ack_poll_s  # as the joint commit polls for its acks
    acks = _await_objects(hook.store, [dense_ack_key(r, version) for r in receivers], timeout_s,
                          f"dense refit v{version}: receiver acks", poll_s)
    t4 = time.monotonic()
    # outside the timed window: the receivers' bit-exact comparison of both refits
    verify = _await_objects(hook.store, [verify_key(r, version) for r in receivers], timeout_s,
                            f"dense refit v{version}: receiver comparisons", poll_s)
    if local_dir is not None:
        os.unlink(local_state_path(local_dir, version))
        return {"local": True, "verify": [{"receiver": r, **verify[verify_key(r, version)]} for r in receivers]}
    hook.store.delete(dense_key(version))  # keep the store's memory flat over the run
    return {
        "bytes": len(blob), "t_start": t0, "t_acked": t4, "wall_s": t4 - t0,
        "gather_s": t1 - t0, "serialize_s": t2 - t1, "put_s": t3 - t2, "ack_wait_s": t4 - t3,
        "acks": [{"receiver": r, **acks[dense_ack_key(r, version)]} for r in receivers],
        "verify": [{"receiver": r, **verify[verify_key(r, version)]} for r in receivers],
    }


def trainer_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.link_refit trainer")
    ap.add_argument("--config", required=True, help="resolved DemoConfig as JSON")
    ap.add_argument("--dir", required=True, help="driver directory (go/<step>.json in, steps.jsonl out)")
    ap.add_argument("--driver-pid", type=int, default=0, help="stop when this process is gone")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from nemo_dcr_testbed.config import DemoConfig
    from nemo_dcr_testbed.run_trainer import build_trainer

    with open(args.config) as f:
        cfg = DemoConfig.from_dict(json.load(f))
    if cfg.refit.verify_dense:
        raise SystemExit("link_refit trainer: refit.verify_dense must be false (the dense refit here "
                         "is the verification; the hook's would put a second dense copy in the timed window)")
    trainer, hook = build_trainer(cfg)
    marks: dict[str, float] = {}
    # post-step hooks run in order right after optimizer.step() wrote the BF16 params
    trainer.add_post_step_hook(lambda tr, step: marks.__setitem__("step_end", time.monotonic()))
    trainer.add_post_step_hook(hook)
    trainer.add_post_step_hook(lambda tr, step: marks.__setitem__("committed", time.monotonic()))
    receivers = cfg.refit.receivers
    rank = dist.get_rank()
    for step in range(1, cfg.steps + 1):
        plan = _wait_json(os.path.join(args.dir, "go", f"{step}.json"), args.driver_pid)
        if plan is None:
            print(f"link_refit trainer: driver {args.driver_pid} is gone; stopping", file=sys.stderr, flush=True)
            return 1
        for group in trainer.optimizer.param_groups:  # constant lr per step (no scheduler)
            group["lr"] = float(plan["lr"])
        if plan.get("coding"):  # refit.coding for this step's version (nothing is in flight: synchronous)
            hook.sender.set_coding(plan["coding"])
        result = trainer.train_step()
        stats = hook.last_stats
        dcr = {"wall_s": marks["committed"] - marks["step_end"], "t_start": marks["step_end"],
               "t_committed": marks["committed"]}
        if plan["dense"]:
            dense = _dense_refit(hook, step, receivers, cfg.refit.ack_timeout_s)
        elif plan.get("verify", True):  # the bit-exact check alone, off the link
            dense = _dense_refit(hook, step, receivers, cfg.refit.ack_timeout_s, local_dir=args.dir)
        else:
            dense = None
        if rank == 0:
            row = {"step": step, "plan": plan, "loss": result.loss, "canonical_numel": hook.sender.canonical_numel,
                   "family": hook.family.name, "dcr": dcr, "stats": asdict(stats), "dense": dense}
            with open(os.path.join(args.dir, "steps.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    trainer.close()
    return 0


# ---------------------------------------------------------------------------- receiver
def _negative_control(module, reference) -> bool:
    """Flip one bit of the dense model; True if the comparison then reports a difference
    (the bit is flipped back before returning)."""
    from nemo_dcr.dtypes import int_view
    from nemo_dcr.receiver.verify import compare_modules

    name, p = next(iter(reference.named_parameters()))
    bits = int_view(p.data.view(-1))
    bits[0] ^= 1
    try:
        seen = not compare_modules(module, reference).equal
    finally:
        bits[0] ^= 1
    return seen


def receiver_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nemo_dcr_testbed.link_refit receiver")
    ap.add_argument("--store", required=True)
    ap.add_argument("--receiver-id", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--dir", required=True, help="this receiver's directory (init/ download, ready, stop)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--driver-pid", type=int, default=0, help="stop when this process is gone")
    ap.add_argument("--no-stream", dest="stream", action="store_false",
                    help="fetch a version's chunks only after its manifest (ReceiverConfig.stream=False)")
    ap.add_argument("--plans", default=None,
                    help="the driver's rxplan/ directory: before step s the driver writes <s>.json "
                         "({'stream': bool}) and waits for <s>.ok, written once this receiver follows it")
    ap.add_argument("--local-dir", default=None,
                    help="where the trainer writes the state of a check-only step (local_state_path)")
    args = ap.parse_args(argv)

    from safetensors.torch import load as load_safetensors

    from nemo_dcr.protocol.manifest import dense_key
    from nemo_dcr.protocol.signing import Sealer, load_key
    from nemo_dcr.receiver.bootstrap import build_receiver
    from nemo_dcr.receiver.engine import ReceiverConfig
    from nemo_dcr.receiver.verify import compare_modules, load_dense
    from nemo_dcr.runtimes.hf import HFTransformersAdapter
    from nemo_dcr.transport.store import open_store

    rid = args.receiver_id
    store = open_store(args.store)
    sealer = Sealer(load_key(None, log=lambda m: print(m, file=sys.stderr, flush=True)))
    # version 0 downloaded into args.dir and checked; the served model refits by deltas in place
    session = build_receiver(store, sealer, ReceiverConfig(receiver_id=rid, model_id=args.model_id,
                                                           stream=args.stream),
                             state_dir=args.dir, runtime="hf", timeout_s=args.timeout_s)
    rx, follower = session.receiver, session.follower
    adapter = rx.served.applier.adapter  # the hf runtime's in-process model (InProcessModel)
    dense_model = HFTransformersAdapter.from_pretrained(session.init_dir)  # dense refits, same class and loader
    open(os.path.join(args.dir, "ready"), "w").close()
    print(json.dumps({"receiver": rid, "ready": True, "run_id": session.run_id}), flush=True)

    done: set[int] = set()
    planned: set[int] = set()
    stop = os.path.join(args.dir, "stop")
    while not os.path.exists(stop):
        if _driver_gone(args.driver_pid):
            print(f"link_refit receiver: driver {args.driver_pid} is gone; stopping", file=sys.stderr, flush=True)
            return 1
        nxt = follower.state.committed + 1
        if args.plans and nxt not in planned and follower.state.awaiting is None and \
                os.path.exists(os.path.join(args.plans, f"{nxt}.json")):
            with open(os.path.join(args.plans, f"{nxt}.json")) as f:
                rx.cfg = dataclasses.replace(rx.cfg, stream=bool(json.load(f)["stream"]))
            open(os.path.join(args.plans, f"{nxt}.ok"), "w").close()
            planned.add(nxt)
        if follower.step():
            continue
        v = follower.state.committed
        local = local_state_path(args.local_dir, v) if args.local_dir else ""
        if v > 0 and v not in done and follower.state.awaiting is None and \
                ((local and os.path.exists(local)) or store.exists(dense_key(v))):
            t0 = time.monotonic()
            if local and os.path.exists(local):
                with open(local, "rb") as f:
                    blob = f.read()
            else:
                blob = store.get(dense_key(v))
            t1 = time.monotonic()
            state = load_safetensors(blob)
            t2 = time.monotonic()
            load_dense(dense_model, state)
            t3 = time.monotonic()
            del blob, state
            store.put(dense_ack_key(rid, v), json.dumps({
                "t_get": t0, "t_loaded": t3, "get_s": t1 - t0, "deserialize_s": t2 - t1, "load_s": t3 - t2}).encode())
            t4 = time.monotonic()
            report = compare_modules(adapter.module, dense_model.module)
            verdict = {"bit_exact": report.equal, "compared": report.compared, "summary": report.summary(),
                       "compare_s": time.monotonic() - t4}
            if not done:
                verdict["negative_control"] = "detected" if _negative_control(adapter.module, dense_model.module) \
                    else "MISSED"
            store.put(verify_key(rid, v), json.dumps(verdict).encode())
            print(json.dumps({"receiver": rid, "dense_version": v, **verdict}), flush=True)
            done.add(v)
            continue
        time.sleep(rx.cfg.poll_s)  # the receiver's own poll interval (nemo-dcr receive's default)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    roles = {"trainer": trainer_main, "receiver": receiver_main}
    if not argv or argv[0] not in roles:
        print(f"usage: python -m nemo_dcr_testbed.link_refit {{{','.join(roles)}}} ...", file=sys.stderr)
        return 2
    return roles[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
