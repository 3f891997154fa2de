"""`nemo-dcr` console script: one sub-command per user-facing job.

  nemo-dcr demo [hydra overrides...]          end-to-end refit demo (what `make demo` runs)
  nemo-dcr receive --store URI --receiver-id R --model-id M [--runtime NAME] ...
                                               a receiver (runtimes: receiver/registry.py)
  nemo-dcr relay --upstream URI[,URI...] --listen HOST:PORT [--spool DIR] ...
                                               a relay of the relay tree (docs/relay.md)
  nemo-dcr keygen PATH                         a new signing key for a run (mode 0600)
  nemo-dcr delta {encode,apply,inspect} ...    standalone delta files (see codec/cli.py)

Errors are one line on stderr: exit status 2 for bad input (arguments, configuration, a
store URI that cannot be opened), 1 for a run that failed.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from nemo_dcr.testbed.demo import main as demo_main

        return demo_main(rest)
    if cmd == "receive":
        from nemo_dcr.receiver.cli import main as receive_main

        return receive_main(rest)
    if cmd == "relay":
        from nemo_dcr.transport.relay import main as relay_main

        return relay_main(rest)
    if cmd == "keygen":
        if len(rest) != 1 or rest[0].startswith("-"):
            print("nemo-dcr keygen: give the path of the key file to create", file=sys.stderr)
            return 2
        from nemo_dcr.protocol.signing import new_key_file

        try:
            new_key_file(rest[0])
        except OSError as e:
            print(f"nemo-dcr keygen: {rest[0]}: {e.strerror or e} (an existing key is never overwritten)",
                  file=sys.stderr)
            return 2
        print(rest[0])
        return 0
    if cmd == "delta":
        from nemo_dcr.codec import cli as delta_cli

        parser = argparse.ArgumentParser(prog="nemo-dcr delta")
        delta_cli.add_arguments(parser)
        return delta_cli.main(parser.parse_args(rest))
    print(f"nemo-dcr: unknown command {cmd!r} (commands: demo, receive, relay, keygen, delta; see nemo-dcr --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
