"""Codec benchmark on real BF16 AdamW deltas: bytes per changed element AND speed, for every format.

For every (base, target) pair made by ``scripts/make_real_deltas.py`` it measures, for this
codec in both modes and for the published formats modelled end to end on CPU: bytes per
changed element, the ratio to the per-tensor i.i.d. entropy bound, and encode / decode speed.

Formats (the published ones applied per tensor and summed; no names, shapes or checksums,
which nemo_dcr's whole-chunk bytes do include):

  nemo_dcr          encode_chunk / decode_chunk, context-free, default codings
  nemo_dcr context  the same with the base bits (context mode)
  bucket, lanes     encode_chunk(codings=[BUCKET]) resp. [LANES] (coding 4: adaptive rANS,
                    state shared along the chunk; 5: static per-record tables, 16 rANS lanes),
                    context-free and (`... context`) context mode; the raw codings stay
                    candidates per record
  gap16+xor+zstd1   NeMo-RL's format as described: a u32 count, the gaps between changed
                    positions as u16 (a gap >= 0xFFFF is written 0xFFFF then the gap as a
                    u32), then the XOR values; zstd level 1.  The count is 4 bytes per
                    tensor the description leaves out: without it a decoder cannot tell
                    where the gaps end.
  gap32+xor+zstd1   the same with u32 gaps (no count needed: 6 bytes per change raw)
  idx32+bf16 raw    int32 flat index + the new 16-bit value: 6 bytes per change
  idx32+bf16+zstd   the same, zstd level 3
  dense xor+zstd    the dense XOR mask (zeros included), zstd level 3

Speed is GB/s of the model's parameter bytes (numel x element size) on one thread
(``torch.set_num_threads(1)``, zstd without worker threads), best of ``--repeat`` rounds
that interleave the formats.  Every format starts where nemo_dcr's encoder starts, the
XOR diff's (positions, XOR values) lists (the diff itself is ``scripts/bench_xor.py``'s),
or (positions, new values) for the idx32 formats:

  encode  build the format's byte layout (gaps, escapes, casts; for dense, scatter into a
          zeroed mask) and zstd-compress it
  decode  zstd-decompress and rebuild int64 positions + u16 values (cumsum of gaps, the
          gap16 escapes resolved without a loop over the gaps); for dense the output is the
          u16 mask itself, which its receiver XORs in whole (no positions needed)

After the timed rounds every decoded array is compared with the input (dtype and
``np.array_equal`` on integer arrays); a mismatch raises, so a broken decoder fails the run.

It also prints how much the changed/unchanged flags' entropy drops when conditioned on
what a context-free decoder knows (the previous element's and the element-one-row-up's
flags) and on what a context-mode decoder also knows (the base element's exponent): the
flags are about 3/4 of the bound, so this says which mode can beat the i.i.d. bound.

Saves benchmarks/results/codec.json (per pair: the flat ``<format>_bytes`` /
``dcr_<mode>_*`` keys, ``<format>_encode_gbps`` / ``_decode_gbps`` and a ``formats``
table; a ``summary`` over the pairs with 0.5-3% changed) and codec.png (trade-off panel:
decode GB/s vs bytes per changed element; bytes panel: bytes per changed element vs
change rate).

    .venv/bin/python scripts/bench_codec.py [--data benchmarks/data] [--repeat 3]
    .venv/bin/python scripts/bench_codec.py --pairs 'minilm_lr1e-06' --repeat 1 --out /tmp/codec
    .venv/bin/python scripts/bench_codec.py --replot     # redraw codec.png from codec.json
    .venv/bin/python scripts/bench_codec.py --records 12 --pairs 'minilm_lr1e-06'   # BUCKET vs LANES per record
    .venv/bin/python scripts/bench_codec.py --simd avx2 --out /tmp/codec_avx2   # as on a CPU without AVX-512
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file

from nemo_dcr import dtypes
from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, bucket, decode_chunk, encode_chunk, read_chunk_index
from nemo_dcr.codec.bound import iid_bound_bytes, pooled_bound_bytes
from nemo_dcr.kernels import bits_view_np, xor_diff

LARGE = 1 << 16  # elements: "large" tensors in the payload/bound split
PUBLISHED = ["gap16+xor+zstd1", "gap32+xor+zstd1", "idx32+bf16 raw", "idx32+bf16+zstd", "dense xor+zstd"]
DCR = {"nemo_dcr": "free", "nemo_dcr context": "context",  # format label -> mode key in the flat JSON
       "bucket": "bucket_free", "bucket context": "bucket_context",
       "lanes": "lanes_free", "lanes context": "lanes_context"}
#: The entropy codings each nemo_dcr row may use (None: the encoder's default, ``payload.default_codings``);
#: the bucket / lanes rows pin one coding (BUCKET: 4, adaptive; LANES: 5, static tables, 16 lanes).
DCR_CODINGS = {"nemo_dcr": None, "nemo_dcr context": None, "bucket": [Coding.BUCKET], "bucket context": [Coding.BUCKET],
               "lanes": [Coding.LANES], "lanes context": [Coding.LANES]}
FORMATS = list(DCR) + PUBLISHED
SUMMARY_PCT = (0.5, 3.0)  # change rates (%) the summary averages over
U16_ESCAPE = 0xFFFF


# ---- published formats: one tensor's (positions, values) <-> payload ---------------------------
# Hot path: every function below is O(nnz) numpy passes (dense: O(numel)) plus one zstd call;
# memory traffic is the layout buffer written once and read once by zstd.

def _zc(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, threads=0)  # threads=0: no zstd worker threads


def _gaps(pos: np.ndarray) -> np.ndarray:
    """Gaps between sorted positions, the first from 0; they must fit a u32."""
    gaps = np.diff(pos, prepend=0)
    if gaps.size and int(gaps.max()) >= 1 << 32:
        raise ValueError("a gap does not fit a u32: these layouts cover tensors of < 2^32 elements")
    return gaps


def gap16_layout(pos: np.ndarray, xor: np.ndarray) -> np.ndarray:
    """u16 words: count (u32 as two words), gaps with escapes, then the XOR values."""
    n = pos.size
    gaps = _gaps(pos)
    esc = gaps >= U16_ESCAPE
    ne = int(np.count_nonzero(esc))
    buf = np.empty(2 + n + 2 * ne + n, dtype="<u2")
    buf[0], buf[1] = n & 0xFFFF, n >> 16
    words = buf[2 : 2 + n + 2 * ne]
    if ne == 0:
        words[:] = gaps
    else:  # each gap takes 1 word, an escaped one 3: marker, low half, high half (a LE u32)
        width = 1 + 2 * esc.astype(np.int64)
        start = np.cumsum(width) - width
        words[start] = np.where(esc, U16_ESCAPE, gaps)
        s, g = start[esc], gaps[esc]
        words[s + 1] = g & 0xFFFF
        words[s + 2] = g >> 16
    buf[2 + n + 2 * ne :] = xor
    return buf


def gap16_parse(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``gap16_layout`` on its u16 words: (int64 positions, u16 values).

    A 0xFFFF word is an escape marker unless it is one of the two payload words of a marker
    one or two words before it (a payload half can be 0xFFFF).  A candidate with no other
    candidate in the two words before it is therefore a marker; only clustered candidates
    (rare: at most two per escape) are resolved in order.  No loop over the gaps."""
    if w.size < 2:
        raise ValueError("gap16 payload shorter than its count")
    n = int(w[0]) | int(w[1]) << 16
    if w.size < 2 + 2 * n or (w.size - 2 - 2 * n) % 2:
        raise ValueError("gap16 payload length does not fit its count")
    gw, vals = w[2 : w.size - n], w[w.size - n :]
    if gw.size == n:
        gaps = gw.astype(np.int64)
    else:
        cand = np.flatnonzero(gw == U16_ESCAPE)
        real = np.ones(cand.size, dtype=bool)
        for j in (np.flatnonzero(np.diff(cand) <= 2) + 1).tolist():
            i = j - 1
            while i >= 0 and cand[j] - cand[i] <= 2:
                if real[i]:
                    real[j] = False
                    break
                i -= 1
        markers = cand[real]
        if markers.size and int(markers[-1]) + 2 >= gw.size:
            raise ValueError("gap16 escape runs past the gaps")
        start = np.ones(gw.size, dtype=bool)
        start[markers + 1] = False
        start[markers + 2] = False
        gaps = gw[start].astype(np.int64)
        rank = np.cumsum(start)[markers] - 1
        gaps[rank] = gw[markers + 1].astype(np.int64) | gw[markers + 2].astype(np.int64) << 16
    if gaps.size != n:
        raise ValueError(f"gap16 payload holds {gaps.size} gaps, its count says {n}")
    return np.cumsum(gaps), vals


def _pos_val_layout(a: np.ndarray, a_dtype: str, vals: np.ndarray) -> np.ndarray:
    """``a`` as ``a_dtype`` (4 bytes) then ``vals`` as u16, in one byte buffer."""
    n = a.size
    buf = np.empty(6 * n, dtype=np.uint8)
    buf[: 4 * n].view(a_dtype)[:] = a
    buf[4 * n :].view("<u2")[:] = vals
    return buf


def _split6(raw, a_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    if len(raw) % 6:
        raise ValueError("payload is not 6 bytes per change")
    n = len(raw) // 6
    return np.frombuffer(raw, a_dtype, n), np.frombuffer(raw, "<u2", n, offset=4 * n)


@dataclass(frozen=True)
class TensorInput:
    """What every format starts from: one tensor's diff output (and the new values)."""
    numel: int
    positions: np.ndarray  # int64, sorted
    xor: np.ndarray  # u16 XOR values at positions
    new: np.ndarray  # u16 new bits at positions


@dataclass(frozen=True)
class Published:
    """A published format: encode one tensor to its payload, decode it back to arrays.
    ``values`` says which input array the decoded values must equal ("xor" or "new");
    ``dense`` formats decode to the whole u16 XOR mask instead of (positions, values)."""
    encode: Callable[[TensorInput], object]
    decode: Callable[[object, int], tuple[np.ndarray, ...]]
    values: str = "xor"
    dense: bool = False


def make_published() -> dict[str, Published]:
    z1, z3, zd = _zc(1), _zc(3), zstandard.ZstdDecompressor()

    def dense_enc(t: TensorInput) -> bytes:
        mask = np.zeros(t.numel, dtype="<u2")
        mask[t.positions] = t.xor
        return z3.compress(mask)

    def gap32_dec(p, numel):
        g, v = _split6(zd.decompress(p), "<u4")
        return np.cumsum(g, dtype=np.int64), v

    def idx32_dec(raw):
        i, v = _split6(raw, "<i4")
        return i.astype(np.int64), v

    return {
        "gap16+xor+zstd1": Published(lambda t: z1.compress(gap16_layout(t.positions, t.xor)),
                                     lambda p, numel: gap16_parse(np.frombuffer(zd.decompress(p), "<u2"))),
        "gap32+xor+zstd1": Published(lambda t: z1.compress(_pos_val_layout(_gaps(t.positions), "<u4", t.xor)),
                                     gap32_dec),
        "idx32+bf16 raw": Published(lambda t: _pos_val_layout(_idx32(t), "<i4", t.new),
                                    lambda p, numel: idx32_dec(p), values="new"),
        "idx32+bf16+zstd": Published(lambda t: z3.compress(_pos_val_layout(_idx32(t), "<i4", t.new)),
                                     lambda p, numel: idx32_dec(zd.decompress(p)), values="new"),
        "dense xor+zstd": Published(dense_enc, lambda p, numel: (np.frombuffer(zd.decompress(p), "<u2", numel),),
                                    dense=True),
    }


def _idx32(t: TensorInput) -> np.ndarray:
    if t.numel > 1 << 31:
        raise ValueError("idx32 layouts cover tensors of <= 2^31 elements")
    return t.positions


def _nbytes(payload) -> int:
    return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)


def check_published(fmt: Published, inputs: list[TensorInput], decoded: list[tuple[np.ndarray, ...]],
                    name: str) -> None:
    """Raise unless every decoded array equals the input, integer view and dtype."""
    for t, out in zip(inputs, decoded, strict=True):
        if fmt.dense:
            want = np.zeros(t.numel, dtype=np.uint16)
            want[t.positions] = t.xor
            pairs = [(out[0], want)]
        else:
            pairs = [(out[0], t.positions), (out[1], getattr(t, fmt.values))]
        for got_a, want_a in pairs:
            if got_a.dtype.kind != want_a.dtype.kind or got_a.itemsize != want_a.itemsize \
                    or not np.array_equal(got_a, want_a):
                raise RuntimeError(f"{name}: decoded arrays differ from the input")


def check_dcr(deltas: list[TensorDelta], dec, name: str) -> None:
    if len(dec.deltas) != len(deltas):
        raise RuntimeError(f"{name}: decoded {len(dec.deltas)} records, encoded {len(deltas)}")
    for a, b in zip(deltas, dec.deltas):
        for x, y in ((a.positions, b.positions), (a.values, b.values)):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                raise RuntimeError(f"{name}: decoded record {a.name} differs from the input")


# ---- flag entropies ------------------------------------------------------------------------------

def _cond_entropy_bits(ctx: np.ndarray, flag: np.ndarray, nctx: int) -> float:
    """n * H(flag | ctx) in bits, from joint counts."""
    joint = np.bincount(ctx.astype(np.int64) * 2 + flag, minlength=2 * nctx).reshape(nctx, 2).astype(np.float64)
    tot = joint.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(joint > 0, joint * np.log2(joint / np.where(tot > 0, tot, 1)), 0.0)
    return float(-terms.sum())


def flag_entropies(bits_base: np.ndarray, xor: np.ndarray, shape: tuple[int, ...], dtype: str) -> dict[str, float]:
    """Bits to code the flags: i.i.d., given (left, up) flags, given (left, up, base exponent)."""
    f = (xor != 0).astype(np.int64)
    n = f.size
    left = np.zeros(n, np.int64)
    left[1:] = f[:-1]
    up = np.zeros(n, np.int64)
    row = shape[-1] if len(shape) >= 2 else 0
    if row:
        up[row:] = f[:-row]
    nb = left * 2 + up
    # (shift, width) of the exponent field (integers: none), for the flag-entropy context only
    d = dtypes.DTYPES.get(dtype)
    eshift, ebits = (d.exponent if d is not None else None) or (0, 0)
    e = ((bits_base >> eshift) & ((1 << ebits) - 1)).astype(np.int64) if ebits else np.zeros(n, np.int64)
    return {"iid": _cond_entropy_bits(np.zeros(n, np.int64), f, 1), "neighbours": _cond_entropy_bits(nb, f, 4),
            "neighbours_exponent": _cond_entropy_bits(nb * 256 + e, f, 4 * 256)}


# ---- one pair ------------------------------------------------------------------------------------

#: The clock the timed rounds read: wall (time.perf_counter) or this process's CPU time
#: (time.process_time: steadier on a shared machine; every timed call runs on one thread).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
#: --simd -> _crans.set_simd level
SIMD_LEVELS = {"best": 2, "avx2": 1, "scalar": 0}
_clock = time.perf_counter


def _timed(fn) -> tuple[float, object]:
    t0 = _clock()
    out = fn()
    return _clock() - t0, out


def bench_pair(d: pathlib.Path, repeat: int) -> dict:
    base, target = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
    deltas, bits, records, inputs = [], {}, [], []
    numel = nbytes = 0
    bound = 0.0
    tensor_bound: dict[str, float] = {}
    flags = {"iid": 0.0, "neighbours": 0.0, "neighbours_exponent": 0.0}
    for name in sorted(base):
        b, t = base[name].contiguous(), target[name].contiguous()
        diff = xor_diff(t, b)
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != "bfloat16":
            raise ValueError(f"{d.name}/{name} is {dtype}: the published layouts modelled here carry 16-bit values")
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
        inputs.append(TensorInput(numel=n, positions=diff.positions, xor=diff.xor_values,
                                  new=np.ascontiguousarray(tb[diff.positions])))
        for k, v in flag_entropies(bb, bb ^ tb, tuple(t.shape), dtype).items():
            flags[k] += v / 8
    nnz = sum(x.nnz for x in deltas)
    row = {"pair": d.name, "numel": numel, "param_bytes": nbytes, "changed": nnz, "changed_pct": 100 * nnz / numel,
           "bound_bytes": bound, "pooled_bound_bytes": pooled_bound_bytes(records),
           **{f"flag_entropy_{k}_bytes": v for k, v in flags.items()}}

    # Timed rounds, formats interleaved so that load drifting on a shared machine hits all alike.
    published = make_published()
    enc_fns: dict[str, Callable[[], object]] = {
        **{k: (lambda k=k: encode_chunk(deltas, base=bits if k.endswith("context") else None, codings=DCR_CODINGS[k]))
           for k in DCR},
        **{k: (lambda f=f: [f.encode(t) for t in inputs]) for k, f in published.items()}}
    dec_fns: dict[str, Callable[[object], object]] = {
        **{k: (lambda c, k=k: decode_chunk(c, base=bits if k.endswith("context") else None)) for k in DCR},
        **{k: (lambda ps, f=f: [f.decode(p, t.numel) for p, t in zip(ps, inputs)]) for k, f in published.items()}}
    t_enc = {k: [] for k in FORMATS}
    t_dec = {k: [] for k in FORMATS}
    encoded, decoded = {}, {}
    for _ in range(repeat):
        for k in FORMATS:
            dt, encoded[k] = _timed(enc_fns[k])
            t_enc[k].append(dt)
            dt, decoded[k] = _timed(lambda: dec_fns[k](encoded[k]))
            t_dec[k].append(dt)
    for k, f in published.items():
        check_published(f, inputs, decoded[k], k)
    for k in DCR:
        check_dcr(deltas, decoded[k], k)

    for label, mode in DCR.items():
        chunk = encoded[label]
        row[f"dcr_{mode}_bytes"] = len(chunk)
        recs = read_chunk_index(chunk).records
        row[f"dcr_{mode}_framing_bytes"] = len(chunk) - sum(r.payload_bytes for r in recs)
        row[f"dcr_{mode}_records_by_coding"] = {c.name: sum(r.coding is c for r in recs)
                                                 for c in Coding if any(r.coding is c for r in recs)}
        # Payload vs bound split by tensor size: the bound's free per-tensor distribution is
        # worth most in small tensors.
        for part, keep in (("large", lambda r: r.element_range[1] - r.element_range[0] >= LARGE),
                           ("small", lambda r: r.element_range[1] - r.element_range[0] < LARGE)):
            sel = [r for r in recs if keep(r)]
            row[f"dcr_{mode}_{part}_tensors"] = len(sel)
            row[f"dcr_{mode}_{part}_payload_bytes"] = sum(r.payload_bytes for r in sel)
            row[f"{part}_bound_bytes"] = sum(tensor_bound[r.name] for r in sel)
    for k in PUBLISHED:
        row[f"{k}_bytes"] = sum(_nbytes(p) for p in encoded[k])
    row["formats"] = {}
    for k in FORMATS:
        key = f"dcr_{DCR[k]}" if k in DCR else k
        size = row[f"{key}_bytes"]
        enc, dec = nbytes / min(t_enc[k]) / 1e9, nbytes / min(t_dec[k]) / 1e9
        row[f"{key}_encode_gbps"], row[f"{key}_decode_gbps"] = enc, dec
        row["formats"][k] = {"bytes": size, "bytes_per_changed": size / nnz, "x_bound": size / bound,
                             "encode_gbps": enc, "decode_gbps": dec,
                             "encode_gbps_median": nbytes / statistics.median(t_enc[k]) / 1e9,
                             "decode_gbps_median": nbytes / statistics.median(t_dec[k]) / 1e9}
    return row


def bench_records(d: pathlib.Path, largest: int, repeat: int) -> None:
    """BUCKET against LANES record by record on the ``largest`` tensors of a pair: each record
    coded alone (BUCKET from a fresh state), both modes, rounds interleaved; prints the sums.
    Checks every decoded record as integer arrays."""
    from nemo_dcr.codec import lanes
    from nemo_dcr.codec.model import ModelStates
    from nemo_dcr.codec.payload import RecordSpec

    base, target = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
    names = sorted(base, key=lambda n: -base[n].numel())[:largest]
    tot: dict[tuple[str, str], list[float]] = {}
    nbytes = 0
    for name in names:
        b, t = base[name].contiguous(), target[name].contiguous()
        diff = xor_diff(t, b)
        bb = bits_view_np(b)
        nbytes += bb.nbytes
        spec = RecordSpec(dtype="bfloat16", shape=(bb.size,), op=DeltaOp.XOR, lo=0, hi=bb.size, nnz=diff.positions.size)
        for mode, base_ in (("context", bb), ("free", None)):
            best = {c: [float("inf"), float("inf"), 0] for c in ("BUCKET", "LANES")}
            for _ in range(repeat):
                t0 = _clock()
                pb, e_lo, _ = bucket.encode(spec, diff.positions, diff.xor_values, base_, ModelStates())
                t1 = _clock()
                sb = dataclasses.replace(spec, param=e_lo)
                got_b = bucket.decode(sb, memoryview(pb), base_, ModelStates())
                t2 = _clock()
                pl, e_lo = lanes.encode(spec, diff.positions, diff.xor_values, base_)
                t3 = _clock()
                got_l = lanes.decode(dataclasses.replace(spec, param=e_lo), memoryview(pl), base_)
                t4 = _clock()
                for c, enc, dec, size in (("BUCKET", t1 - t0, t2 - t1, len(pb)), ("LANES", t3 - t2, t4 - t3, len(pl))):
                    best[c] = [min(best[c][0], enc), min(best[c][1], dec), size]
                for pos, val in (got_b, got_l):
                    if not (np.array_equal(pos, diff.positions) and np.array_equal(val.view(np.int16),
                                                                                diff.xor_values.view(np.int16))):
                        raise RuntimeError(f"{name}: a record did not decode to its input")
            for c, v in best.items():
                acc = tot.setdefault((mode, c), [0.0, 0.0, 0])
                for i in range(3):
                    acc[i] += v[i]
    print(f"{d.name}: the {len(names)} largest tensors ({nbytes / 1e6:.1f} MB), each record alone, best of {repeat}")
    print(f"{'mode':8s} {'coding':7s} {'bytes':>10s} {'enc GB/s':>9s} {'dec GB/s':>9s}")
    for (mode, c), (enc, dec, size) in sorted(tot.items()):
        print(f"{mode:8s} {c:7s} {int(size):10d} {nbytes / enc / 1e9:9.2f} {nbytes / dec / 1e9:9.2f}")


def summarize(rows: list[dict]) -> dict:
    lo, hi = SUMMARY_PCT
    sel = [r for r in rows if lo <= r["changed_pct"] <= hi]
    out = {"changed_pct_range": [lo, hi], "pairs": [r["pair"] for r in sel], "formats": {}}
    if sel:
        for k in FORMATS:
            out["formats"][k] = {m: float(np.mean([r["formats"][k][m] for r in sel]))
                                 for m in ("bytes_per_changed", "x_bound", "encode_gbps", "decode_gbps")}
    return out


# ---- report --------------------------------------------------------------------------------------

def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'pair':16s} {'chg%':>5s}  {'format':17s} {'B/changed':>9s} {'x bound':>8s} {'enc GB/s':>9s} "
          f"{'dec GB/s':>9s}")
    for r in rows:
        n = r["changed"]
        print(f"{r['pair']:16s} {r['changed_pct']:5.2f}  {'i.i.d. bound':17s} {r['bound_bytes'] / n:9.3f} "
              f"{1.0:8.3f} {'':>9s} {'':>9s}")
        print(f"{'':16s} {'':5s}  {'pooled bound':17s} {r['pooled_bound_bytes'] / n:9.3f} "
              f"{r['pooled_bound_bytes'] / r['bound_bytes']:8.3f}")
        for k in FORMATS:
            f = r["formats"][k]
            print(f"{'':16s} {'':5s}  {k:17s} {f['bytes_per_changed']:9.3f} {f['x_bound']:8.3f} "
                  f"{f['encode_gbps']:9.3f} {f['decode_gbps']:9.3f}")
    lo, hi = summary["changed_pct_range"]
    if summary["pairs"]:
        print(f"\nmean over the {len(summary['pairs'])} pairs with {lo}-{hi}% changed "
              f"({', '.join(summary['pairs'])}):")
        print(f"{'format':17s} {'B/changed':>9s} {'x bound':>8s} {'enc GB/s':>9s} {'dec GB/s':>9s}")
        for k, f in summary["formats"].items():
            print(f"{k:17s} {f['bytes_per_changed']:9.3f} {f['x_bound']:8.3f} {f['encode_gbps']:9.3f} "
                  f"{f['decode_gbps']:9.3f}")
    else:
        print(f"\nno pair with {lo}-{hi}% changed: no summary")

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


STYLE = {"nemo_dcr": ("C0", "o"), "nemo_dcr context": ("C1", "o"), "bucket": ("C8", "v"),
         "bucket context": ("C9", "v"), "lanes": ("C6", "P"), "lanes context": ("k", "P"), "gap16+xor+zstd1": ("C2", "s"),
         "gap32+xor+zstd1": ("C5", "s"), "idx32+bf16 raw": ("C7", "D"), "idx32+bf16+zstd": ("C3", "D"),
         "dense xor+zstd": ("C4", "^")}


def plot(rows: list[dict], summary: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    # Trade-off: every pair as a small point, the mean over the summary pairs as a large one.
    sel = set(summary["pairs"])
    for k in FORMATS:
        color, marker = STYLE[k]
        pts = [(r["formats"][k]["decode_gbps"], r["formats"][k]["bytes_per_changed"]) for r in rows]
        ax.scatter(*zip(*pts), color=color, marker=marker, s=14, alpha=0.35)
        if sel:
            f = summary["formats"][k]
            ax.scatter(f["decode_gbps"], f["bytes_per_changed"], color=color, marker=marker, s=90,
                       edgecolor="k", label=f"{k} (enc {f['encode_gbps']:.2f} GB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_yticks([0.5, 0.7, 1, 1.5, 2, 3, 4, 6], ["0.5", "0.7", "1", "1.5", "2", "3", "4", "6"])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("decode GB/s of parameter bytes, one core")
    ax.set_ylabel("bytes per changed element")
    lo, hi = summary["changed_pct_range"]
    ax.set_title(f"trade-off (large: mean of {len(sel)} pairs with {lo}-{hi}% changed; small: each pair)",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

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
            ax2.plot(x, [r[key] / r["changed"] for r in rs], style, marker=marker,
                     label=f"{label} ({src})" if src == "minilm" else None)
    ax2.set_xscale("log")
    ax2.set_xlabel("changed elements (%)")
    ax2.set_ylabel("bytes per changed element")
    ax2.set_title("BF16 AdamW deltas (o: MiniLM fine-tune, s: from scratch)", fontsize=9)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select_pairs(pairs: list[dict], patterns: list[str] | None) -> list[dict]:
    if not patterns:
        return pairs
    sel = [p for p in pairs if any(fnmatch.fnmatchcase(p["tag"], pat) for pat in patterns)]
    if not sel:
        raise ValueError(f"--pairs {patterns} matches none of {[p['tag'] for p in pairs]}")
    return sel


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="benchmarks/data")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeat", type=int, default=3, help="timing rounds (best is kept; the median is in the JSON)")
    ap.add_argument("--pairs", nargs="+", metavar="TAG",
                    help="only these pairs (fnmatch patterns on the index tags, e.g. 'minilm_*'); "
                         "the results written are then for those pairs only")
    ap.add_argument("--replot", action="store_true", help="only redraw codec.png from the codec.json in --out")
    ap.add_argument("--records", type=int, metavar="N",
                    help="instead: BUCKET vs LANES record by record on each pair's N largest tensors (prints only)")
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="wall time, or this process's CPU time (steadier on a shared, loaded machine)")
    ap.add_argument("--simd", choices=sorted(SIMD_LEVELS), default="best",
                    help="the native coders' CPU paths: the best this CPU has, at most AVX2 (as on a CPU "
                         "without AVX-512), or scalar; every path writes the same bytes")
    args = ap.parse_args(argv)
    if bucket.available():
        bucket._crans.set_simd(SIMD_LEVELS[args.simd])
    global _clock
    _clock = CLOCK[args.clock]
    out = pathlib.Path(args.out)
    if args.replot:
        saved = json.loads((out / "codec.json").read_text())
        plot(saved["rows"], saved["summary"], out / "codec.png")
        print(f"wrote {out / 'codec.png'}")
        return 0
    torch.set_num_threads(1)
    index = pathlib.Path(args.data) / "index.json"
    if not index.is_file():
        print(f"no {index}: run scripts/make_real_deltas.py first", file=sys.stderr)
        return 2
    try:
        pairs = select_pairs(json.loads(index.read_text())["pairs"], args.pairs)
    except ValueError as e:
        print(f"bench_codec: {e}", file=sys.stderr)
        return 2
    if args.records:
        for p in pairs:
            bench_records(pathlib.Path(args.data) / p["dir"], args.records, args.repeat)
        return 0
    load0 = os.getloadavg()[0]
    rows = []
    for p in pairs:
        rows.append(bench_pair(pathlib.Path(args.data) / p["dir"], args.repeat))
        print(f"  measured {p['dir']}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    print_table(rows, summary)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "scripts/bench_codec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()} {platform.processor()}".strip(), "python": platform.python_version(),
            "cpu_model": _cpu_model(), "bucket_simd": bucket.simd(), "clock": args.clock,
            "cpus": os.cpu_count(), "threads": 1, "zstandard": zstandard.__version__, "repeat": args.repeat,
            "load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "formats": FORMATS,
            "speed_unit": "GB/s of parameter bytes (numel x element size), one thread, best of repeat"}
    (out / "codec.json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=2) + "\n")
    plot(rows, summary, out / "codec.png")
    print(f"\nwrote {out / 'codec.json'} and {out / 'codec.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
