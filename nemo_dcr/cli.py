"""`nemo-dcr` console script: one sub-command per user-facing job.

  nemo-dcr demo [hydra overrides...]          end-to-end refit demo (what `make demo` runs;
                                               from the test bed, `pip install ./testbed`)
  nemo-dcr receive --store URI --receiver-id R --model-id M [--runtime NAME] ...
                                               a receiver (runtimes: receiver/registry.py)
  nemo-dcr checkpoint --store URI --out DIR    a directory to start a serving engine from
                                               mid-run: the newest snapshot, or version 0
  nemo-dcr relay --upstream URI[,URI...] --listen HOST:PORT [--spool DIR] ...
                                               a relay of the relay tree (docs/relay.md)
  nemo-dcr keygen PATH                         a new signing key for a run (mode 0600)
  nemo-dcr delta {encode,apply,inspect} ...    standalone delta files (see codec/cli.py)

Other distributions add sub-commands through the entry-point group ``nemo_dcr.cli`` (a
``main(argv) -> int``): the test bed (testbed/pyproject.toml) adds ``demo`` that way.

Errors are one line on stderr: exit status 2 for bad input (arguments, configuration, a
store URI that cannot be opened), 1 for a run that failed.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

if os.environ.get("_NEMO_DCR_HIDDEN_PACKAGES"):
    # a vLLM worker spawned by a receiver that hid a torchvision / torchaudio / torchcodec that
    # cannot load (nemo_dcr/runtimes/_vision_guard.py): spawn imports this module (the parent's
    # __main__) before vLLM, which imports transformers' image utilities, hence torchvision
    import nemo_dcr.runtimes  # noqa: F401  (hides them again, silently)

PLUGIN_GROUP = "nemo_dcr.cli"
"""Entry-point group of sub-commands that other distributions add (name -> ``main(argv)``)."""
BUILT_IN = ("receive", "checkpoint", "relay", "keygen", "delta")
FROM_TESTBED = {"demo": "the end-to-end demo is part of nemo_dcr's test bed, which is not installed "
                        "(from a nemo_dcr checkout: pip install ./testbed, or make setup)"}


def _plugins() -> dict:
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in BUILT_IN}


def _load(ep):
    """The entry point's ``main``, or None where its distribution's metadata is found but its
    package is not importable (metadata left behind, or another environment's on the path)."""
    try:
        return ep.load()
    except ModuleNotFoundError as e:
        if e.name and ep.module.split(".")[0] == e.name.split(".")[0]:
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "receive":
        from nemo_dcr.receiver.cli import main as receive_main

        return receive_main(rest)
    if cmd == "checkpoint":
        from nemo_dcr.receiver.checkpoint_cli import main as checkpoint_main

        return checkpoint_main(rest)
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
    plugins = _plugins()
    if cmd in plugins:
        run = _load(plugins[cmd])
        if run is not None:
            return run(rest)
        if cmd not in FROM_TESTBED:
            print(f"nemo-dcr {cmd}: registered as {plugins[cmd].value}, which cannot be imported", file=sys.stderr)
            return 2
    if cmd in FROM_TESTBED:
        print(f"nemo-dcr {cmd}: {FROM_TESTBED[cmd]}", file=sys.stderr)
        return 2
    known = ", ".join(sorted({*BUILT_IN, *plugins}))
    print(f"nemo-dcr: unknown command {cmd!r} (commands: {known}; see nemo-dcr --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
