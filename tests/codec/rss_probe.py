"""Run in a fresh process: decode a chunk file several times, as a receiver decodes the chunks
of one version (keeping what each decodes), and print the peak-RSS growth as JSON.
(A fresh process, so that what the caller allocated before does not hide the growth.)

    python rss_probe.py CHUNK COPIES [EXPECT_JSON]

EXPECT_JSON (``{"name": ["dtype", [shape...]]}``) turns on admission: ``decode_chunk`` gets
``expect`` and one ``DecodeBudget.for_tensors(expect)`` shared by every copy.  Used by
tests/codec/test_admit.py and to measure the numbers in docs/wire-format.md.
"""
from __future__ import annotations

import json
import pathlib
import resource
import sys
import time

import numpy as np

from nemo_dcr.codec import DecodeBudget, DeltaOp, TensorDelta, decode_chunk, encode_chunk
from nemo_dcr.errors import DcrError


def _maxrss_bytes() -> int:
    """Peak RSS of this process.  VmHWM where there is one: ``ru_maxrss`` survives exec, so
    in a child of a big process (pytest with torch loaded) it starts at the parent's RSS."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    blob = pathlib.Path(sys.argv[1]).read_bytes()
    copies = int(sys.argv[2])
    expect = None
    if len(sys.argv) > 3:
        expect = {k: (d, tuple(s)) for k, (d, s) in json.loads(sys.argv[3]).items()}
    # Warm up every code path (imports, the coder's model state) on a small honest chunk, so
    # the growth below is what the probed chunk causes.
    warm = TensorDelta(name="warm", dtype="bfloat16", shape=(4096,), op=DeltaOp.OVERWRITE,
                       positions=np.arange(4096, dtype=np.int64), values=np.zeros(4096, np.uint16))
    decode_chunk(encode_chunk([warm]), expect={"warm": ("bfloat16", (4096,))},
                 budget=DecodeBudget(4096))
    budget = DecodeBudget.for_tensors(expect) if expect is not None else None
    kept, error = [], None
    r0 = _maxrss_bytes()
    t0 = time.perf_counter()
    for _ in range(copies):
        try:
            kept.extend(decode_chunk(blob, expect=expect, budget=budget).deltas)
        except DcrError as e:
            error = f"{type(e).__name__}: {e}"
            break
    seconds = time.perf_counter() - t0
    print(json.dumps({"rss_growth_bytes": _maxrss_bytes() - r0, "seconds": seconds,
                      "decoded_entries": sum(d.nnz for d in kept), "error": error}))


if __name__ == "__main__":
    main()
