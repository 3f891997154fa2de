"""`nemo-dcr delta {encode,apply,inspect}`: standalone delta files between safetensors.

    nemo-dcr delta encode --base A.safetensors --target B.safetensors --out D.dcr [--context]
    nemo-dcr delta apply  --base A.safetensors --delta D.dcr --out C.safetensors
    nemo-dcr delta inspect D.dcr [--base A.safetensors] [--json]

A delta file is one v1 chunk.  Its metadata records the digest of the base it was made
against and of the target it produces; ``apply`` refuses a different base and verifies the
result before writing, and writes nothing on any error (the output appears atomically).
A delta file is untrusted input: ``apply`` (and ``inspect --base``) admit its records
against the base's tensors before decoding any payload.  ``inspect`` reports the table and
totals from the record headers; only the i.i.d. bound needs the XOR values, so it decodes
the records one at a time (``stream_chunk``), folds each into the report and drops it, and
skips (bound n/a, with the reason) a record declaring more than ``--max-decode`` changed
elements (default 2**24), and any later record that continues its coder state: memory is
one record's arrays at most (``nnz * (8 + width)`` bytes), whatever the file claims.
``--out`` may not name an input.
Errors are one line on stderr (no traceback): exit 2 for bad input (arguments; a file that
is missing, unreadable, corrupt, hostile or not the delta's base), 1 when the output cannot
be written.  Output cut short by its reader (``inspect --json | head -1``) ends quietly, exit
status 141 (a shell's for SIGPIPE).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Mapping

import numpy as np

from nemo_dcr import dtypes
from nemo_dcr.codec.admit import DecodeBudget
from nemo_dcr.codec.apply import apply_delta_
from nemo_dcr.codec.bound import iid_bound_bytes
from nemo_dcr.codec.chunk import RecordInfo, decode_chunk, read_chunk_index, stream_chunk
from nemo_dcr.codec.encode import encode_chunk
from nemo_dcr.codec.types import DeltaOp, TensorDelta
from nemo_dcr.errors import DcrError, ValidationError

META_FORMAT = "nemo-dcr delta file v1"

#: ``inspect --max-decode`` default: most changed elements a record may declare and still be
#: decoded for the i.i.d. bound.  Records decode one at a time, so this bounds inspect's
#: memory: 2**24 entries are 160 MiB of bf16 positions and values, 256 MiB of int64 ones.
INSPECT_MAX_DECODE = 1 << 24


class DeltaCliError(ValidationError):
    """A user-facing refusal (wrong base, mismatched or unreadable files): printed without a
    traceback, exit status 2."""


class DeltaUsageError(DeltaCliError):
    """Arguments that cannot be run as given (exit status 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="delta_cmd", required=True)
    enc = sub.add_parser("encode", help="encode target - base as a delta file")
    enc.add_argument("--base", required=True, help="base .safetensors")
    enc.add_argument("--target", required=True, help="target .safetensors (same tensor names, dtypes, shapes)")
    enc.add_argument("--out", required=True, help="delta file to write")
    enc.add_argument("--context", action="store_true",
                     help="context mode: condition on the base bits (smaller; apply needs the same base anyway)")
    app = sub.add_parser("apply", help="apply a delta file to its base")
    app.add_argument("--base", required=True)
    app.add_argument("--delta", required=True)
    app.add_argument("--out", required=True, help=".safetensors to write (atomically)")
    ins = sub.add_parser("inspect", help="list a delta file's records, sizes and entropy bound")
    ins.add_argument("delta")
    ins.add_argument("--base", help="base .safetensors, needed to decode context-mode records for the bound")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ins.add_argument("--max-decode", type=int, default=INSPECT_MAX_DECODE, metavar="N",
                     help="decode a record (for its bound) only if it declares at most N changed elements; "
                          f"records are decoded one at a time (default {INSPECT_MAX_DECODE})")


def main(args: argparse.Namespace) -> int:
    """Run one sub-command; every error is one line on stderr (no traceback)."""
    try:
        if args.delta_cmd == "encode":
            return _encode(args)
        if args.delta_cmd == "apply":
            return _apply(args)
        if args.delta_cmd == "inspect":
            return _inspect(args)
    except BrokenPipeError:
        from nemo_dcr.cli import quiet_stdout, stdout_broken

        if not stdout_broken():
            return _error(args, OSError("broken pipe"), 1)
        return quiet_stdout()  # the reader went away (`inspect --json | head -1`): stop quietly
    except DcrError as e:
        # Bad input: arguments, and files that are missing or unreadable (read through
        # ``_read``/``_load``, which raise DeltaCliError), malformed or hostile chunks
        # (FormatError), refusals (wrong base) and tensors the encoder cannot carry.
        return _error(args, e, 2)
    except OSError as e:  # inputs are read above; what is left is writing the output
        return _error(args, e, 1)
    raise AssertionError(args.delta_cmd)


def _error(args: argparse.Namespace, e: BaseException, code: int) -> int:
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"nemo-dcr delta {args.delta_cmd}: error: {msg}", file=sys.stderr)
    return code


# ----------------------------------------------------------------------------- files

def _read(path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise DeltaCliError(f"cannot read {path}: {e.strerror or e}") from None


def _load(path: str):
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # safetensors raises several types for unreadable files
        raise DeltaCliError(f"cannot read {path}: {e}") from None


def _dtype_name(t) -> str:
    try:
        return dtypes.from_torch(t.dtype).name
    except ValidationError:
        raise DeltaCliError(f"unsupported dtype {str(t.dtype).removeprefix('torch.')}") from None


def _bits(tensors) -> dict[str, np.ndarray]:
    from nemo_dcr.kernels import bits_view_np

    return {k: bits_view_np(t.contiguous()) for k, t in tensors.items()}


def state_digest(tensors) -> str:
    """sha256 over (name, dtype, shape, bits) of every tensor, in name order."""
    h = hashlib.sha256()
    bits = _bits(tensors)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{_dtype_name(t)}\0{tuple(t.shape)}\0".encode())
        h.update(np.ascontiguousarray(bits[name]).view(np.uint8).data)
    return "sha256:" + h.hexdigest()


def _check_out(out: str, **inputs: str) -> None:
    """``--out`` must not name an input: the atomic rename would replace it."""
    o = os.path.realpath(out)
    for flag, path in inputs.items():
        same = os.path.realpath(path) == o
        if not same and os.path.exists(out) and os.path.exists(path):
            same = os.path.samefile(out, path)  # hard links, other mounts of the same file
        if same:
            raise DeltaUsageError(f"--out {out} is the same file as --{flag} {path}; refusing to overwrite an input")


def _expect(tensors) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a delta for ``tensors`` may name: ``decode_chunk``'s ``expect``."""
    return {k: (_dtype_name(t), tuple(t.shape)) for k, t in tensors.items()}


def _write_atomic(path: str, write) -> None:
    """``write(tmp_path)``, then rename over ``path``: readers see the old file or the new one."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".nemo-dcr-", dir=d)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- commands

def _encode(args) -> int:
    from nemo_dcr.kernels import xor_diff

    _check_out(args.out, base=args.base, target=args.target)
    base, target = _load(args.base), _load(args.target)
    if set(base) != set(target):
        raise DeltaCliError(f"base and target hold different tensors: {sorted(set(base) ^ set(target))[:5]}")
    deltas = []
    for name in sorted(target):
        b, t = base[name], target[name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise DeltaCliError(f"{name}: base {b.dtype}{tuple(b.shape)} vs target {t.dtype}{tuple(t.shape)}")
        diff = xor_diff(t.contiguous(), b.contiguous())
        deltas.append(TensorDelta(name=name, dtype=_dtype_name(t), shape=tuple(t.shape), op=DeltaOp.XOR,
                                  positions=diff.positions, values=diff.xor_values))
    meta = {"format": META_FORMAT, "base_digest": state_digest(base), "target_digest": state_digest(target)}
    chunk = encode_chunk(deltas, meta=meta, base=_bits(base) if args.context else None)

    def write(p):
        pathlib.Path(p).write_bytes(chunk)

    _write_atomic(args.out, write)
    nnz = sum(d.nnz for d in deltas)
    numel = sum(d.numel for d in deltas)
    print(f"{args.out}: {len(deltas)} tensors, {nnz}/{numel} elements changed "
          f"({100 * nnz / max(numel, 1):.3f}%), {len(chunk)} bytes"
          + (f", {len(chunk) / nnz:.3f} bytes per changed element" if nnz else ""))
    return 0


def _apply(args) -> int:
    from safetensors.torch import save_file

    _check_out(args.out, base=args.base, delta=args.delta)
    data = _read(args.delta)
    meta = read_chunk_index(data).meta
    if meta.get("format") != META_FORMAT or "base_digest" not in meta:
        raise DeltaCliError(f"{args.delta} is a chunk but not a delta file (no base digest)")
    base = _load(args.base)
    have = state_digest(base)
    if have != meta["base_digest"]:
        raise DeltaCliError(f"{args.base} is not this delta's base: the delta was made against "
                            f"{meta['base_digest']}, this file is {have}; refusing to apply")
    # Admit every record against the base's tensors before decoding any payload.
    expect = _expect(base)
    decoded = decode_chunk(data, base=_bits(base), expect=expect, budget=DecodeBudget.for_tensors(expect))
    out = {k: v.clone() for k, v in base.items()}
    bits = _bits(out)
    for d in decoded.deltas:
        apply_delta_(bits[d.name], d)
    got = state_digest(out)
    if got != meta.get("target_digest"):
        raise DeltaCliError(f"result {got} differs from the delta's target {meta.get('target_digest')}; not written")
    _write_atomic(args.out, lambda p: save_file(out, p))
    print(f"{args.out}: applied {len(decoded.deltas)} records, matches {got}")
    return 0


def inspect_rows(data: bytes, base_bits: Mapping[str, np.ndarray] | None, *, expect: Mapping | None = None,
                 max_decode: int = INSPECT_MAX_DECODE) -> dict:
    """Per-record and total sizes and bounds of a chunk (the ``inspect`` report).

    Everything but the bound comes from the record headers.  The records are admitted
    first (against ``expect`` and its budget when given: a misfit raises), then decoded one
    at a time for the bound, each folded into its row and dropped before the next; a record
    declaring more than ``max_decode`` entries, a context-mode record without ``base_bits``,
    and a later record continuing the coder state of either are not decoded (their bound is
    n/a, ``not_decoded`` says why).  Memory: one record of at most ``max_decode`` entries."""

    def skip(info: RecordInfo) -> str | None:
        if info.context and base_bits is None:
            return f"record {info.name!r}: context-mode record needs the base (--base)"
        if info.nnz > max_decode:
            return f"record {info.name!r}: nnz {info.nnz} is over --max-decode {max_decode} entries per record"
        return None

    budget = DecodeBudget.for_tensors(expect) if expect is not None else None
    stream = stream_chunk(data, base=base_bits, expect=expect, budget=budget, skip=skip)
    rows = []
    for rec in stream:
        info, why = rec.info, rec.skipped
        lo, hi = info.element_range
        n = hi - lo
        values = rec.delta.values if (rec.delta is not None and info.op is DeltaOp.XOR) else None
        del rec  # frees the positions before the bound, and the values after it
        # The stream's arrays are its only copy: the bound may sort the values in place.
        bound = iid_bound_bytes(n, values, overwrite=True) if values is not None else None
        del values
        rows.append({
            "name": info.name, "dtype": info.dtype, "shape": list(info.shape), "op": info.op.value,
            "range": [lo, hi], "changed": info.nnz, "changed_pct": 100 * info.nnz / n if n else 0.0,
            "coding": info.coding.name, "context": info.context, "bytes": info.payload_bytes,
            "bytes_per_changed": info.payload_bytes / info.nnz if info.nnz else None,
            "bound_bytes": bound, "ratio_to_bound": info.payload_bytes / bound if bound else None,
            "not_decoded": why,
        })
    nnz = sum(r["changed"] for r in rows)
    numel = sum(r["range"][1] - r["range"][0] for r in rows)
    bounds = [r["bound_bytes"] for r in rows]
    bound = sum(bounds) if rows and all(b is not None for b in bounds) else None
    reasons = [r["not_decoded"] for r in rows if r["not_decoded"] is not None]
    not_decoded = None
    if reasons:
        not_decoded = f"not decoded: {reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "")
    total = {"records": len(rows), "chunk_bytes": len(data), "changed": nnz,
             "changed_pct": 100 * nnz / numel if numel else 0.0,
             "bytes_per_changed": len(data) / nnz if nnz else None,
             "bound_bytes": bound, "ratio_to_bound": len(data) / bound if bound else None,
             "not_decoded": not_decoded}
    return {"meta": stream.meta, "records": rows, "total": total}


def _inspect(args) -> int:
    if args.max_decode < 0:
        raise DeltaUsageError(f"--max-decode must be >= 0, got {args.max_decode}")
    data = _read(args.delta)
    base = _load(args.base) if args.base else None
    report = inspect_rows(data, _bits(base) if base is not None else None,
                          expect=_expect(base) if base is not None else None, max_decode=args.max_decode)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    def f(x, spec):
        return "n/a" if x is None else format(x, spec)

    print(f"{'tensor':48s} {'dtype':9s} {'changed':>8s} {'coding':11s} {'bytes':>9s} {'B/chg':>6s} {'x bound':>7s}")
    for r in report["records"]:
        print(f"{r['name'][:48]:48s} {r['dtype']:9s} {r['changed_pct']:7.3f}% "
              f"{r['coding'] + ('+ctx' if r['context'] else ''):11s} {r['bytes']:9d} "
              f"{f(r['bytes_per_changed'], '6.3f'):>6s} {f(r['ratio_to_bound'], '7.3f'):>7s}")
    t = report["total"]
    print(f"total: {t['records']} records, {t['changed']} changed ({t['changed_pct']:.3f}%), "
          f"{t['chunk_bytes']} bytes, {f(t['bytes_per_changed'], '.3f')} bytes per changed element, "
          + (f"{t['ratio_to_bound']:.3f}x the i.i.d. bound" if t["ratio_to_bound"] is not None
             else "i.i.d. bound n/a" + (f": {t['not_decoded']}" if t["not_decoded"] else "")))
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="nemo-dcr delta")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
