"""`nemo-dcr` console script: one sub-command per user-facing job.

  nemo-dcr demo [hydra overrides...]          end-to-end refit demo (what `make demo` runs;
                                               from the test bed, `pip install ./testbed`)
  nemo-dcr receive --store URI --receiver-id R --model-id M [--runtime hf|vllm] ...
                                               a receiver (README "vLLM engines as receivers")
  nemo-dcr status --store URI [--key-file K] [--json]
                                               where a run stands: committed version, acks,
                                               members, snapshots (its signed documents only)
  nemo-dcr checkpoint --store URI --out DIR    a directory to start a serving engine from
                                               mid-run: the newest snapshot, or version 0
  nemo-dcr relay --upstream URI[,URI...] --listen HOST:PORT [--spool DIR] ...
                                               a relay of the relay tree (docs/relay.md)
  nemo-dcr keygen PATH                         a new signing key for a run (mode 0600)
  nemo-dcr delta {encode,apply,inspect} ...    standalone delta files between safetensors
  nemo-dcr --version                           the installed version

`nemo-dcr COMMAND --help` (or -h) describes each.  The docs named here (README.md,
docs/*.md) are in the nemo_dcr repository, not in the installed package.

Other distributions add sub-commands through the entry-point group ``nemo_dcr.cli`` (a
``main(argv) -> int``): the test bed (the distribution nemo-dcr-testbed, testbed/ in the
repository) adds ``demo`` that way.

Errors are one line on stderr: exit status 2 for bad input (arguments, configuration, a
store URI that cannot be opened), 1 for a run that failed.
"""
from __future__ import annotations

import argparse
import errno
import os
import select
import sys
from importlib.metadata import entry_points

if os.environ.get("_NEMO_DCR_HIDDEN_PACKAGES"):
    # a vLLM worker spawned by a receiver that hid a torchvision / torchaudio / torchcodec that
    # cannot load (nemo_dcr/runtimes/_vision_guard.py): spawn imports this module (the parent's
    # __main__) before vLLM, which imports transformers' image utilities, hence torchvision
    import nemo_dcr.runtimes  # noqa: F401  (hides them again, silently)

PLUGIN_GROUP = "nemo_dcr.cli"
"""Entry-point group of sub-commands that other distributions add (name -> ``main(argv)``)."""
BUILT_IN = ("receive", "status", "checkpoint", "relay", "keygen", "delta")
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


KEYGEN_HELP = """usage: nemo-dcr keygen PATH

Create PATH holding a new random 32-byte signing key (hex, mode 0600) for a run: give the
same file to the trainer (refit.key_file=PATH) and every receiver (--key-file PATH), or set
$NEMO_DCR_KEY_FILE for both (README "Runs, keys, faults").  The folder must exist; an
existing file is never overwritten.  Prints PATH."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nemo-dcr")
    except PackageNotFoundError:  # a source tree on the path, not installed
        from nemo_dcr import __version__

        return __version__


def stdout_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone (``... | head``): poll reports POLLERR."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def quiet_stdout() -> int:
    """After the reader of stdout went away: nothing more is written there (the interpreter's
    own flush at exit included), and the exit status is a shell's for SIGPIPE (128 + 13)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except OSError:
        pass
    return 141


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command.  Its output cut short by the reader (``nemo-dcr delta inspect --json
    | head -1``) ends it quietly, exit status 141, as a shell tool killed by SIGPIPE."""
    try:
        rc = _main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        if stdout_broken():
            return quiet_stdout()
        raise  # a socket's, not stdout's


def _keygen(rest: list[str]) -> int:
    if rest and rest[0] in {"-h", "--help"}:
        print(KEYGEN_HELP)
        return 0
    if len(rest) != 1 or rest[0].startswith("-"):
        print("nemo-dcr keygen: give the path of the key file to create (nemo-dcr keygen --help)", file=sys.stderr)
        return 2
    from nemo_dcr.protocol.signing import new_key_file

    path = rest[0]
    try:
        new_key_file(path)
    except OSError as e:
        if e.errno == errno.EEXIST and os.path.isdir(path):
            why = "is a folder: give the path of the key file to create in it"
        elif e.errno == errno.EEXIST:
            why = "exists: an existing key is never overwritten"
        else:
            why = e.strerror or str(e)
        print(f"nemo-dcr keygen: {path}: {why}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__.strip())
        return 0
    if argv[0] in {"-V", "--version"}:
        print(f"nemo-dcr {_version()}")
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
    if cmd == "status":
        try:
            from nemo_dcr.status_cli import main as status_main
        except ImportError as e:
            print(f"nemo-dcr status: not available in this installation ({e})", file=sys.stderr)
            return 2
        return status_main(rest)
    if cmd == "keygen":
        return _keygen(rest)
    if cmd == "delta":
        from nemo_dcr.codec import cli as delta_cli

        parser = argparse.ArgumentParser(prog="nemo-dcr delta", description=delta_cli.__doc__.split("\n\n")[0])
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
