"""`nemo-dcr` console script: one sub-command per user-facing job.

  nemo-dcr demo [hydra overrides...]          end-to-end refit demo (what `make demo` runs)
  nemo-dcr receive --store URI --init-dir D ...  a Hugging Face transformers receiver
  nemo-dcr delta {encode,apply,inspect} ...    standalone delta files (see codec/cli.py)
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
        from nemo_dcr.receiver.worker import main as receive_main

        return receive_main(rest)
    if cmd == "delta":
        from nemo_dcr.codec import cli as delta_cli

        parser = argparse.ArgumentParser(prog="nemo-dcr delta")
        delta_cli.add_arguments(parser)
        return delta_cli.main(parser.parse_args(rest))
    print(f"nemo-dcr: unknown command {cmd!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
