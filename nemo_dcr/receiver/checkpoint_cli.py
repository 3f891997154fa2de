"""``nemo-dcr checkpoint``: a checkpoint directory to start a serving engine from, mid-run.

An engine that joins a running job (or restarts) should not replay every version since
version 0.  This writes the newest committed-version snapshot that checks out (the run's
signed snapshot record, the signed commit decision it names, every file's digest), completed
with version 0's other files (``config.json``), or version 0 itself when there is none (or
with ``--version-0``), into ``--out``, and prints one JSON line::

    {"directory": "<out>/v00000012", "version": 12, "run_id": "..."}

Start the engine from ``directory`` and give ``version`` as the weight-transfer backend's
``init_info.start_version`` (``runtimes/vllm/backend_config.py``), which checks every file
again against the run's records before the engine follows the run.  Exit status 2 for bad
input, 1 for a run that could not be read; one line on stderr either way.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from nemo_dcr.errors import DcrError

PROG = "nemo-dcr checkpoint"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--store", required=True, help="the run's store URI (or a relay upstream list)")
    ap.add_argument("--out", required=True, help="directory to write the checkpoint under")
    ap.add_argument("--key-file", default=None, help="the run's shared signing key (default: $NEMO_DCR_KEY_FILE)")
    ap.add_argument("--run-id", default=None, help="this run only (default: the store's)")
    ap.add_argument("--version-0", action="store_true", help="version 0 even when a snapshot exists")
    ap.add_argument("--timeout-s", type=float, default=0.0,
                    help="wait this long for the run record and version 0 (default: they must exist already: "
                         "the command is for a running job, and a mistyped --store should not wait)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from nemo_dcr.protocol.run import wait_for_run
    from nemo_dcr.protocol.signing import Sealer, load_key
    from nemo_dcr.receiver.bootstrap import fetch_snapshot_dir, fetch_version_zero
    from nemo_dcr.transport.store import open_store

    args = parser().parse_args(argv)
    try:
        store = open_store(args.store)
        sealer = Sealer(load_key(args.key_file, log=lambda m: print(m, file=sys.stderr, flush=True)))
    except DcrError as e:
        return _fail(f"{type(e).__name__}: {e}", 2)
    try:
        run_id = wait_for_run(store, sealer, run_id=args.run_id, timeout_s=args.timeout_s)
        snap = None
        if not args.version_0:
            snap = fetch_snapshot_dir(store, sealer, run_id, state_dir=args.out, timeout_s=args.timeout_s,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
        if snap is None:
            directory, _ = fetch_version_zero(store, sealer, run_id, state_dir=args.out, timeout_s=args.timeout_s)
            version = 0
        else:
            directory, version = snap.directory, snap.version
    except DcrError as e:
        return _fail(f"{type(e).__name__}: {e}", 1)
    except OSError as e:
        return _fail(f"{args.out}: {type(e).__name__}: {e}", 1)
    print(json.dumps({"directory": os.path.abspath(directory), "version": version, "run_id": run_id}), flush=True)
    return 0


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
