"""Your own ``vllm serve`` kept current by nemo_dcr: the rollout side of an RL loop.

Trainer (shell 1; the refit hook in a megatron-core loop, TP=2 on CPU/gloo; it blocks after
each step until the engine acknowledged the version):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/refit_with_hook.py --store runs/serve/store --steps 3

Rollout side (shell 2, once ``runs/serve/store/init/model.safetensors`` exists):

    .venv/bin/python examples/vllm_serve_refit.py --store runs/serve/store --receiver-id r0 \\
        --model-id example --versions 3

This starts ``vllm serve`` from the run's version 0 (``<store>/init``) with
``--weight-transfer-config '{"backend": "nemo_dcr"}'`` (``--url`` attaches to a server you
started that way instead), initialises the backend, and for each version keeps a streamed
completion in flight while the controller (``nemo_dcr.runtimes.vllm.controller``) waits until
the version is staged, pauses generation (``mode=keep``), updates, finishes with the weight
version ``<run_id>:<N>`` and resumes.  It prints the staged / pause / update times and the
weight-version spans of the completion that crossed the refit (tokens before the pause are
the old policy's, after it the new one's).  Starting the server uses the test bed's helper
(``nemo_dcr_testbed.vllm_serve.start_server``: the CPU wheel's module launcher, loopback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="the run's store (directory or URI)")
    ap.add_argument("--receiver-id", required=True, help="one of the trainer's refit.receivers")
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--versions", type=int, default=3, help="refit versions 1..N")
    ap.add_argument("--key-file", default=None, help="the run's key (default: $NEMO_DCR_KEY_FILE, else none)")
    ap.add_argument("--url", default=None, help="a running server (default: start one from <store>/init)")
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=40, help="length of the completion kept in flight")
    args = ap.parse_args()

    from nemo_dcr.protocol.run import wait_for_run
    from nemo_dcr.protocol.signing import Sealer, load_key
    from nemo_dcr.runtimes.vllm.controller import Controller, ServerClient
    from nemo_dcr.transport.store import open_store
    from nemo_dcr_testbed.vllm_serve import InFlight, start_server

    run_id = wait_for_run(open_store(args.store), Sealer(load_key(args.key_file)), run_id=None, timeout_s=600)
    work = tempfile.mkdtemp(prefix="vllm-serve-refit-")
    status = os.path.join(work, "status.json")
    server = None
    url = args.url
    if url is None:
        print("starting vllm serve from the run's version 0 ...", flush=True)
        server = start_server(os.path.join(args.store, "init"), os.path.join(work, "server.log"),
                              max_model_len=args.max_model_len)
        url = server.url
        print(f"server {url} (log {server.log_path})", flush=True)
    try:
        ctl = Controller([ServerClient(url, status_path=status)], run_id=run_id)
        info = {"store": os.path.abspath(args.store), "receiver_id": args.receiver_id, "model_id": args.model_id,
                "status_path": status}
        if args.key_file:
            info["key_file"] = os.path.abspath(args.key_file)
        ctl.init([info])
        for v in range(1, args.versions + 1):
            flight = InFlight(url, [1, 2, 3], args.tokens)
            flight.started.wait(60)
            (r,) = ctl.refit(v)
            done = flight.join()
            spans = ", ".join(f"{s['version'].rsplit(':', 1)[-1]}: tokens {s['start']}-{s['end']}"
                              for s in done["weight_versions"] or [])
            print(f"v{v}: staged {r.staged_s:.3f}s, pause {r.pause_s:.3f}s, update {r.update_s:.3f}s "
                  f"(writing {r.status.get('write_s', 0):.3f}s); weight version {r.weight_version}; "
                  f"completion in flight: {spans}", flush=True)
        print(json.dumps({"versions": args.versions, "weight_version": ServerClient(url).weight_version()}))
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
