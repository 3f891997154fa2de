"""Apply canonical XOR / overwrite deltas in place, through the runtime's own loader.

The receiver never says "canonical tensor X lives in parameter Y at offset Z".  It asks the
runtime: ``prewarm`` feeds each canonical name to the adapter's loader as a probe under
``WriteCapture(execute=False)`` and records every write the loader would make into a
parameter/buffer storage (the writes are suppressed: the model is not touched).  From those
writes each canonical tensor gets a placement:

* ``DIRECT``: one plain ``copy_`` of the whole fed tensor into a contiguous destination of
  the same shape and dtype.  Canonical flat index == destination flat index, so ``apply``
  XORs (or overwrites) exactly the changed elements of an integer view of the destination:
  O(nnz) work, no loader call.  (transformers' ``load_state_dict`` gives this for every
  tensor of a Llama.)
* ``VIEW``: only plain copies, but with other geometry (a slice of a fused parameter, a
  transpose, several destinations).  ``apply`` feeds the loader a zero canonical tensor
  carrying the XOR bits at the changed positions, captures its copies without running
  them, checks they match the prewarm placement, then runs each as ``dest ^= src`` on
  integer views.  A copy that copies ``x`` now XORs ``x``: exact because, for a
  bit-preserving placement, destination bits equal fed bits.  An OVERWRITE becomes the
  XOR ``current ^ new``, the current canonical bits read back through the same copies.
* ``TRANSFORM``: the loader changes bits (a cast, a scale, a computed source, an in-place
  op after the copy) or writes one destination element twice.  XOR on the destination
  would be wrong, so the engine keeps a canonical mirror of the tensor (seeded from
  ``adapter.initial_tensor`` and checked against the runtime where the loader only casts),
  applies the delta to the mirror and feeds the whole new tensor through the loader,
  executing its writes: exactly what a dense refit does.  Costs a canonical copy of each
  such tensor in host memory and O(numel) per changed tensor per apply.
* ``TRACED``: the loader builds what it copies from the fed tensors by data movement only
  (transformers v5 stacks per-expert checkpoint tensors into fused MoE parameters).  The
  probe follows the fed bits through that movement (``nemo_dcr.receiver.provenance``) and
  keeps, per canonical tensor, affine runs from canonical to destination-storage indices
  (``nemo_dcr.receiver.traced``).  ``apply`` XORs / overwrites the changed elements through
  the runs: O(nnz log runs), no loader call.
* ``DROPPED``: the loader never writes the tensor.  A dense refit ignores it too; the
  default ``CoveragePolicy.STRICT`` refuses such a runtime at prewarm.
* ``EMPTY``: zero elements; nothing to place.

Load units: an adapter may declare names its loader must receive together
(``load_groups()``, e.g. every expert tensor of one fused MoE layer).  Probes then hold whole
units and a unit is never probed member by member; a unit with one TRANSFORM member is
TRANSFORM as a whole (its overwrite feeds every member, from the mirror); a member whose
copies are plain but strided is TRACED rather than VIEW (no loader call needs the others).

Atomicity: ``apply`` validates the whole batch (names, dtypes, shapes, ranges, positions,
placement unchanged since prewarm) and prepares every write before the first one; only a
runtime loader that raises while executing a ``TRANSFORM`` overwrite can leave a batch
half-applied (those run first, so a failure on the first leaves everything unchanged).
"""
from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.receiver.capture import (
    CapturedWrite,
    Geometry,
    WriteCapture,
    module_storages,
    storage_fingerprint,
)
from nemo_dcr.receiver.errors import DeltaValidationError, IncompleteApplyError, PlacementError
from nemo_dcr.receiver.provenance import TracingCapture
from nemo_dcr.receiver.traced import (
    Runs,
    check_traced_overlaps,
    flat_storage,
    load_units,
    plain_pieces,
    traced_pieces,
)
from nemo_dcr.runtimes.base import RuntimeAdapter, TensorSpec

_INT_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT_NUMPY = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view of ``t`` (any strides); bit operations on it are exact."""
    return t.view(_INT_TORCH[t.element_size()])


def _signed_bits(values: np.ndarray) -> np.ndarray:
    """Unsigned wire bit patterns -> the integer dtype ``int_view(...).numpy()`` has (no copy)."""
    return np.ascontiguousarray(values).view(_INT_NUMPY[values.dtype.itemsize])


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
    """Refuse the runtime (``PlacementError``)."""
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


@dataclass(frozen=True)
class ApplyResult:
    applied: frozenset[str]
    """Canonical names whose records were all applied (including empty records)."""
    dropped: frozenset[str]
    """Names whose loader drops them (only under ``CoveragePolicy.ALLOW_DROPPED``)."""
    through_loader: frozenset[str]
    """Names applied by running the loader (VIEW and TRANSFORM placements)."""
    xor_elements: int
    overwrite_elements: int


@dataclass
class _Attribution:
    """Probe writes by canonical name, as prewarm collects them.

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


@dataclass
class _Prepared:
    """Everything a name needs for the commit phase, computed before any write."""

    name: str
    kind: PlacementKind
    xor_idx: np.ndarray | None = None  # int64 canonical flat positions
    xor_val: np.ndarray | None = None  # same-width integers (``_signed_bits``)
    ow_idx: np.ndarray | None = None
    ow_val: np.ndarray | None = None
    fed: torch.Tensor | None = None  # VIEW: zero tensor with XOR bits; TRANSFORM: new mirror


class DeltaApplier:
    """In-place delta apply for one runtime (see the module docstring).

    probe_bytes: prewarm feeds probes in groups of at most this many bytes per loader call;
        a group whose writes cannot all be attributed to one fed tensor is re-probed name by
        name.
    """

    def __init__(
        self,
        adapter: RuntimeAdapter,
        *,
        coverage: CoveragePolicy = CoveragePolicy.STRICT,
        probe_bytes: int = 1 << 30,
    ) -> None:
        if not isinstance(adapter, RuntimeAdapter):
            raise TypeError(f"{type(adapter).__name__} does not implement RuntimeAdapter")
        if probe_bytes <= 0:
            raise ValueError("probe_bytes must be positive")
        self._adapter = adapter
        self._coverage = coverage
        self._probe_bytes = probe_bytes
        self._specs: dict[str, TensorSpec] = dict(adapter.tensor_specs())
        self._placements: dict[str, TensorPlacement] = {}
        self._direct: dict[str, torch.Tensor] = {}
        self._view_writes: dict[str, list[CapturedWrite]] = {}
        self._traced: dict[str, tuple[Runs, list[np.ndarray]]] = {}
        self._units = load_units(adapter, self._specs)
        self._unit_of = {n: u for u in self._units for n in u}
        unknown = sorted(set(self._unit_of) - set(self._specs))
        if unknown:
            raise PlacementError(f"the adapter's load groups name unknown tensors, e.g. {unknown[:3]}")
        self._mirror: dict[str, torch.Tensor] = {}
        self._fingerprint: dict[str, tuple[int, int]] | None = None

    @property
    def adapter(self) -> RuntimeAdapter:
        return self._adapter

    @property
    def placements(self) -> Mapping[str, TensorPlacement]:
        return dict(self._placements)

    # ------------------------------------------------------------------ prewarm
    def prewarm(self) -> Mapping[str, TensorPlacement]:
        """Learn where the loader puts every canonical tensor; the module is not written."""
        module = self._adapter.module
        storages = module_storages(module)
        found = _Attribution()
        for units in self._probe_groups():
            capture = self._probe([n for u in units for n in u], storages)
            if not self._attribute(capture, found, one_unit=len(units) == 1):
                for unit in units:  # re-probe unit by unit: a unit is never split
                    self._attribute(self._probe(list(unit), storages), found, one_unit=True)
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
            raise PlacementError(
                f"the loader never writes {len(dropped)} canonical tensors, e.g. {dropped[:3]} "
                "(CoveragePolicy.ALLOW_DROPPED accepts a runtime that drops them)"
            )

        mirror: dict[str, torch.Tensor] = {}
        unseeded = []
        for name, p in placements.items():
            if p.kind is not PlacementKind.TRANSFORM:
                continue
            # a re-prewarm keeps the mirror: it holds the applied versions, the adapter's
            # initial tensor only the version the runtime was loaded at
            initial = self._mirror.get(name)
            if initial is None:
                initial = self._adapter.initial_tensor(name)
            if initial is None:
                unseeded.append(name)
                continue
            spec = self._specs[name]
            if initial.dtype != spec.torch_dtype or tuple(initial.shape) != spec.shape:
                raise PlacementError(f"{name}: initial tensor {initial.dtype}{tuple(initial.shape)} != spec {spec}")
            mirror[name] = initial.detach().to("cpu").contiguous().clone()
        if unseeded:
            raise PlacementError(
                f"{len(unseeded)} tensors need a canonical mirror (their loader is not bit-preserving: "
                f"{placements[unseeded[0]].reason}) but the adapter cannot provide their initial bits, "
                f"e.g. {sorted(unseeded)[:3]}"
            )
        self._check_mirror_consistent(mirror, writes)

        self._placements = placements
        self._mirror = mirror
        self._direct = {}
        self._view_writes = {}
        for name, p in placements.items():
            if p.kind is PlacementKind.DIRECT:
                (w,) = writes[name]
                flat = int_view(w.dest.detach().view(-1))
                assert flat.untyped_storage().data_ptr() == w.dest.untyped_storage().data_ptr()
                self._direct[name] = flat
            elif p.kind is PlacementKind.VIEW:
                self._view_writes[name] = writes[name]
        owners = {o.name: o.tensor for o in storages.values()}
        self._traced = {
            name: (p.traced, [flat_storage(owners[o]) for o in p.traced.owners])
            for name, p in placements.items()
            if p.kind is PlacementKind.TRACED
        }
        self._fingerprint = storage_fingerprint(module)
        return self.placements

    def _probe_groups(self) -> Iterable[list[tuple[str, ...]]]:
        """Whole load units, packed up to ``probe_bytes`` per loader call (a unit larger
        than that is one call of its own)."""
        group: list[tuple[str, ...]] = []
        size = 0
        for unit in self._units:
            specs = [self._specs[n] for n in unit]
            if len(unit) == 1 and specs[0].numel == 0:
                continue
            nbytes = sum(s.numel * s.torch_dtype.itemsize for s in specs)
            if group and size + nbytes > self._probe_bytes:
                yield group
                group, size = [], 0
            group.append(unit)
            size += nbytes
        if group:
            yield group

    def _attribute(self, capture: TracingCapture, found: _Attribution, *, one_unit: bool) -> bool:
        """Assign one probe's writes to canonical names (see ``_Attribution``).

        A probe of several units whose writes cannot each be given to one unit changes
        nothing and returns False (the caller re-probes unit by unit)."""
        fed_names = capture.table.names
        traced = {id(w): traced_pieces(w, capture.table) for w in capture.writes if w.origins is not None}
        for w in capture.writes:
            units = {self._unit_of.get(n, (n,)) for n in traced.get(id(w), ())}
            if len(units) > 1 and one_unit:
                raise PlacementError(
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
            if n in traced_here or len(self._unit_of.get(n, ())) > 1:
                for w in found.writes.get(n, []):
                    if w.plain and w.fed_name == n and w.source is not None:
                        found.pieces.setdefault(n, []).append(plain_pieces(w, capture.fed[n]))
        return True

    def _probe(self, names: list[str], storages) -> TracingCapture:
        module = self._adapter.module
        # Probe contents are left unset: writes are suppressed, so a plain copy never reads
        # them, and not zero-filling saves a page-faulting pass over model-sized memory.
        fed = {n: torch.empty(self._specs[n].shape, dtype=self._specs[n].torch_dtype) for n in names}
        before = storage_fingerprint(module)
        saved = _snapshot_slots(module)
        capture = TracingCapture(storages, fed, execute=False)
        try:
            with torch.no_grad(), capture:
                self._adapter.load_weights(fed.items())
        except Exception as e:
            _restore_slots(module, saved)
            raise PlacementError(f"the loader failed on probes {names[:3]}: {e}") from e
        if storage_fingerprint(module) != before:
            _restore_slots(module, saved)
            raise PlacementError(
                f"the loader rebinds parameters or buffers instead of writing into them (probing {names[:3]}); "
                "in-place apply needs a loader that copies into existing storage (restored the originals)"
            )
        return capture

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
                raise PlacementError(f"load group {list(unit)[:3]} mixes dropped and transformed tensors")
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
            numel = owner.tensor.untyped_storage().nbytes() // owner.tensor.element_size()
            counter = torch.zeros(numel, dtype=torch.int16)
            masks = {}
            for name in names:
                mask = torch.zeros(numel, dtype=torch.bool)
                total = 0
                for w in writes[name]:
                    if w.dest_owner.tensor.untyped_storage().data_ptr() != ptr:
                        continue
                    if w.dest.element_size() != owner.tensor.element_size():
                        if out[name].kind in (PlacementKind.DIRECT, PlacementKind.VIEW):
                            raise PlacementError(f"{name}: plain write through a reinterpreting view of {owner.name}")
                        continue  # a transform writing through another dtype: elements not comparable
                    view = torch.as_strided(mask, w.dest.shape, w.dest.stride(), w.dest.storage_offset())
                    view.fill_(True)
                    total += w.dest.numel()
                if total != int(mask.sum()) and out[name].kind in (PlacementKind.DIRECT, PlacementKind.VIEW):
                    p = out[name]
                    out[name] = TensorPlacement(
                        p.spec, PlacementKind.TRANSFORM, p.copies, f"writes elements of {owner.name} more than once"
                    )
                counter += mask
                masks[name] = mask
            if int(counter.max()) > 1:
                shared = sorted(n for n, m in masks.items() if bool((counter[m] > 1).any()))
                raise PlacementError(f"canonical tensors {shared} are written into the same elements of {owner.name}")
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
            fed = {n: mirror[n].clone() if n in mirror else self._unit_tensor(n) for n in unit}
            capture = WriteCapture(storages, fed, execute=False)
            with torch.no_grad(), capture:
                self._adapter.load_weights(fed.items())
            for w in capture.writes:
                with torch.no_grad():
                    would = torch.empty_like(w.dest).copy_(w.source)
                if not torch.equal(int_view(would), int_view(w.dest.detach())):
                    raise PlacementError(
                        f"{name}: the adapter's initial tensor does not reproduce {w.dest_owner.name} "
                        "through the loader (stale checkpoint?)"
                    )

    # -------------------------------------------------------------------- apply
    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        """The checks ``apply`` runs before its first write, without writing: lets a caller
        holding several appliers (one per TP worker) refuse a batch before any of them writes."""
        if self._fingerprint is None:
            self.prewarm()
        if storage_fingerprint(self._adapter.module) != self._fingerprint:
            raise PlacementError("parameters or buffers were rebound since prewarm; call prewarm() again")
        self._validate(deltas)

    def apply(self, deltas: Sequence[TensorDelta]) -> ApplyResult:
        """Apply ``deltas`` in place; validate and prepare everything before the first write."""
        if self._fingerprint is None:
            self.prewarm()
        if storage_fingerprint(self._adapter.module) != self._fingerprint:
            raise PlacementError("parameters or buffers were rebound since prewarm; call prewarm() again")
        grouped = self._validate(deltas)
        with torch.no_grad():
            prepared = {name: self._prepare(name, records) for name, records in grouped.items()}
            view_writes = self._capture_view_xors([p for p in prepared.values() if p.kind is PlacementKind.VIEW])

            # ---- first write from here on ----
            touched: set[str] = set()
            by_unit: dict[tuple[str, ...], list[_Prepared]] = defaultdict(list)
            for p in prepared.values():
                if p.kind is PlacementKind.TRANSFORM:
                    by_unit[self._unit_of.get(p.name, (p.name,))].append(p)
            for unit, ps in by_unit.items():
                self._overwrite_through_loader(unit, ps)
                touched.update(p.name for p in ps)
            for p in prepared.values():
                if p.kind is PlacementKind.DIRECT:
                    _write_direct(self._direct[p.name], p)
                    touched.add(p.name)
                elif p.kind is PlacementKind.TRACED:
                    _write_traced(*self._traced[p.name], p)
                    touched.add(p.name)
                elif p.kind is PlacementKind.EMPTY:
                    touched.add(p.name)
            for name, ws in view_writes.items():
                for w in ws:
                    dest, src = int_view(w.dest), int_view(w.source)
                    assert dest.dtype == src.dtype
                    dest.bitwise_xor_(src)
                touched.add(name)

        dropped = {n for n in grouped if self._placements[n].kind is PlacementKind.DROPPED}
        missing = set(grouped) - touched - dropped
        if missing:
            raise IncompleteApplyError(f"requested but not written: {sorted(missing)[:5]}")
        self._adapter.post_load(frozenset(touched))
        n_xor = sum(d.nnz for ds in grouped.values() for d in ds if d.op is DeltaOp.XOR)
        n_ow = sum(d.nnz for ds in grouped.values() for d in ds if d.op is DeltaOp.OVERWRITE)
        return ApplyResult(
            applied=frozenset(touched),
            dropped=frozenset(dropped),
            through_loader=frozenset(
                n for n, p in prepared.items() if p.kind in (PlacementKind.VIEW, PlacementKind.TRANSFORM)
            ),
            xor_elements=n_xor,
            overwrite_elements=n_ow,
        )

    def _validate(self, deltas: Sequence[TensorDelta]) -> dict[str, list[TensorDelta]]:
        grouped: dict[str, list[TensorDelta]] = defaultdict(list)
        for d in deltas:
            if not isinstance(d, TensorDelta):
                raise DeltaValidationError(f"expected TensorDelta, got {type(d).__name__}")
            spec = self._specs.get(d.name)
            if spec is None:
                raise DeltaValidationError(f"{d.name}: not a canonical tensor of this runtime")
            if d.dtype != spec.dtype or tuple(d.shape) != spec.shape:
                raise DeltaValidationError(
                    f"{d.name}: delta is {d.dtype}{d.shape}, runtime has {spec.dtype}{spec.shape}"
                )
            pos, val = d.positions, d.values
            if not (isinstance(pos, np.ndarray) and pos.dtype == np.int64 and pos.ndim == 1):
                raise DeltaValidationError(f"{d.name}: positions must be a 1-D int64 array")
            if not (isinstance(val, np.ndarray) and val.dtype == BITS_DTYPE[spec.dtype] and val.shape == pos.shape):
                raise DeltaValidationError(f"{d.name}: values must be {BITS_DTYPE[spec.dtype]} matching positions")
            lo, hi = d.element_range if d.element_range is not None else (0, spec.numel)
            if not 0 <= lo <= hi <= spec.numel:
                raise DeltaValidationError(f"{d.name}: element_range {(lo, hi)} outside [0, {spec.numel})")
            if pos.size:
                if pos[0] < lo or pos[-1] >= hi:
                    raise DeltaValidationError(
                        f"{d.name}: positions [{pos[0]}, {pos[-1]}] outside element_range [{lo}, {hi})"
                    )
                if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
                    raise DeltaValidationError(f"{d.name}: positions are not strictly increasing")
            grouped[d.name].append(d)
        for name, records in grouped.items():
            # Records of one tensor may interleave (row-parallel shards split columns, so each
            # rank's range spans nearly the whole tensor), but no element may be named twice:
            # two XORs would cancel.  Disjoint ranges prove it without a sort.
            spans = sorted(r.element_range for r in records if r.nnz)
            if all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:])):
                continue
            merged = np.sort(np.concatenate([r.positions for r in records]))
            repeated = merged[1:][merged[1:] == merged[:-1]]
            if repeated.size:
                raise DeltaValidationError(f"{name}: position {int(repeated[0])} is in more than one record")
        return dict(grouped)

    def _prepare(self, name: str, records: list[TensorDelta]) -> _Prepared:
        kind = self._placements[name].kind
        p = _Prepared(name, kind)
        if kind in (PlacementKind.DROPPED, PlacementKind.EMPTY):
            return p
        xors = [r for r in records if r.op is DeltaOp.XOR and r.nnz]
        ows = [r for r in records if r.op is DeltaOp.OVERWRITE and r.nnz]
        if xors:
            p.xor_idx = np.concatenate([r.positions for r in xors])
            p.xor_val = _signed_bits(np.concatenate([r.values for r in xors]))
        if ows:
            p.ow_idx = np.concatenate([r.positions for r in ows])
            p.ow_val = _signed_bits(np.concatenate([r.values for r in ows]))
        if kind in (PlacementKind.DIRECT, PlacementKind.TRACED):
            return p
        if p.xor_idx is None and p.ow_idx is None:
            p.kind = PlacementKind.EMPTY  # nothing changes: no loader call
            return p
        spec = self._specs[name]
        if kind is PlacementKind.VIEW:
            fed = torch.zeros(spec.shape, dtype=spec.torch_dtype)
            bits = int_view(fed.view(-1)).numpy()
            if p.xor_idx is not None:
                bits[p.xor_idx] = p.xor_val
            if p.ow_idx is not None:  # overwrite = XOR with (current ^ new)
                bits[p.ow_idx] = self._read_view_bits(name)[p.ow_idx] ^ p.ow_val
        else:  # TRANSFORM: patch a copy of the mirror; it replaces the mirror after the load
            fed = self._mirror[name].clone()
            bits = int_view(fed.view(-1)).numpy()
            if p.xor_idx is not None:
                bits[p.xor_idx] ^= p.xor_val
            if p.ow_idx is not None:
                bits[p.ow_idx] = p.ow_val
        p.fed = fed
        return p

    def canonical_bits(self, name: str) -> np.ndarray:
        """The canonical bits the runtime holds now for ``name``: flat, ``BITS_DTYPE`` of its
        wire dtype.  This is the base a context-mode delta is decoded against.

        DIRECT tensors return a zero-copy view of the destination (read it, never write
        through it, and do not keep it across ``apply``); VIEW tensors are gathered back
        through their copies; TRACED tensors through their runs; TRANSFORM tensors read the
        canonical mirror."""
        if not self._placements:
            raise PlacementError("call prewarm() before canonical_bits()")
        try:
            kind = self._placements[name].kind
        except KeyError:
            raise DeltaValidationError(f"{name}: not a canonical tensor of this runtime") from None
        bits_dtype = BITS_DTYPE[self._specs[name].dtype]
        if kind is PlacementKind.DIRECT:
            return self._direct[name].numpy().view(bits_dtype)
        if kind is PlacementKind.VIEW:
            return self._read_view_bits(name).view(bits_dtype)
        if kind is PlacementKind.TRACED:
            runs, flats = self._traced[name]
            owner, dest = runs.locate(np.arange(self._specs[name].numel, dtype=np.int64))
            out = np.empty(owner.size, dtype=flats[0].dtype)
            for i, flat in enumerate(flats):
                sel = owner == i
                out[sel] = flat.take(dest[sel])
            return out.view(bits_dtype)
        if kind is PlacementKind.TRANSFORM:
            return int_view(self._mirror[name].reshape(-1)).numpy().view(bits_dtype)
        if kind is PlacementKind.EMPTY:
            return np.empty(0, dtype=bits_dtype)
        raise PlacementError(f"{name}: the loader drops this tensor; it has no canonical bits here")

    def _read_view_bits(self, name: str) -> np.ndarray:
        """Current canonical bits of a VIEW tensor, gathered back through its copies.

        Elements no copy covers read as 0: the loader drops them, so their value never
        reaches the runtime.  O(numel) int64 index memory; used only for overwrites.
        """
        spec = self._specs[name]
        out = torch.zeros(spec.numel, dtype=_INT_TORCH[spec.torch_dtype.itemsize])
        positions = torch.arange(spec.numel, dtype=torch.int64)
        for w in self._view_writes[name]:
            g = Geometry.of(w.source)
            src_pos = torch.as_strided(positions, g.shape, g.stride, g.offset).expand(w.dest.shape)
            out.index_put_((src_pos.reshape(-1),), int_view(w.dest.detach()).reshape(-1))
        return out.numpy()

    def _capture_view_xors(self, prepared: list[_Prepared]) -> dict[str, list[CapturedWrite]]:
        """Run the loader on XOR-carrying tensors with every write suppressed, and check the
        writes are exactly the prewarm placement (so executing them as XOR is exact)."""
        if not prepared:
            return {}
        fed = {p.name: p.fed for p in prepared}
        checked = list(fed)
        for p in prepared:  # the loader needs whole units: other members carry zero XOR bits
            for n in self._unit_of.get(p.name, ()):
                if n not in fed:
                    fed[n] = torch.zeros(self._specs[n].shape, dtype=self._specs[n].torch_dtype)
        capture = WriteCapture(module_storages(self._adapter.module), fed, execute=False)
        with capture:
            self._adapter.load_weights(fed.items())
        out: dict[str, list[CapturedWrite]] = defaultdict(list)
        for w in capture.writes:
            if not w.plain or w.fed_name is None:
                raise PlacementError(
                    f"loader made a non-plain write {w.op} into {w.dest_owner.name} during a VIEW apply"
                )
            out[w.fed_name].append(w)
        for name in checked:
            seen = Counter((w.dest_owner.name, w.dest_geometry, Geometry.of(w.source)) for w in out.get(name, []))
            want = Counter((c.dest, c.dest_geometry, c.source_geometry) for c in self._placements[name].copies)
            if seen != want:
                raise PlacementError(f"{name}: the loader's placement changed since prewarm; call prewarm() again")
        return dict(out)

    def _overwrite_through_loader(self, unit: tuple[str, ...], ps: list[_Prepared]) -> None:
        """Feed the new mirrors of ``ps`` (and the current ones of the rest of their load
        unit) through the loader, executing its writes."""
        fed = {n: self._unit_tensor(n) for n in unit}
        fed.update({p.name: p.fed for p in ps})
        capture = WriteCapture(module_storages(self._adapter.module), fed, execute=True)
        with capture:
            self._adapter.load_weights(fed.items())
        want = {c.dest for n in unit for c in self._placements[n].copies}
        if {w.dest_owner.name for w in capture.writes} != want:
            raise IncompleteApplyError(
                f"{ps[0].name}: the loader wrote other destinations than at prewarm ({sorted(want)[:4]})"
            )
        for p in ps:
            self._mirror[p.name] = p.fed

    def _unit_tensor(self, name: str) -> torch.Tensor:
        spec = self._specs[name]
        if spec.numel == 0:
            return torch.empty(spec.shape, dtype=spec.torch_dtype)
        return self._mirror[name]


def _write_direct(flat: torch.Tensor, p: _Prepared) -> None:
    """O(nnz) gather / XOR / scatter on the flat integer view of a DIRECT destination,
    through numpy's take/put (about 2x faster than ``index_put_`` on CPU).  DIRECT
    destinations are CPU tensors: a plain copy has source and destination on one device,
    and probes are fed on CPU (an accelerator runtime's copies classify as TRANSFORM until
    probes are fed on its device)."""
    bits = flat.numpy()
    if p.xor_idx is not None:
        assert p.xor_val.dtype == bits.dtype
        old = bits.take(p.xor_idx)
        np.bitwise_xor(old, p.xor_val, out=old)
        bits.put(p.xor_idx, old)
    if p.ow_idx is not None:
        assert p.ow_val.dtype == bits.dtype
        bits.put(p.ow_idx, p.ow_val)


def _is_direct(spec: TensorSpec, writes: list[CapturedWrite], copies: tuple[CopyPlacement, ...]) -> bool:
    return (
        len(writes) == 1
        and len(copies) == 1
        and copies[0].source_geometry is not None
        and copies[0].source_geometry.is_contiguous_whole(spec.shape)
        and tuple(writes[0].dest.shape) == spec.shape
        and writes[0].dest.is_contiguous()
    )


def _write_traced(runs: Runs, flats: list[np.ndarray], p: _Prepared) -> None:
    """O(nnz log runs): locate changed canonical elements through the runs, then the same
    gather / XOR / scatter as ``_write_direct`` on each destination storage."""
    for idx, val, xor in ((p.xor_idx, p.xor_val, True), (p.ow_idx, p.ow_val, False)):
        if idx is None:
            continue
        owner, dest = runs.locate(idx)
        for i, flat in enumerate(flats):
            sel = owner == i if len(flats) > 1 else slice(None)
            d, v = dest[sel], val[sel]
            assert v.dtype == flat.dtype
            if xor:
                old = flat.take(d)
                np.bitwise_xor(old, v, out=old)
                flat.put(d, old)
            else:
                flat.put(d, v)


def _describe_nonplain(spec: TensorSpec, w: CapturedWrite) -> str:
    if w.source is None:
        return f"{w.op} into {w.dest_owner.name}"
    if w.fed_name is None:
        return f"{w.op} into {w.dest_owner.name} from a computed tensor (not a view of the fed {spec.name})"
    if w.fed_name != spec.name:
        return f"{w.op} into {w.dest_owner.name} from the tensor fed as {w.fed_name}"
    return f"{w.op} casts {w.source.dtype} -> {w.dest.dtype} into {w.dest_owner.name}"


def _snapshot_slots(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool, torch.Tensor | None]]:
    slots = []
    for sub in module.modules():
        for key, t in sub._parameters.items():
            slots.append((sub, key, False, t))
        for key, t in sub._buffers.items():
            slots.append((sub, key, True, t))
    return slots


def _restore_slots(module: torch.nn.Module, slots) -> None:
    del module
    for sub, key, is_buffer, t in slots:
        (sub._buffers if is_buffer else sub._parameters)[key] = t
