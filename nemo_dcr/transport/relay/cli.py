"""``nemo-dcr relay``: the command line of one relay node (``docs/relay.md``)."""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from dataclasses import asdict, dataclass

from nemo_dcr.errors import DcrError, ValidationError
from nemo_dcr.events import event_line
from nemo_dcr.transport.relay.config import PROG, RelayConfig
from nemo_dcr.transport.relay.node import Relay, stderr_log
from nemo_dcr.transport.store.base import ObjectStore
from nemo_dcr.transport.store.open import open_store


class _BadInput(ValidationError):
    pass


_SIZE = re.compile(r"^([0-9]+)\s*([kmgt]?)(i?b)?$", re.IGNORECASE)


def byte_count(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``64k``: binary multiples."""
    m = _SIZE.match(text.strip())
    if m is None:
        raise ValidationError(f"not a byte count: {text!r} (e.g. 1073741824, 512M, 1GiB)")
    return int(m[1]) << (10 * " kmgt".index(m[2].lower() or " "))


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValidationError(f"--listen must be HOST:PORT (port 0: any free port), got {text!r}")
    return host.strip("[]"), int(port)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="serve one run's store to the relay tree's children "
                                                        "(docs/relay.md)")
    ap.add_argument("--upstream", required=True,
                    help="store URI to read from: a directory, s3://..., relay://HOST:PORT, or a comma-separated "
                         "ordered list of these (failover)")
    ap.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: any free port; the bound "
                                                    "address is printed on stdout)")
    d = RelayConfig()
    ap.add_argument("--spool", default=None, help="directory for the on-disk cache (default: memory only)")
    ap.add_argument("--max-spool-bytes", type=byte_count, default=d.max_spool_bytes,
                    help="bytes held under --spool (default 16G)")
    ap.add_argument("--max-memory-bytes", type=byte_count, default=d.max_memory_bytes,
                    help="objects held in memory plus fetches in flight (default 1G); larger objects get 503")
    ap.add_argument("--keep-versions", type=int, default=d.keep_versions,
                    help="versions v/<n>/ held; the oldest is dropped first (default 4)")
    ap.add_argument("--coalesce-ms", type=float, default=d.coalesce_ms,
                    help="how long answers about mutable keys, not-founds, stats and lists are reused (default 50)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="upstream: each attempt's connect/read timeout (StorePolicy.timeout_s; default: "
                         "open_store's, 30 s, and 5 s for every member of a list but the last)")
    ap.add_argument("--retries", type=int, default=None,
                    help="upstream: further attempts after a transient failure (StorePolicy.retries; default: "
                         "open_store's, 4, and 1 for every member of a list but the last)")
    ap.add_argument("--fetch-threads", type=int, default=d.fetch_threads,
                    help="upstream calls at once (default 16)")
    ap.add_argument("--prefetch", type=int, default=d.prefetch,
                    help="cut-through fetches of listed chunks at once (default 4)")
    ap.add_argument("--send-timeout-s", type=float, default=d.send_timeout_s,
                    help="disconnect a child that takes no bytes for this long (default 120)")
    ap.add_argument("--progress-s", type=float, default=30.0,
                    help="a progress line on stderr this often while anything moved (0: none; default 30)")
    ap.add_argument("--admit-wait-s", type=float, default=d.admit_wait_s,
                    help="how long a child's fetch waits for memory to be freed before its 503 (default 2)")
    ap.add_argument("--max-connections", type=int, default=d.max_connections,
                    help=f"child connections at once; one more is answered 503 (default {d.max_connections})")
    ap.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                    help=f"close a child connection idle (or sending headers) this long (default {d.idle_timeout_s:g})")
    ap.add_argument("--put-rate", type=float, default=d.put_rate,
                    help=f"acks / join requests written through per second, burst 4x (default {d.put_rate:g})")

    def one_line(message: str):
        raise _BadInput(f"{message} (see --help)")

    ap.error = one_line
    return ap


@dataclass(frozen=True)
class RelayRun:
    """What ``nemo-dcr relay`` serves, checked before anything starts."""

    store: ObjectStore
    config: RelayConfig
    listen: tuple[str, int]
    progress_s: float


def check_input(args) -> RelayRun:
    """The parsed arguments as a :class:`RelayRun`; bad input is one line (``_BadInput``)."""
    try:
        listen = parse_listen(args.listen)
        cfg = RelayConfig(max_memory_bytes=args.max_memory_bytes, spool_dir=args.spool,
                          max_spool_bytes=args.max_spool_bytes, keep_versions=args.keep_versions,
                          coalesce_ms=args.coalesce_ms, fetch_threads=args.fetch_threads, prefetch=args.prefetch,
                          send_timeout_s=args.send_timeout_s, admit_wait_s=args.admit_wait_s,
                          max_connections=args.max_connections, idle_timeout_s=args.idle_timeout_s,
                          put_rate=args.put_rate)
        if args.progress_s < 0:
            raise ValidationError(f"--progress-s must be >= 0, got {args.progress_s}")
        if args.spool is not None and os.path.exists(args.spool) and not os.path.isdir(args.spool):
            raise ValidationError(f"--spool {args.spool!r} is not a directory")
    except DcrError as e:
        raise _BadInput(str(e)) from None
    try:
        given = {k: v for k, v in (("timeout_s", args.timeout_s), ("retries", args.retries)) if v is not None}
        store = open_store(args.upstream, **given)
    except (DcrError, ImportError) as e:  # ImportError: a scheme whose package is not installed
        raise _BadInput(f"--upstream: {type(e).__name__}: {e}") from None
    return RelayRun(store=store, config=cfg, listen=listen, progress_s=args.progress_s)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        run = check_input(args)
    except _BadInput as e:
        return _fail(str(e), 2)
    try:
        status = asyncio.run(_serve(run.store, run.config, *run.listen, run.progress_s))
    except OSError as e:  # the address is taken, the spool cannot be made
        return _fail(f"{type(e).__name__}: {e}", 1)
    # Shut down: the server is closed and the spool removed.  An upstream call still
    # running in the pool (a stalled upstream) would hold the interpreter's exit for up to
    # its policy's bound; nothing waits for its answer, so the process exits now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


PROGRESS_FIELDS = ("served_bytes", "served_objects", "upstream_fetches", "upstream_fetch_bytes", "coalesced", "cache_hits",
             "prefetched", "rejected", "upstream_failures", "memory_bytes", "spool_bytes", "versions",
             "current_upstream")


async def _progress(relay: Relay, every_s: float) -> None:
    last = None
    while True:
        await asyncio.sleep(every_s)
        s = relay.stats()
        now = {k: s[k] for k in PROGRESS_FIELDS}
        if now != last:
            stderr_log({"relay": "progress", **now})
            last = now


async def _serve(store: ObjectStore, cfg: RelayConfig, host: str, port: int, progress_s: float = 0.0) -> int:
    relay = Relay(store, cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = await relay.start(host, port)
    shown = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
    print(event_line({"relay": "listening", "address": shown, "upstreams": [u["uri"] for u in relay.upstreams()],
                      "config": {k: v for k, v in asdict(cfg).items()}}), flush=True)
    ticker = asyncio.ensure_future(_progress(relay, progress_s)) if progress_s > 0 else None
    try:
        await stop.wait()
    finally:
        if ticker is not None:
            ticker.cancel()
        s = relay.stats()
        await relay.close()
        stderr_log({"relay": "stopped", **{k: s[k] for k in ("served_bytes", "served_objects", "upstream_fetches",
                                                                "upstream_fetch_bytes", "coalesced", "prefetched")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
