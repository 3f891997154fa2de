"""Probing: feed canonical tensors to a runtime's loader with every write suppressed, and
give each write the loader would make to the canonical names it carries.

The planner (``receiver/placement.py``) classifies from what ``probe_all`` collects.
Probes are fed in batches of whole load units; a batch whose writes cannot each be given
to one unit (a loader computing one write from several fed tensors) is probed again unit by
unit.  Every probe checks the loader rebound no parameter or buffer (restoring them if it
did): in-place apply writes into the storages the module holds.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from nemo_dcr.receiver.capture import CapturedWrite, StorageOwner, storage_fingerprint
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.provenance import TracingCapture
from nemo_dcr.receiver.runtime import RuntimeAdapter, TensorSpec
from nemo_dcr.receiver.traced import Runs, plain_pieces, traced_pieces


@dataclass
class Attribution:
    """Probe writes by canonical name.

    writes: plain / cast / computed writes involving the name (a computed write of a one-unit
        probe involves every member of the unit).
    owned: the same writes, each under exactly one name (for the overlap check).
    traced: traced writes reaching the name (source and origins dropped).
    pieces: index runs of the name's traced and, where needed, plain copies.
    """

    writes: dict[str, list[CapturedWrite]] = field(default_factory=dict)
    owned: dict[str, list[CapturedWrite]] = field(default_factory=dict)
    traced: dict[str, list[CapturedWrite]] = field(default_factory=dict)
    pieces: dict[str, list[Runs]] = field(default_factory=dict)


def probe_all(
    adapter: RuntimeAdapter,
    specs: Mapping[str, TensorSpec],
    units: Iterable[tuple[str, ...]],
    unit_of: Mapping[str, tuple[str, ...]],
    storages: Mapping[int, StorageOwner],
    *,
    probe_bytes: int,
) -> Attribution:
    """Probe every non-empty load unit; the module is not written."""
    found = Attribution()
    for group in _probe_groups(specs, units, probe_bytes):
        capture = _probe(adapter, specs, [n for u in group for n in u], storages)
        if not _attribute(capture, found, unit_of, one_unit=len(group) == 1):
            for unit in group:  # re-probe unit by unit: a unit is never split
                _attribute(_probe(adapter, specs, list(unit), storages), found, unit_of, one_unit=True)
    return found


def _probe_groups(
    specs: Mapping[str, TensorSpec], units: Iterable[tuple[str, ...]], probe_bytes: int
) -> Iterable[list[tuple[str, ...]]]:
    """Whole load units, packed up to ``probe_bytes`` per loader call (a unit larger
    than that is one call of its own)."""
    group: list[tuple[str, ...]] = []
    size = 0
    for unit in units:
        unit_specs = [specs[n] for n in unit]
        if len(unit) == 1 and unit_specs[0].numel == 0:
            continue
        nbytes = sum(s.numel * s.torch_dtype.itemsize for s in unit_specs)
        if group and size + nbytes > probe_bytes:
            yield group
            group, size = [], 0
        group.append(unit)
        size += nbytes
    if group:
        yield group


def _attribute(
    capture: TracingCapture, found: Attribution, unit_of: Mapping[str, tuple[str, ...]], *, one_unit: bool
) -> bool:
    """Assign one probe's writes to canonical names (see ``Attribution``).

    A probe of several units whose writes cannot each be given to one unit changes
    nothing and returns False (the caller re-probes unit by unit)."""
    fed_names = capture.table.names
    traced = {id(w): traced_pieces(w, capture.table) for w in capture.writes if w.origins is not None}
    for w in capture.writes:
        units = {unit_of.get(n, (n,)) for n in traced.get(id(w), ())}
        if len(units) > 1 and one_unit:
            raise LoaderError(
                f"the loader combines {sorted(traced[id(w)])[:4]} in one write into {w.dest_owner.name}, "
                "but the adapter does not declare them one load group"
            )
        if not one_unit and (len(units) > 1 or (w.fed_name is None and w.origins is None)):
            return False
    traced_here: set[str] = set()
    for w in capture.writes:
        if w.origins is not None:
            parts = traced[id(w)]
            stripped = replace(w, source=None, origins=None)  # drop the probe's intermediates
            for n, runs in parts.items():
                found.pieces.setdefault(n, []).append(runs)
                found.traced.setdefault(n, []).append(stripped)
                traced_here.add(n)
        elif w.fed_name is not None:
            found.writes.setdefault(w.fed_name, []).append(w)
            found.owned.setdefault(w.fed_name, []).append(w)
        else:  # only in a one-unit probe: the write belongs to the whole unit
            for n in fed_names:
                found.writes.setdefault(n, []).append(w)
            found.owned.setdefault(fed_names[0], []).append(w)
    # plain copies of a traced name, or of a member of a multi-name unit, as runs too
    for n in fed_names:
        if n in traced_here or len(unit_of.get(n, ())) > 1:
            for w in found.writes.get(n, []):
                if w.plain and w.fed_name == n and w.source is not None:
                    found.pieces.setdefault(n, []).append(plain_pieces(w, capture.fed[n]))
    return True


def _probe(
    adapter: RuntimeAdapter, specs: Mapping[str, TensorSpec], names: list[str], storages: Mapping[int, StorageOwner]
) -> TracingCapture:
    module = adapter.module
    # Probe contents are left unset: writes are suppressed, so a plain copy never reads
    # them, and not zero-filling saves a page-faulting pass over model-sized memory.
    fed = {n: torch.empty(specs[n].shape, dtype=specs[n].torch_dtype) for n in names}
    before = storage_fingerprint(module)
    saved = _snapshot_slots(module)
    capture = TracingCapture(storages, fed, execute=False)
    try:
        with torch.no_grad(), capture:
            adapter.load_weights(fed.items())
    except Exception as e:
        _restore_slots(saved)
        raise LoaderError(f"the loader failed on probes {names[:3]}: {e}") from e
    if storage_fingerprint(module) != before:
        _restore_slots(saved)
        raise LoaderError(
            f"the loader rebinds parameters or buffers instead of writing into them (probing {names[:3]}); "
            "in-place apply needs a loader that copies into existing storage (restored the originals)"
        )
    return capture


def _snapshot_slots(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool, torch.Tensor | None]]:
    slots = []
    for sub in module.modules():
        for key, t in sub._parameters.items():
            slots.append((sub, key, False, t))
        for key, t in sub._buffers.items():
            slots.append((sub, key, True, t))
    return slots


def _restore_slots(slots) -> None:
    for sub, key, is_buffer, t in slots:
        (sub._buffers if is_buffer else sub._parameters)[key] = t
