"""Run in a fresh process: ``nemo-dcr delta inspect ARGS...``, and print as JSON its exit
status, output and peak-RSS growth (VmHWM, reset to the current RSS once the imports are
done where the kernel allows it, so the growth is what inspect itself allocated).

    python inspect_probe.py DELTA [--json] [--max-decode N] ...

Used by tests/codec/test_cli.py and to measure the numbers in docs/wire-format.md.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import pathlib
import sys
import time

from nemo_dcr.cli import main as cli_main

from rss_probe import _maxrss_bytes

importlib.import_module("nemo_dcr.codec.cli")  # what `delta` imports, loaded before the baseline


def _reset_peak() -> None:
    """Peak RSS := current RSS (Linux >= 4.0); elsewhere the baseline is the import peak."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def main() -> None:
    out, err = io.StringIO(), io.StringIO()
    _reset_peak()
    r0 = _maxrss_bytes()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["delta", "inspect", *sys.argv[1:]])
    seconds = time.perf_counter() - t0
    print(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                      "rss_growth_bytes": _maxrss_bytes() - r0, "seconds": seconds}))


if __name__ == "__main__":
    main()
