"""Codec benchmark on real BF16 AdamW deltas: bytes per changed element and speed.

For every (base, target) pair made by ``scripts/make_real_deltas.py`` it prints, per
changed element: the i.i.d. entropy bound (per tensor, and pooled over the model), this
codec in both modes (whole chunk bytes: framing included), and the published formats as
their descriptions specify them, each applied per tensor and summed:

  gap16+xor+zstd1   gaps between changed positions as uint16 (0xFFFF escapes to a
                    following uint32), then the XOR values; zstd level 1
  gap32+xor+zstd1   the same with uint32 gaps
  idx32+bf16 raw    int32 flat index + the new 16-bit value: 6 bytes per change
  idx32+bf16+zstd   the same, zstd level 3
  dense xor+zstd    the dense XOR mask (zeros included), zstd level 3

It also prints how much the changed/unchanged flags' entropy drops when conditioned on
what a context-free decoder knows (the previous element's and the element-one-row-up's
flags) and on what a context-mode decoder also knows (the base element's exponent): the
flags are about 3/4 of the bound, so this says which mode can beat the i.i.d. bound.

Speeds are GB/s of the model's parameter bytes (numel x element size) on one thread:
encode = encode_chunk on the diffs, decode = decode_chunk (no apply).  Saves
benchmarks/results/codec.json and codec.png.

    .venv/bin/python scripts/bench_codec.py [--data benchmarks/data] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file

from nemo_dcr.codec import DeltaOp, TensorDelta, decode_chunk, encode_chunk, read_chunk_index
from nemo_dcr.codec.bound import iid_bound_bytes, pooled_bound_bytes
from nemo_dcr.kernels import bits_view_np, xor_diff

LARGE = 1 << 16  # elements: "large" tensors in the payload/bound split
PUBLISHED = ["gap16+xor+zstd1", "gap32+xor+zstd1", "idx32+bf16 raw", "idx32+bf16+zstd", "dense xor+zstd"]


def _gap16(pos: np.ndarray) -> bytes:
    gaps = np.diff(pos, prepend=0).astype(np.int64)
    small = gaps < 0xFFFF
    if small.all():
        return gaps.astype("<u2").tobytes()
    out = bytearray()
    for g in gaps.tolist():  # escapes are rare; a loop over the whole tensor is not needed
        if g < 0xFFFF:
            out += int(g).to_bytes(2, "little")
        else:
            out += b"\xff\xff" + int(g).to_bytes(4, "little")
    return bytes(out)


def published_sizes(pos: np.ndarray, xor: np.ndarray, new_vals: np.ndarray, dense_xor: np.ndarray) -> dict[str, int]:
    z1 = zstandard.ZstdCompressor(level=1)
    z3 = zstandard.ZstdCompressor(level=3)
    vals = xor.astype(xor.dtype.newbyteorder("<")).tobytes()
    idx32 = pos.astype("<i4").tobytes() + new_vals.astype(new_vals.dtype.newbyteorder("<")).tobytes()
    return {
        "gap16+xor+zstd1": len(z1.compress(_gap16(pos) + vals)),
        "gap32+xor+zstd1": len(z1.compress(np.diff(pos, prepend=0).astype("<u4").tobytes() + vals)),
        "idx32+bf16 raw": len(idx32),
        "idx32+bf16+zstd": len(z3.compress(idx32)),
        "dense xor+zstd": len(z3.compress(dense_xor.tobytes())),
    }


def _cond_entropy_bits(ctx: np.ndarray, flag: np.ndarray, nctx: int) -> float:
    """n * H(flag | ctx) in bits, from joint counts."""
    joint = np.bincount(ctx.astype(np.int64) * 2 + flag, minlength=2 * nctx).reshape(nctx, 2).astype(np.float64)
    tot = joint.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(joint > 0, joint * np.log2(joint / np.where(tot > 0, tot, 1)), 0.0)
    return float(-terms.sum())


def flag_entropies(bits_base: np.ndarray, xor: np.ndarray, shape: tuple[int, ...], dtype: str) -> dict[str, float]:
    """Bits to code the flags: i.i.d., given (left, up) flags, given (left, up, base exponent)."""
    from nemo_dcr.codec.model import EXPONENT_FIELD

    f = (xor != 0).astype(np.int64)
    n = f.size
    left = np.zeros(n, np.int64)
    left[1:] = f[:-1]
    up = np.zeros(n, np.int64)
    row = shape[-1] if len(shape) >= 2 else 0
    if row:
        up[row:] = f[:-row]
    nb = left * 2 + up
    eshift, ebits = EXPONENT_FIELD.get(dtype, (0, 0))
    e = ((bits_base >> eshift) & ((1 << ebits) - 1)).astype(np.int64) if ebits else np.zeros(n, np.int64)
    return {"iid": _cond_entropy_bits(np.zeros(n, np.int64), f, 1), "neighbours": _cond_entropy_bits(nb, f, 4),
            "neighbours_exponent": _cond_entropy_bits(nb * 256 + e, f, 4 * 256)}


def _best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_pair(d: pathlib.Path, repeat: int) -> dict:
    base, target = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
    deltas, bits, records = [], {}, []
    pub = dict.fromkeys(PUBLISHED, 0)
    numel = nbytes = 0
    bound = 0.0
    tensor_bound: dict[str, float] = {}
    flags = {"iid": 0.0, "neighbours": 0.0, "neighbours_exponent": 0.0}
    for name in sorted(base):
        b, t = base[name].contiguous(), target[name].contiguous()
        diff = xor_diff(t, b)
        dtype = str(t.dtype).removeprefix("torch.")
        deltas.append(TensorDelta(name=name, dtype=dtype, shape=tuple(t.shape), op=DeltaOp.XOR,
                                  positions=diff.positions, values=diff.xor_values))
        bb, tb = bits_view_np(b), bits_view_np(t)
        bits[name] = bb
        n = bb.size
        numel += n
        nbytes += n * bb.itemsize
        tensor_bound[name] = iid_bound_bytes(n, diff.xor_values)
        bound += tensor_bound[name]
        records.append((n, diff.xor_values))
        dense = bb ^ tb
        for k, v in published_sizes(diff.positions, diff.xor_values, tb[diff.positions], dense).items():
            pub[k] += v
        for k, v in flag_entropies(bb, dense, tuple(t.shape), dtype).items():
            flags[k] += v / 8
    nnz = sum(x.nnz for x in deltas)
    row = {"pair": d.name, "numel": numel, "param_bytes": nbytes, "changed": nnz, "changed_pct": 100 * nnz / numel,
           "bound_bytes": bound, "pooled_bound_bytes": pooled_bound_bytes(records),
           **{f"flag_entropy_{k}_bytes": v for k, v in flags.items()}}
    for mode, base_map in (("free", None), ("context", bits)):
        t_enc, chunk = _best_time(lambda: encode_chunk(deltas, base=base_map), repeat)
        t_dec, dec = _best_time(lambda: decode_chunk(chunk, base=base_map), repeat)
        assert all(np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
                   for a, b in zip(deltas, dec.deltas))
        row[f"dcr_{mode}_bytes"] = len(chunk)
        recs = read_chunk_index(chunk).records
        row[f"dcr_{mode}_framing_bytes"] = len(chunk) - sum(r.payload_bytes for r in recs)
        # Payload vs bound split by tensor size: the bound's free per-tensor distribution is
        # worth most in small tensors.
        for part, keep in (("large", lambda r: r.element_range[1] - r.element_range[0] >= LARGE),
                           ("small", lambda r: r.element_range[1] - r.element_range[0] < LARGE)):
            sel = [r for r in recs if keep(r)]
            row[f"dcr_{mode}_{part}_tensors"] = len(sel)
            row[f"dcr_{mode}_{part}_payload_bytes"] = sum(r.payload_bytes for r in sel)
            row[f"{part}_bound_bytes"] = sum(tensor_bound[r.name] for r in sel)
        row[f"dcr_{mode}_encode_gbps"] = nbytes / t_enc / 1e9
        row[f"dcr_{mode}_decode_gbps"] = nbytes / t_dec / 1e9
    for k, v in pub.items():
        row[f"{k}_bytes"] = v
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["bound", "pooled", "dcr free", "dcr ctx"] + PUBLISHED
    print(f"{'pair':18s} {'chg%':>6s} " + " ".join(f"{c:>15s}" for c in cols) + "   enc/dec GB/s free | ctx")
    for r in rows:
        n = r["changed"]
        vals = [r["bound_bytes"], r["pooled_bound_bytes"], r["dcr_free_bytes"], r["dcr_context_bytes"]]
        vals += [r[f"{k}_bytes"] for k in PUBLISHED]
        print(f"{r['pair']:18s} {r['changed_pct']:6.2f} " + " ".join(f"{v / n:15.3f}" for v in vals)
              + f"   {r['dcr_free_encode_gbps']:.3f}/{r['dcr_free_decode_gbps']:.3f} | "
              f"{r['dcr_context_encode_gbps']:.3f}/{r['dcr_context_decode_gbps']:.3f}")
    print("\nratio to the per-tensor i.i.d. bound (whole chunk bytes, framing included):")
    for r in rows:
        b = r["bound_bytes"]
        print(f"{r['pair']:18s} free {r['dcr_free_bytes'] / b:.4f}x  context {r['dcr_context_bytes'] / b:.4f}x  "
              f"(vs pooled bound: free {r['dcr_free_bytes'] / r['pooled_bound_bytes']:.4f}x)  "
              f"gap16+zstd1 {r['gap16+xor+zstd1_bytes'] / b:.3f}x; framing {r['dcr_free_framing_bytes']} B "
              f"({r['dcr_free_framing_bytes'] / r['dcr_free_bytes']:.2%} of the chunk)")
    print(f"\ncontext-free payload / bound, tensors with >= {LARGE} elements | smaller tensors:")
    for r in rows:
        print(f"{r['pair']:18s} {r['dcr_free_large_payload_bytes'] / r['large_bound_bytes']:.4f}x "
              f"({r['dcr_free_large_tensors']} tensors) | {r['dcr_free_small_payload_bytes'] / r['small_bound_bytes']:.4f}x "
              f"({r['dcr_free_small_tensors']} tensors, {r['dcr_free_small_payload_bytes']} B vs bound "
              f"{r['small_bound_bytes']:.0f} B)")
    print("\nflag (changed/unchanged) entropy, bytes per changed element: i.i.d. | given left+up flags | "
          "given left+up flags and base exponent")
    for r in rows:
        n = r["changed"]
        iid = r["flag_entropy_iid_bytes"]
        print(f"{r['pair']:18s} {iid / n:.4f} | {r['flag_entropy_neighbours_bytes'] / n:.4f} "
              f"({r['flag_entropy_neighbours_bytes'] / iid - 1:+.2%}) | {r['flag_entropy_neighbours_exponent_bytes'] / n:.4f} "
              f"({r['flag_entropy_neighbours_exponent_bytes'] / iid - 1:+.2%});  flags are "
              f"{iid / r['bound_bytes']:.0%} of the bound")
    sel = [r for r in rows if 0.5 <= r["changed_pct"] <= 10.0]
    if sel:
        free = np.mean([r["dcr_free_bytes"] / r["bound_bytes"] for r in sel])
        ctx = np.mean([r["dcr_context_bytes"] / r["bound_bytes"] for r in sel])
        pooled = np.mean([r["dcr_free_bytes"] / r["pooled_bound_bytes"] for r in sel])
        print(f"\nmean over the {len(sel)} pairs with 0.5-10% changed: free {free:.4f}x, context {ctx:.4f}x the "
              f"per-tensor bound; free {pooled:.4f}x the pooled bound")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for src, marker in (("minilm", "o"), ("scratch", "s")):
        rs = sorted((r for r in rows if r["pair"].startswith(src)), key=lambda r: r["changed_pct"])
        if not rs:
            continue
        x = [r["changed_pct"] for r in rs]
        for key, label, style in [("bound_bytes", "i.i.d. bound", "k--"), ("dcr_free_bytes", "nemo_dcr", "C0-"),
                                  ("dcr_context_bytes", "nemo_dcr context", "C1-"),
                                  ("gap16+xor+zstd1_bytes", "gap16+xor+zstd1", "C2:"),
                                  ("idx32+bf16+zstd_bytes", "idx32+bf16+zstd", "C3:"),
                                  ("dense xor+zstd_bytes", "dense xor+zstd", "C4:")]:
            ax.plot(x, [r[key] / r["changed"] for r in rs], style, marker=marker,
                    label=f"{label} ({src})" if src == "minilm" else None)
    ax.set_xscale("log")
    ax.set_xlabel("changed elements (%)")
    ax.set_ylabel("bytes per changed element")
    ax.set_title("BF16 AdamW deltas (o: MiniLM fine-tune, s: from scratch)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="benchmarks/data")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats (best is kept)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    index = pathlib.Path(args.data) / "index.json"
    if not index.is_file():
        print(f"no {index}: run scripts/make_real_deltas.py first", file=sys.stderr)
        return 2
    pairs = json.loads(index.read_text())["pairs"]
    rows = []
    for p in pairs:
        rows.append(bench_pair(pathlib.Path(args.data) / p["dir"], args.repeat))
        print(f"  measured {p['dir']}", file=sys.stderr, flush=True)
    print_table(rows)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "scripts/bench_codec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()} {platform.processor()}".strip(), "python": platform.python_version(),
            "threads": args.threads}
    (out / "codec.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, out / "codec.png")
    print(f"\nwrote {out / 'codec.json'} and {out / 'codec.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
