"""Where a runtime's loader puts each canonical tensor: probing, classification, and the
immutable ``PlacementPlan`` that ``DeltaApplier`` (``receiver/apply.py``) executes.

The receiver never says "canonical tensor X lives in parameter Y at offset Z".  It asks the
runtime: ``Planner.plan`` feeds each canonical name to the adapter's loader as a probe under
``WriteCapture(execute=False)`` and records every write the loader would make into a
parameter/buffer storage (``receiver/probe.py``; the writes are suppressed: the model is
not touched).  From those writes each canonical tensor gets a placement:

* ``DIRECT``: one plain ``copy_`` of the whole fed tensor into a contiguous destination of
  the same shape and dtype.  Canonical flat index == destination flat index, so apply
  XORs (or overwrites) exactly the changed elements of an integer view of the destination:
  O(nnz) work, no loader call.  (transformers' ``load_state_dict`` gives this for every
  tensor of a Llama.)
* ``VIEW``: only plain copies, but with other geometry (a slice of a fused parameter, a
  transpose, several destinations).  Apply runs the loader on the XOR bits and executes
  its copies as XORs (``receiver/apply.py``).
* ``TRANSFORM``: the loader changes bits (a cast, a scale, a computed source, an in-place
  op after the copy) or writes one destination element twice.  XOR on the destination
  would be wrong, so apply keeps a canonical mirror of the tensor (seeded here from
  ``adapter.initial_tensor`` and checked against the runtime where the loader only casts)
  and feeds whole new tensors through the loader, as a dense refit does.
* ``TRACED``: the loader builds what it copies from the fed tensors by data movement only
  (transformers v5 stacks per-expert checkpoint tensors into fused MoE parameters).  The
  probe follows the fed bits through that movement (``nemo_dcr.receiver.provenance``) and
  keeps, per canonical tensor, affine runs from canonical to destination-storage indices
  (``nemo_dcr.receiver.traced``): O(nnz log runs) per apply, no loader call.
* ``DROPPED``: the loader never writes the tensor.  A dense refit ignores it too; the
  default ``CoveragePolicy.STRICT`` refuses such a runtime.
* ``EMPTY``: zero elements; nothing to place.

Load units: an adapter may declare names its loader must receive together
(``load_groups()``, e.g. every expert tensor of one fused MoE layer).  Probes then hold whole
units and a unit is never probed member by member; a unit with one TRANSFORM member is
TRANSFORM as a whole (its overwrite feeds every member, from the mirror); a member whose
copies are plain but strided is TRACED rather than VIEW (no loader call needs the others).

The plan is frozen and its mappings read-only: a new prewarm makes a new plan.  Its
tensors and arrays are views of the runtime's own storages, which apply writes *through*.
"""
from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

import numpy as np
import torch

from nemo_dcr.dtypes import int_view
from nemo_dcr.receiver.capture import (
    CapturedWrite,
    Geometry,
    WriteCapture,
    module_storages,
    storage_fingerprint,
)
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.probe import probe_all
from nemo_dcr.receiver.runtime import RuntimeAdapter, TensorSpec
from nemo_dcr.receiver.traced import Runs, check_traced_overlaps, flat_storage, load_units

class PlacementKind(enum.Enum):
    DIRECT = "direct"
    VIEW = "view"
    TRACED = "traced"
    TRANSFORM = "transform"
    DROPPED = "dropped"
    EMPTY = "empty"


class CoveragePolicy(enum.Enum):
    """What prewarm does with a canonical tensor the loader never writes."""

    STRICT = "strict"
    """Refuse the runtime (``LoaderError``)."""
    ALLOW_DROPPED = "allow_dropped"
    """Mark it ``DROPPED``; deltas for it are validated, not written, and reported in
    ``ApplyResult.dropped`` (a dense refit through the same loader drops them too)."""


@dataclass(frozen=True)
class CopyPlacement:
    """One write the loader makes for a canonical tensor (geometries in elements)."""

    dest: str
    """Name of the parameter/buffer owning the written storage."""
    dest_geometry: Geometry
    source_geometry: Geometry | None
    """View of the fed canonical tensor that was copied; ``None`` if the source is not one."""
    plain: bool
    op: str


@dataclass(frozen=True)
class TensorPlacement:
    spec: TensorSpec
    kind: PlacementKind
    copies: tuple[CopyPlacement, ...]
    reason: str
    """Why this kind (for TRANSFORM: the first write that is not bit-preserving)."""
    traced: Runs | None = None
    """TRACED: canonical -> destination storage index runs."""
    load_unit: tuple[str, ...] = ()
    """The names the loader must be given together with this one (itself included)."""


@dataclass(frozen=True, eq=False)
class TracedTarget:
    """A TRACED tensor's runs and, per owner in ``runs.owners``, a writable flat integer
    view of that owner's whole storage."""

    runs: Runs
    flats: tuple[np.ndarray, ...]


@dataclass(frozen=True, eq=False)
class PlacementPlan:
    """What prewarm learned about one runtime; apply executes it and never changes it."""

    placements: Mapping[str, TensorPlacement]
    units: tuple[tuple[str, ...], ...]
    """Every canonical name in exactly one load unit, in spec order."""
    unit_of: Mapping[str, tuple[str, ...]]
    direct: Mapping[str, torch.Tensor]
    """DIRECT: flat integer view of the destination (canonical index == flat index)."""
    view_writes: Mapping[str, tuple[CapturedWrite, ...]]
    """VIEW: the probe's copies (source geometry -> destination view), to read bits back."""
    traced: Mapping[str, TracedTarget]
    fingerprint: Mapping[str, tuple[int, int]]
    """``storage_fingerprint`` of the module at prewarm: a rebinding loader invalidates the plan."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                object.__setattr__(self, f.name, MappingProxyType(dict(value)))


class Planner:
    """Probes one runtime's loader and classifies every canonical tensor.

    probe_bytes: probes are fed in groups of at most this many bytes per loader call
        (``receiver/probe.py``).
    """

    def __init__(
        self, adapter: RuntimeAdapter, specs: Mapping[str, TensorSpec], *, coverage: CoveragePolicy, probe_bytes: int
    ) -> None:
        self._adapter = adapter
        self._specs = dict(specs)
        self._coverage = coverage
        self._probe_bytes = probe_bytes
        self._units = tuple(load_units(adapter, self._specs))
        self._unit_of = {n: u for u in self._units for n in u}
        unknown = sorted(set(self._unit_of) - set(self._specs))
        if unknown:
            raise LoaderError(f"the adapter's load groups name unknown tensors, e.g. {unknown[:3]}")

    def plan(self, mirror: Mapping[str, torch.Tensor]) -> tuple[PlacementPlan, dict[str, torch.Tensor]]:
        """Probe, classify and check; the module is not written.  Returns the plan and the
        canonical mirror of its TRANSFORM tensors: ``mirror``'s entry where it has one (a
        re-prewarm keeps the versions applied since), else ``adapter.initial_tensor``."""
        module = self._adapter.module
        storages = module_storages(module)
        found = probe_all(
            self._adapter, self._specs, self._units, self._unit_of, storages, probe_bytes=self._probe_bytes
        )
        writes = found.writes

        placements = {
            name: self._classify(
                self._specs[name], writes.get(name, []), found.traced.get(name, []), found.pieces.get(name)
            )
            for name in self._specs
        }
        untraced = {n: ws for n, ws in found.owned.items() if placements[n].kind is not PlacementKind.TRACED}
        placements = self._check_overlaps(placements, untraced)
        check_traced_overlaps(
            {n: p.traced for n, p in placements.items() if p.kind is PlacementKind.TRACED},
            untraced,
            {o.name: o.tensor for o in storages.values()},
        )
        placements = self._join_units(placements)

        dropped = sorted(n for n, p in placements.items() if p.kind is PlacementKind.DROPPED)
        if dropped and self._coverage is CoveragePolicy.STRICT:
            raise LoaderError(
                f"the loader never writes {len(dropped)} canonical tensors, e.g. {dropped[:3]} "
                "(CoveragePolicy.ALLOW_DROPPED accepts a runtime that drops them)"
            )
        seeded = self._seed_mirror(placements, mirror)
        self._check_mirror_consistent(seeded, writes)

        direct = {}
        for name, p in placements.items():
            if p.kind is PlacementKind.DIRECT:
                (w,) = writes[name]
                flat = int_view(w.dest.detach().view(-1))
                assert flat.untyped_storage().data_ptr() == w.dest.untyped_storage().data_ptr()
                direct[name] = flat
        owners = {o.name: o.tensor for o in storages.values()}
        plan = PlacementPlan(
            placements=placements,
            units=self._units,
            unit_of=self._unit_of,
            direct=direct,
            view_writes={n: tuple(writes[n]) for n, p in placements.items() if p.kind is PlacementKind.VIEW},
            traced={
                name: TracedTarget(p.traced, tuple(flat_storage(owners[o]) for o in p.traced.owners))
                for name, p in placements.items()
                if p.kind is PlacementKind.TRACED
            },
            fingerprint=storage_fingerprint(module),
        )
        return plan, seeded

    def _seed_mirror(
        self, placements: Mapping[str, TensorPlacement], mirror: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        seeded: dict[str, torch.Tensor] = {}
        unseeded = []
        for name, p in placements.items():
            if p.kind is not PlacementKind.TRANSFORM:
                continue
            # a re-prewarm keeps the mirror: it holds the applied versions, the adapter's
            # initial tensor only the version the runtime was loaded at
            initial = mirror.get(name)
            if initial is None:
                initial = self._adapter.initial_tensor(name)
            if initial is None:
                unseeded.append(name)
                continue
            spec = self._specs[name]
            if initial.dtype != spec.torch_dtype or tuple(initial.shape) != spec.shape:
                raise LoaderError(f"{name}: initial tensor {initial.dtype}{tuple(initial.shape)} != spec {spec}")
            seeded[name] = initial.detach().to("cpu").contiguous().clone()
        if unseeded:
            raise LoaderError(
                f"{len(unseeded)} tensors need a canonical mirror (their loader is not bit-preserving: "
                f"{placements[unseeded[0]].reason}) but the adapter cannot provide their initial bits, "
                f"e.g. {sorted(unseeded)[:3]}"
            )
        return seeded

    def _classify(
        self,
        spec: TensorSpec,
        writes: list[CapturedWrite],
        traced: list[CapturedWrite] = (),
        pieces: list[Runs] | None = None,
    ) -> TensorPlacement:
        unit = self._unit_of.get(spec.name, (spec.name,))
        if spec.numel == 0:
            return TensorPlacement(spec, PlacementKind.EMPTY, (), "no elements", load_unit=unit)
        if not writes and not traced:
            return TensorPlacement(spec, PlacementKind.DROPPED, (), "the loader never writes it", load_unit=unit)
        copies = []
        reason = ""
        for w in writes:
            plain = w.plain and w.fed_name == spec.name and w.dest.dtype == w.dest_owner.tensor.dtype
            source_geometry = Geometry.of(w.source) if plain else None
            copies.append(CopyPlacement(w.dest_owner.name, w.dest_geometry, source_geometry, plain, w.op))
            if not plain and not reason:
                reason = _describe_nonplain(spec, w)
        for w in traced:
            if w.dest.dtype != w.dest_owner.tensor.dtype and not reason:
                reason = f"{w.op} into {w.dest_owner.name} through a reinterpreting view"
            copies.append(CopyPlacement(w.dest_owner.name, w.dest_geometry, None, False, w.op))
        copies_t = tuple(copies)
        if reason:
            return TensorPlacement(spec, PlacementKind.TRANSFORM, copies_t, reason, load_unit=unit)
        if pieces and (traced or (len(unit) > 1 and not _is_direct(spec, writes, copies_t))):
            runs = Runs.merge(pieces)
            problem = runs.coverage_problem(spec.numel)
            if problem:
                return TensorPlacement(spec, PlacementKind.TRANSFORM, copies_t, problem, load_unit=unit)
            why = f"{runs.count} affine runs through the loader's data movement"
            return TensorPlacement(spec, PlacementKind.TRACED, copies_t, why, traced=runs, load_unit=unit)
        if _is_direct(spec, writes, copies_t):
            return TensorPlacement(spec, PlacementKind.DIRECT, copies_t, "one plain whole-tensor copy", load_unit=unit)
        why = f"{len(writes)} plain strided copies"
        return TensorPlacement(spec, PlacementKind.VIEW, copies_t, why, load_unit=unit)

    def _join_units(self, placements: dict[str, TensorPlacement]) -> dict[str, TensorPlacement]:
        """A unit with a TRANSFORM member is overwritten through the loader as a whole."""
        out = dict(placements)
        for unit in self._units:
            if len(unit) == 1:
                continue
            kinds = {out[n].kind for n in unit}
            if PlacementKind.TRANSFORM not in kinds:
                continue
            if PlacementKind.DROPPED in kinds:
                raise LoaderError(f"load group {list(unit)[:3]} mixes dropped and transformed tensors")
            first = next(n for n in unit if out[n].kind is PlacementKind.TRANSFORM)
            for n in unit:
                p = out[n]
                if p.kind in (PlacementKind.DIRECT, PlacementKind.VIEW, PlacementKind.TRACED):
                    why = f"loaded together with {first}: {out[first].reason}"
                    out[n] = TensorPlacement(p.spec, PlacementKind.TRANSFORM, p.copies, why, load_unit=p.load_unit)
        return out

    def _check_overlaps(
        self, placements: dict[str, TensorPlacement], writes: dict[str, list[CapturedWrite]]
    ) -> dict[str, TensorPlacement]:
        """Every destination element must be written by at most one canonical element.

        A plain placement writing an element twice (last copy wins, two XORs cancel) is
        downgraded to TRANSFORM; two canonical tensors sharing a destination element are
        refused (their dense result depends on load order).
        """
        by_storage: dict[int, list[str]] = defaultdict(list)
        n_writes: Counter[int] = Counter()
        for name, ws in writes.items():
            for w in ws:
                n_writes[w.dest_owner.tensor.untyped_storage().data_ptr()] += 1
            for ptr in {w.dest_owner.tensor.untyped_storage().data_ptr() for w in ws}:
                by_storage[ptr].append(name)
        out = dict(placements)
        for ptr, names in by_storage.items():
            if n_writes[ptr] == 1:
                continue  # one copy_ into one storage cannot write an element twice
            owner = next(
                w.dest_owner for w in writes[names[0]] if w.dest_owner.tensor.untyped_storage().data_ptr() == ptr
            )
            same = []  # (name, write) of every write into this storage through its element size
            for name in names:
                for w in writes[name]:
                    if w.dest_owner.tensor.untyped_storage().data_ptr() != ptr:
                        continue
                    if w.dest.element_size() != owner.tensor.element_size():
                        if out[name].kind in (PlacementKind.DIRECT, PlacementKind.VIEW):
                            raise LoaderError(f"{name}: plain write through a reinterpreting view of {owner.name}")
                        continue  # a transform writing through another dtype: elements not comparable
                    same.append((name, w))
            if not _spans_overlap(same):
                continue  # contiguous writes into disjoint spans (e.g. every parameter mapped on one file)
            out = _check_overlaps_by_mask(out, owner, names, same)
        return out

    def _check_mirror_consistent(self, mirror: dict[str, torch.Tensor], writes: dict[str, list[CapturedWrite]]) -> None:
        """Where the loader's writes are ``copy_`` (a cast), check the seeded mirror reproduces
        the destination bits: a stale checkpoint would otherwise corrupt the first apply."""
        if not mirror:
            return
        storages = module_storages(self._adapter.module)
        for unit in {self._unit_of.get(n, (n,)) for n in mirror}:
            name = unit[0]
            if not all(w.op == "aten.copy_.default" for n in unit for w in writes.get(n, [])):
                continue
            fed = {n: mirror[n].clone() if n in mirror else unit_tensor(self._specs[n], mirror) for n in unit}
            capture = WriteCapture(storages, fed, execute=False)
            with torch.no_grad(), capture:
                self._adapter.load_weights(fed.items())
            for w in capture.writes:
                with torch.no_grad():
                    would = torch.empty_like(w.dest).copy_(w.source)
                if not torch.equal(int_view(would), int_view(w.dest.detach())):
                    raise LoaderError(
                        f"{name}: the adapter's initial tensor does not reproduce {w.dest_owner.name} "
                        "through the loader (stale checkpoint?)"
                    )


def unit_tensor(spec: TensorSpec, mirror: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What a load-unit member is fed when the loader must see the whole unit: its mirror
    (an empty tensor for an empty spec)."""
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.torch_dtype)
    return mirror[spec.name]


def _is_direct(spec: TensorSpec, writes: list[CapturedWrite], copies: tuple[CopyPlacement, ...]) -> bool:
    return (
        len(writes) == 1
        and len(copies) == 1
        and copies[0].source_geometry is not None
        and copies[0].source_geometry.is_contiguous_whole(spec.shape)
        and tuple(writes[0].dest.shape) == spec.shape
        and writes[0].dest.is_contiguous()
    )


def _describe_nonplain(spec: TensorSpec, w: CapturedWrite) -> str:
    if w.source is None:
        return f"{w.op} into {w.dest_owner.name}"
    if w.fed_name is None:
        return f"{w.op} into {w.dest_owner.name} from a computed tensor (not a view of the fed {spec.name})"
    if w.fed_name != spec.name:
        return f"{w.op} into {w.dest_owner.name} from the tensor fed as {w.fed_name}"
    return f"{w.op} casts {w.source.dtype} -> {w.dest.dtype} into {w.dest_owner.name}"


def _spans_overlap(writes: list[tuple[str, CapturedWrite]]) -> bool:
    """False when every write is contiguous and no two touch the same element (sorted spans
    of the owner's elements, O(k log k)); True when any does, or any write is strided (the
    caller then checks element by element)."""
    spans = []
    for _, w in writes:
        if not w.dest.is_contiguous():
            return True
        start = w.dest.storage_offset()
        spans.append((start, start + w.dest.numel()))
    spans.sort()
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _check_overlaps_by_mask(out: dict[str, TensorPlacement], owner, names: list[str],
                            writes: list[tuple[str, CapturedWrite]]) -> dict[str, TensorPlacement]:
    """``Planner._check_overlaps`` element by element for one storage: one boolean mask of the
    storage per canonical tensor at a time, and a write counter over it."""
    numel = owner.tensor.untyped_storage().nbytes() // owner.tensor.element_size()
    counter = torch.zeros(numel, dtype=torch.int16)

    def mask_of(name: str) -> tuple[torch.Tensor, int]:
        mask, total = torch.zeros(numel, dtype=torch.bool), 0
        for n, w in writes:
            if n == name:
                torch.as_strided(mask, w.dest.shape, w.dest.stride(), w.dest.storage_offset()).fill_(True)
                total += w.dest.numel()
        return mask, total

    for name in names:
        mask, total = mask_of(name)
        if total != int(mask.sum()) and out[name].kind in (PlacementKind.DIRECT, PlacementKind.VIEW):
            p = out[name]
            out[name] = TensorPlacement(
                p.spec, PlacementKind.TRANSFORM, p.copies, f"writes elements of {owner.name} more than once"
            )
        counter += mask
    if int(counter.max()) > 1:
        shared = sorted(n for n in names if bool((counter[mask_of(n)[0]] > 1).any()))
        raise LoaderError(f"canonical tensors {shared} are written into the same elements of {owner.name}")
    return out
