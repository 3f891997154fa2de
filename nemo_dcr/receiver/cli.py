"""``nemo-dcr receive`` / ``python -m nemo_dcr.receiver.cli``: a receiver keeping a serving
runtime (any name in ``receiver/registry.py``) at the versions a store publishes.

Exit status: 0 when the run ended as asked (``--until-version``); 2 with one line on
stderr for bad input, found before anything is loaded (arguments, the receiver id, the
store URI, the key file, options the runtime does not support, a runtime whose engine is
not installed), or before anything is downloaded (a store that does not exist or cannot be
used: ``transport/preflight.check_store``; a run whose signed ``RUN.json`` serves another
model, is another run than ``--run-id`` or does not open with the key:
``bootstrap.RunMismatch``), nothing written to the store; 1 with one line on stderr for a
run that failed (``DcrError``, a timeout, a local file error such as a full
``--state-dir``: ENOSPC), for a receiver that refused ``--max-refusals`` versions in a row
for the same reason that it does not fit the run (``follower.RefusedTooOften``), and for
one that applied none of the versions it answered (each refused).
"""
from __future__ import annotations

import argparse
import errno
import sys
import tempfile

from nemo_dcr.configs.flags import FieldFlags, field_values
from nemo_dcr.errors import DcrError, ValidationError
from nemo_dcr.events import event_line
from nemo_dcr.receiver.registry import RuntimeOptions, check_options, runtime_names

PROG = "nemo-dcr receive"


class _BadInput(ValidationError):
    """Input refused before the receiver starts: exit status 2 (``main`` catches it before
    the ``DcrError`` of a failed run, exit status 1)."""


def parser() -> argparse.ArgumentParser:
    """The flags of ``ReceiverConfig``'s and ``RuntimeOptions``' fields come from the fields
    (type, default, help: ``configs/flags.py``); the others are written here."""
    from nemo_dcr.receiver.engine import ReceiverConfig

    ap = argparse.ArgumentParser(prog=PROG)
    fields = FieldFlags(ap)
    ap.add_argument("--store", required=True,
                    help="store URI: a directory that exists (a receiver never creates it; an empty one is waited "
                         "on), or an fsspec URI such as s3://bucket/prefix (S3 endpoint, credentials and region from "
                         "the environment: docs/object-stores.md); checked before anything starts")
    fields.add(ReceiverConfig, "receiver_id", "model_id")
    ap.add_argument("--key-file", default=None,
                    help="the run's shared signing key (default: $NEMO_DCR_KEY_FILE)")
    ap.add_argument("--insecure-no-key", action="store_true",
                    help="follow a signed run WITHOUT its key, checking no signature (anyone who can write "
                         "to the store can then make this receiver apply anything); refused otherwise")
    ap.add_argument("--run-id", default=None, help="follow only this run (default: the store's RUN.json)")
    ap.add_argument("--state-dir", default=None,
                    help="local directory for a downloaded version 0 and, with --persistent-weights, the "
                         "weights file, the apply journal and the committed version (default: a fresh "
                         "temporary directory)")
    ap.add_argument("--until-version", type=int, default=None,
                    help="exit once the trainer decided on this version (committed or aborted)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="give up when nothing new appears for this long (default: wait forever)")
    fields.add(ReceiverConfig, "poll_s", "fetch_threads", "stream", "verify_dense")
    ap.add_argument("--init-dir", default=None,
                    help="local copy of the initial HF checkpoint (checked against the run's init/INIT.json; "
                         "default: download it from the store)")
    ap.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                    help="start from version 0 and replay every committed version, even where the run wrote "
                         "committed-version snapshots (refit.snapshot_every; by default a fresh receiver without "
                         "--init-dir or --persistent-weights starts from the newest one that checks out)")
    names = runtime_names()
    ap.add_argument("--runtime", choices=names, default=names[0],
                    help="serving runtime kept current (hf: a transformers model in this process; vllm: a "
                         "vllm.LLM engine)")
    fields.add(RuntimeOptions, "persistent", "tensor_parallel_size", "max_model_len", "sample_tokens")
    ap.add_argument("--join", action="store_true",
                    help="elastic membership (refit.membership=elastic): once this receiver holds the committed "
                         "version, write a signed join request so the trainer admits it at a next version, and "
                         "again whenever a decision evicts it (events 'join requested', 'joined', 'evicted')")
    ap.add_argument("--dump-dir", default=None,
                    help="testing aid: after each applied version write every parameter and buffer "
                         "to DIR/v<version>.safetensors")
    fields.add_rest(ReceiverConfig)  # a field given a flag later: at the end, never missing
    fields.add_rest(RuntimeOptions)

    def one_line(message: str):  # argparse's default prints the whole usage block
        raise _BadInput(f"{message} (see --help)")

    ap.error = one_line
    return ap


def main(argv: list[str] | None = None) -> int:
    from nemo_dcr.receiver.bootstrap import RunMismatch
    from nemo_dcr.receiver.registry import RuntimeUnavailable

    try:
        args = parser().parse_args(argv)
        setup = check_input(args)
        check_store_usable(args)
    except _BadInput as e:
        return _fail(str(e), 2)
    try:
        return _serve(args, *setup)
    except (RunMismatch, RuntimeUnavailable) as e:  # bad input found once the run's record was read
        return _fail(str(e), 2)
    except (DcrError, TimeoutError) as e:
        return _fail(f"{type(e).__name__}: {e}", 1)
    except OSError as e:  # the local disk: a full or unwritable --state-dir, a missing file
        return _fail(_os_error(e, args), 1)


def _os_error(e: OSError, args) -> str:
    """One line for a local file error; a full disk names what to do about it."""
    line = f"{type(e).__name__}: {e}"
    if e.errno == errno.ENOSPC:
        where = f"--state-dir {args.state_dir}" if args.state_dir else "the state directory"
        line = f"{where} is full ({line}): free space and restart"
        if args.persistent_weights:
            line += ("; the weights there are repaired from the apply journal at the restart (the version "
                     "being recorded is rolled back, then fetched again)")
    return line


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


def check_store_usable(args) -> None:
    """The store exists and answers (``transport/preflight.check_store``: a directory that
    exists; for ``s3://``, the endpoint, credentials, region and bucket), before anything
    waits on it: one line, exit status 2, nothing written."""
    from nemo_dcr.transport.preflight import check_store

    try:
        check_store(args.store, reader=True)
    except DcrError as e:
        raise _BadInput(f"--store: {e}") from None


def check_input(args):
    """Everything that can be refused before waiting for a run or loading a model."""
    from nemo_dcr.configs.check import check_number
    from nemo_dcr.protocol.signing import Sealer, load_key
    from nemo_dcr.receiver.engine import ReceiverConfig
    from nemo_dcr.receiver.registry import check_installed
    from nemo_dcr.transport.store import open_store

    try:
        store = open_store(args.store, create=False)  # a receiver never creates its store
    except DcrError as e:  # StoreError, or a ValidationError for the URI
        raise _BadInput(f"--store: {type(e).__name__}: {e}") from None
    try:
        cfg = ReceiverConfig(**field_values(args, ReceiverConfig))
        options = RuntimeOptions(reference=args.verify_dense, **field_values(args, RuntimeOptions))
        check_options(args.runtime, options)
        check_installed(args.runtime)
        if args.persistent_weights and not args.state_dir:
            raise ValidationError("--persistent-weights needs a --state-dir")
        check_number("--until-version", args.until_version, min=0, allow_none=True)
        check_number("--timeout-s", args.timeout_s, kind=float, positive=True, allow_none=True)
        sealer = Sealer(load_key(args.key_file, log=lambda m: print(m, file=sys.stderr, flush=True)))
        if args.insecure_no_key and sealer.signed:
            raise ValidationError("--insecure-no-key with a key: drop one of them")
    except DcrError as e:
        raise _BadInput(str(e)) from None
    return store, sealer, cfg, options


def _serve(args, store, sealer, cfg, options) -> int:
    from nemo_dcr.receiver.bootstrap import build_receiver
    from nemo_dcr.transport.failover import origin_chunk_bytes

    if args.insecure_no_key:
        print(f"{PROG}: WARNING: --insecure-no-key: following {args.store} WITHOUT checking any "
              "signature; anyone who can write to the store can make this receiver apply anything",
              file=sys.stderr, flush=True)
    state_dir = args.state_dir or tempfile.mkdtemp(prefix=f"dcr-{args.receiver_id}-")
    session = build_receiver(store, sealer, cfg, state_dir=state_dir, runtime=args.runtime, options=options,
                             run_id=args.run_id, init_dir=args.init_dir, timeout_s=args.timeout_s,
                             allow_unverified=args.insecure_no_key, dump_dir=args.dump_dir, snapshot=args.snapshot)
    with session:
        print(event_line({"receiver": args.receiver_id, "bootstrap": session.bootstrap}), flush=True)
        session.follower.join = args.join
        if session.recovered is not None:
            print(event_line({"receiver": args.receiver_id, **session.recovered, "held": session.committed}),
                  flush=True)
        print(event_line({"receiver": args.receiver_id, "ready": True, "run_id": session.run_id,
                          "held": session.committed}), flush=True)
        session.run(until_version=args.until_version, timeout_s=args.timeout_s)
        # the version held now (session.committed is the one held at the start)
        print(event_line({"receiver": args.receiver_id, "done": True, "held": session.follower.state.committed,
                          "origin_chunk_bytes": origin_chunk_bytes(store)}), flush=True)  # the demo sums these
    follower = session.follower
    if follower.refusals and not follower.applied:  # e.g. a finished store it does not fit: not a success
        version, why = follower.refused[-1]
        return _fail(f"receiver {args.receiver_id} applied none of the versions it answered ({follower.refusals} "
                     f"refused; the last, v{version}: {why})", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
