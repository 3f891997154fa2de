"""How much of context mode's size gain survives a coarser context: the changed/unchanged
flags' entropy given the base element's exponent (what BUCKET and LANES condition on, up to
32 buckets) against K classes of exponents (K - 1 thresholds, the best per tensor), K = 2 and
4, which an index of 1 or 2 bits per element beside the held bits could hold (issue 34,
docs/design.md "No index beside the held bits").

For every (base, target) pair of ``scripts/make_real_deltas.py`` it prints, in bytes summed over
the tensors: the flags' i.i.d. entropy, their entropy given the exponent and given the best
2 and 4 classes, the context-mode LANES chunk, the i.i.d. bound (``codec/bound.py``), and the
chunk's size over the bound as it is and with the exponent's flag entropy replaced by the
classes' (values keep their bucket context: a decoder reads the base at each changed element
anyway).  Entropies come from per-exponent histograms, so the threshold search is exact and
fast.  Writes nothing.

    .venv/bin/python scripts/context_classes.py [--data benchmarks/data] [--pairs TAG ...]
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib

import numpy as np
from safetensors.torch import load_file

from nemo_dcr import dtypes
from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, encode_chunk
from nemo_dcr.codec.bound import iid_bound_bytes
from nemo_dcr.kernels import bits_view_np, xor_diff


def _h(n: np.ndarray, k: np.ndarray) -> float:
    """Sum over classes of n H(k / n), in bits (n elements, k of them changed)."""
    n, k = n.astype(np.float64), k.astype(np.float64)
    out = 0.0
    for a, b in ((k, n), (n - k, n)):
        m = (a > 0) & (b > 0)
        out -= float((a[m] * np.log2(a[m] / b[m])).sum())
    return out


def _best_classes(n: np.ndarray, k: np.ndarray, classes: int) -> float:
    """Least flag entropy over the ways to cut the exponent histogram into `classes` runs."""
    used = np.flatnonzero(n)
    if used.size <= classes:
        return _h(n[used], k[used])
    best = float("inf")
    for cuts in itertools.combinations(range(1, used.size), classes - 1):
        edges = (0, *cuts, used.size)
        nn = np.array([n[used[a:b]].sum() for a, b in itertools.pairwise(edges)])
        kk = np.array([k[used[a:b]].sum() for a, b in itertools.pairwise(edges)])
        best = min(best, _h(nn, kk))
    return best


def pair(d: pathlib.Path) -> dict[str, float]:
    base, target = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
    deltas, bits = [], {}
    tot = dict.fromkeys(("iid", "exponent", "classes2", "classes4", "bound"), 0.0)
    for name in sorted(base):
        b, t = base[name].contiguous(), target[name].contiguous()
        diff = xor_diff(t, b)
        dtype = str(t.dtype).removeprefix("torch.")
        deltas.append(TensorDelta(name=name, dtype=dtype, shape=tuple(t.shape), op=DeltaOp.XOR,
                                  positions=diff.positions, values=diff.xor_values))
        bb = bits_view_np(b)
        bits[name] = bb
        eshift, ebits = dtypes.DTYPES[dtype].exponent
        e = ((bb >> eshift) & ((1 << ebits) - 1)).astype(np.int64)
        n = np.bincount(e, minlength=1 << ebits)
        k = np.bincount(e[diff.positions], minlength=1 << ebits)
        tot["iid"] += _h(np.array([bb.size]), np.array([diff.positions.size])) / 8
        tot["exponent"] += _h(n, k) / 8
        tot["classes2"] += _best_classes(n, k, 2) / 8
        tot["classes4"] += _best_classes(n, k, 4) / 8
        tot["bound"] += iid_bound_bytes(bb.size, diff.xor_values)
    chunk = len(encode_chunk(deltas, base=bits, codings=[Coding.LANES]))
    row = {"pair": d.name, "lanes_context_bytes": chunk, **{f"flags_{k}_bytes" if k != "bound" else "bound_bytes": v
                                                         for k, v in tot.items()}}
    row["x_bound"] = chunk / tot["bound"]
    for c in ("classes2", "classes4"):
        row[f"x_bound_{c}"] = (chunk + tot[c] - tot["exponent"]) / tot["bound"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="benchmarks/data")
    ap.add_argument("--pairs", nargs="+", metavar="TAG", help="pairs to measure (default: all in index.json)")
    a = ap.parse_args()
    index = json.loads((pathlib.Path(a.data) / "index.json").read_text())
    tags = a.pairs or [p["tag"] for p in index["pairs"]]
    print(f"{'pair':<18} {'x bound':>8} {'2 classes':>10} {'4 classes':>10}   flags bytes: iid / exponent / 2 / 4")
    for tag in tags:
        r = pair(pathlib.Path(a.data) / tag)
        print(f"{tag:<18} {r['x_bound']:>8.3f} {r['x_bound_classes2']:>10.3f} {r['x_bound_classes4']:>10.3f}   "
              f"{r['flags_iid_bytes']:.0f} / {r['flags_exponent_bytes']:.0f} / {r['flags_classes2_bytes']:.0f} / "
              f"{r['flags_classes4_bytes']:.0f}")


if __name__ == "__main__":
    main()
