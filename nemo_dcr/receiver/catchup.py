"""Catch-up by one composed delta: many committed versions, one write into the runtime.

XOR deltas compose by XOR, but a context-mode record decodes only against the bits of
its own base, so the versions cannot be decoded independently.  ``compose`` keeps a
canonical mirror (a copy of each tensor the versions touch, made on first touch) and
walks the chain: decode version ``i`` against the mirror, apply it to the mirror, go on.
The composed record of a tensor is where the mirror differs from the runtime's bits (one
vectorised comparison per touched tensor; elements that changed and changed back drop
out).  The runtime is then written once, through the same validate / journal /
apply path as any version.

Cost against replaying the versions one by one: the same downloads and decodes, plus a
mirror copy of every touched tensor (memory up to the touched tensors' size), minus
``n - 1`` runtime applies.  Cheaper where an apply is expensive (a runtime that reloads
whole fused groups, e.g. vLLM's packed CPU weights) or many versions touch the same
elements; ``scripts/bench_catchup.py`` measures both on the transformers runtime.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nemo_dcr.codec.apply import apply_delta_
from nemo_dcr.codec.types import DeltaOp, TensorDelta
from nemo_dcr.protocol.manifest import Manifest
from nemo_dcr.receiver.held import MirrorBits
from nemo_dcr.receiver.served import validate_version


def compose(receiver, manifests: Sequence[Manifest]) -> tuple[list[TensorDelta], Mapping[str, np.ndarray], dict]:
    """Decode the chain ``manifests`` (each based on the previous one's version, the first on
    what ``receiver`` holds) against a mirror; returns one record per touched tensor taking
    the held version to the last one, the held bits of those tensors (read once), and
    fetch totals."""
    mirror = MirrorBits(receiver.served)
    overwritten: set[str] = set()
    meta: dict[str, TensorDelta] = {}
    stats = {"download_s": 0.0, "decode_s": 0.0, "wire_bytes": 0, "changed": 0, "versions": len(manifests)}
    base_version = receiver.held_version
    for m in manifests:
        got = receiver.fetch(m, base=mirror, base_version=base_version)
        deltas = got.deltas
        for k in ("download_s", "decode_s", "wire_bytes", "changed"):
            stats[k] += got.stats[k]
        validate_version(receiver.served.tensor_specs(), deltas)  # names, shapes, ranges: no runtime call
        for d in deltas:
            apply_delta_(mirror[d.name], d)
            meta.setdefault(d.name, d)
            if d.op is DeltaOp.OVERWRITE:
                overwritten.add(d.name)
        base_version = m.version
    out = []
    for name, new_bits in mirror.arrays.items():
        held = np.asarray(mirror.held[name])
        pos = np.flatnonzero(new_bits != held)  # one vectorised pass; unchanged-back elements drop out
        if pos.size == 0:
            continue
        d = meta[name]
        op = DeltaOp.OVERWRITE if name in overwritten else DeltaOp.XOR
        values = new_bits[pos] if op is DeltaOp.OVERWRITE else new_bits[pos] ^ held[pos]
        out.append(TensorDelta(name=name, dtype=d.dtype, shape=d.shape, op=op, positions=pos.astype(np.int64),
                               values=values, element_range=(int(pos[0]), int(pos[-1]) + 1)))
    stats["composed_changed"] = sum(d.nnz for d in out)
    return out, mirror.held, stats
