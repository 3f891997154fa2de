"""Apply canonical XOR / overwrite deltas in place, executing a ``PlacementPlan``.

Where each canonical tensor lives in the runtime is learnt at ``prewarm`` by
``receiver/probe.py`` (probing through the runtime's own loader) and
``receiver/placement.py`` (classification, the frozen plan); a version's records are checked against the runtime's tensor specs by
``receiver/served.py::validate_version``.  This module executes a validated version
against the plan, per placement kind:

* ``DIRECT``: XOR (or overwrite) exactly the changed elements of an integer view of the
  destination: O(nnz) work, no loader call.
* ``VIEW``: feed the loader a zero canonical tensor carrying the XOR bits at the changed
  positions, capture its copies without running them, check they match the plan, then run
  each as ``dest ^= src`` on integer views.  A copy that copies ``x`` now XORs ``x``: exact
  because, for a bit-preserving placement, destination bits equal fed bits.  An OVERWRITE
  becomes the XOR ``current ^ new``, the current canonical bits read back through the same
  copies.
* ``TRANSFORM``: apply the delta to the canonical mirror (seeded by the planner) and feed
  the whole new tensor, with the rest of its load unit, through the loader, executing its
  writes: exactly what a dense refit does.  Costs a canonical copy of each such tensor in
  host memory and O(numel) per changed tensor per apply.
* ``TRACED``: XOR / overwrite the changed elements through the plan's affine runs:
  O(nnz log runs), no loader call.
* ``DROPPED`` / ``EMPTY``: validated, nothing written.

Atomicity: ``apply`` validates the whole batch (names, dtypes, shapes, ranges, positions,
placement unchanged since prewarm) and prepares every write before the first one; only a
runtime loader that raises while executing a ``TRANSFORM`` overwrite can leave a batch
half-applied (those run first, so a failure on the first leaves everything unchanged).

Two phases, for a runtime that serves while a version waits (vLLM's weight-transfer
backend): ``stage`` writes ahead the XOR records that land only in parameters the runtime
does not serve from (the adapter's ``unserved()``: on vLLM's CPU build, the plain weights
kept beside the packed GEMM kernels) and has the adapter build, not install, what serves
from them (``prepare``); ``apply(deltas, staged)`` later writes the rest and swaps in what
was built (``install``), so the pause holds only the served writes.  ``unstage`` undoes a
stage whose version is never applied.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.dtypes import int_view
from nemo_dcr.errors import ValidationError, WrongTypeError
from nemo_dcr.receiver.capture import CapturedWrite, Geometry, WriteCapture, module_storages, storage_fingerprint
from nemo_dcr.receiver.errors import DeltaValidationError, IncompleteApplyError, LoaderError
from nemo_dcr.receiver.placement import (
    CopyPlacement,
    CoveragePolicy,
    PlacementKind,
    PlacementPlan,
    Planner,
    TensorPlacement,
    TracedTarget,
    unit_tensor,
)
from nemo_dcr.receiver.runtime import RuntimeAdapter, TensorSpec
from nemo_dcr.receiver.served import validate_version

__all__ = [
    "ApplyResult",
    "CopyPlacement",
    "CoveragePolicy",
    "DeltaApplier",
    "PlacementKind",
    "PlacementPlan",
    "Staging",
    "TensorPlacement",
    "int_view",
]

def _signed_bits(values: np.ndarray) -> np.ndarray:
    """Unsigned wire bit patterns -> the integer dtype ``int_view(...).numpy()`` has (no copy)."""
    return np.ascontiguousarray(values).view(dtypes.torch_int_np(values.dtype.itemsize))


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
class _Prepared:
    """Everything a name needs for the commit phase, computed before any write."""

    name: str
    kind: PlacementKind
    xor_idx: np.ndarray | None = None  # int64 canonical flat positions
    xor_val: np.ndarray | None = None  # same-width integers (``_signed_bits``)
    ow_idx: np.ndarray | None = None
    ow_val: np.ndarray | None = None
    fed: torch.Tensor | None = None  # VIEW: zero tensor with XOR bits; TRANSFORM: new mirror
    view_writes: list[CapturedWrite] | None = None  # VIEW: the copies executed as XOR


_STAGEABLE = (PlacementKind.DIRECT, PlacementKind.VIEW, PlacementKind.TRACED)


@dataclass
class Staging:
    """What ``DeltaApplier.stage`` wrote ahead of ``apply``."""

    names: frozenset[str]
    """Canonical names whose records are all written (in unserved parameters only)."""
    prepared: object
    """The adapter's ``prepare`` result, for its ``install``."""
    written: dict[str, _Prepared] | None = None
    """The records written (``None`` once unstaged)."""
    covered: frozenset[str] = frozenset()
    """Names every record of which ``prepare`` saw (written, or patched into a copy); a
    kernel built from a weight that other records also write is rebuilt by ``install``."""


class DeltaApplier:
    """In-place delta apply for one runtime (see the module docstring).

    probe_bytes: prewarm feeds probes in groups of at most this many bytes per loader call;
        a group whose writes cannot all be attributed to one fed tensor is re-probed load
        unit by load unit.
    """

    def __init__(
        self,
        adapter: RuntimeAdapter,
        *,
        coverage: CoveragePolicy = CoveragePolicy.STRICT,
        probe_bytes: int = 1 << 30,
    ) -> None:
        if not isinstance(adapter, RuntimeAdapter):
            raise WrongTypeError(f"{type(adapter).__name__} does not implement RuntimeAdapter")
        if probe_bytes <= 0:
            raise ValidationError("probe_bytes must be positive")
        self._adapter = adapter
        self._specs: dict[str, TensorSpec] = dict(adapter.tensor_specs())
        self._planner = Planner(adapter, self._specs, coverage=coverage, probe_bytes=probe_bytes)
        self._plan: PlacementPlan | None = None
        # canonical bits of the TRANSFORM tensors; an apply replaces entries, never writes into one
        self._mirror: dict[str, torch.Tensor] = {}

    @property
    def adapter(self) -> RuntimeAdapter:
        return self._adapter

    @property
    def placements(self) -> Mapping[str, TensorPlacement]:
        """Read-only; empty before ``prewarm``."""
        return self._plan.placements if self._plan is not None else MappingProxyType({})

    @property
    def plan(self) -> PlacementPlan | None:
        """The plan ``apply`` executes (``None`` before ``prewarm``)."""
        return self._plan

    def prewarm(self) -> Mapping[str, TensorPlacement]:
        """Learn where the loader puts every canonical tensor; the module is not written."""
        self._plan, self._mirror = self._planner.plan(self._mirror)
        return self.placements

    def _current_plan(self) -> PlacementPlan:
        if self._plan is None:
            self.prewarm()
        if storage_fingerprint(self._adapter.module) != self._plan.fingerprint:
            raise LoaderError("parameters or buffers were rebound since prewarm; call prewarm() again")
        return self._plan

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        """The checks ``apply`` runs before its first write, without writing: lets a caller
        holding several appliers (one per TP worker) refuse a batch before any of them writes."""
        self._current_plan()
        validate_version(self._specs, deltas)

    def stage(self, deltas: Sequence[TensorDelta]) -> Staging:
        """Phase one of a two-phase apply, for a runtime that keeps serving meanwhile.

        Writes the records of ``deltas`` that land only in parameters the runtime does not
        serve from (the adapter's optional ``unserved()``), then has the adapter build what
        serves from them without installing it (its ``prepare(names, copies)``, e.g. vLLM's
        packed GEMM kernels): nothing a forward pass reads changes.  Parameters that are
        served but also feed such a build (the adapter's ``kernel_weights()``, e.g. vLLM's
        embedding table) are copied and patched here, the copies given to ``prepare``; the
        parameters themselves wait for ``apply``.  ``apply(deltas, staged)`` then writes the
        rest and installs what was prepared (the adapter's ``install(prepared, names,
        covered)`` in place of ``post_load(names)``); ``unstage`` undoes this one.  Only XOR records through
        DIRECT, VIEW and TRACED placements are staged (an XOR applied twice is undone), and
        only DIRECT ones are copied; everything else waits for ``apply``.  An adapter without
        ``unserved`` stages nothing."""
        plan = self._current_plan()
        grouped = validate_version(self._specs, deltas)
        if getattr(self._adapter, "unserved", None) is None:
            return Staging(frozenset(), None, {})
        unserved, kernel_weights = self._adapter.unserved(), self._adapter.kernel_weights()

        def lands_in(n: str, recs: list[TensorDelta], owners: frozenset[str], kinds) -> bool:
            p = plan.placements[n]
            return (p.kind in kinds and bool(p.copies) and all(c.dest in owners for c in p.copies)
                    and all(r.op is DeltaOp.XOR for r in recs))

        early = {n: recs for n, recs in grouped.items() if lands_in(n, recs, unserved, _STAGEABLE)}
        copied = {n: recs for n, recs in grouped.items()
                  if n not in early and lands_in(n, recs, kernel_weights, (PlacementKind.DIRECT,))}
        if not early and not copied:
            return Staging(frozenset(), None, {})
        with torch.no_grad():
            copies: dict[str, torch.Tensor] = {}
            owners = {o.name: o.tensor for o in module_storages(self._adapter.module).values()} if copied else {}
            for n, recs in copied.items():  # patched copies of served weights, for prepare only
                (c,) = plan.placements[n].copies
                if c.dest not in copies:  # the whole weight: several tensors may be fused into it
                    copies[c.dest] = int_view(owners[c.dest].detach().reshape(-1)).clone()
                at = c.dest_geometry.offset  # this tensor's slice, in the owner's elements
                _write_direct(copies[c.dest][at:at + plan.direct[n].numel()], self._prepare(n, recs))
            touched, written = self._write(plan, early)
            try:
                prepared = self._adapter.prepare(frozenset(touched | copied.keys()), copies)
            except BaseException:
                self._rewrite(plan, written)
                raise
        return Staging(frozenset(early), prepared, written, frozenset(early) | frozenset(copied))

    def unstage(self, staged: Staging) -> None:
        """Undo ``stage``: its XORs again; what the adapter prepared is dropped unused."""
        if staged.names:
            with torch.no_grad():
                self._rewrite(self._current_plan(), staged.written)
            staged.written = None

    def apply(self, deltas: Sequence[TensorDelta], staged: Staging | None = None) -> ApplyResult:
        """Apply ``deltas`` in place; validate and prepare everything before the first write.
        With ``staged`` (``stage(deltas)``'s result): only the records it did not write, and
        install what it prepared first."""
        plan = self._current_plan()
        grouped = validate_version(self._specs, deltas)
        early = staged.names if staged is not None else frozenset()
        if early and staged.written is None:
            raise DeltaValidationError("apply: the staged records were unstaged")
        if not early <= grouped.keys():
            self.unstage(staged)
            raise DeltaValidationError("apply: the staged records are not this batch's (staged writes undone)")
        with torch.no_grad():
            late = {n: recs for n, recs in grouped.items() if n not in early}
            try:
                touched, written = self._write(plan, late)
            except BaseException:
                if staged is not None:  # the batch is refused whole: the staged part too
                    self.unstage(staged)
                raise
        dropped = {n for n in grouped if plan.placements[n].kind is PlacementKind.DROPPED}
        missing = set(grouped) - touched - early - dropped
        if missing:
            raise IncompleteApplyError(f"requested but not written: {sorted(missing)[:5]}")
        if staged is not None and staged.prepared is not None:
            self._adapter.install(staged.prepared, frozenset(touched | early), staged.covered)
        else:
            self._adapter.post_load(frozenset(touched))
        n_xor = sum(d.nnz for ds in grouped.values() for d in ds if d.op is DeltaOp.XOR)
        n_ow = sum(d.nnz for ds in grouped.values() for d in ds if d.op is DeltaOp.OVERWRITE)
        return ApplyResult(
            applied=frozenset(touched | early),
            dropped=frozenset(dropped),
            through_loader=frozenset(
                {n for n in early if plan.placements[n].kind is PlacementKind.VIEW}
                | {n for n, p in written.items() if p.kind in (PlacementKind.VIEW, PlacementKind.TRANSFORM)}
            ),
            xor_elements=n_xor,
            overwrite_elements=n_ow,
        )

    def _write(self, plan: PlacementPlan, grouped: Mapping[str, list[TensorDelta]]
               ) -> tuple[set[str], dict[str, _Prepared]]:
        """Prepare every write of ``grouped`` (nothing written if that fails), then write:
        TRANSFORM units first, then DIRECT, TRACED and VIEW records.  Returns the names
        written and their prepared records (``_rewrite`` XORs them again)."""
        prepared = {name: self._prepare(name, records) for name, records in grouped.items()}
        view_writes = self._capture_view_xors([p for p in prepared.values() if p.kind is PlacementKind.VIEW])

        # ---- first write from here on ----
        touched: set[str] = set()
        by_unit: dict[tuple[str, ...], list[_Prepared]] = defaultdict(list)
        for p in prepared.values():
            if p.kind is PlacementKind.TRANSFORM:
                by_unit[plan.unit_of.get(p.name, (p.name,))].append(p)
        for unit, ps in by_unit.items():
            self._overwrite_through_loader(unit, ps)
            touched.update(p.name for p in ps)
        for p in prepared.values():
            if p.kind is PlacementKind.DIRECT:
                _write_direct(plan.direct[p.name], p)
                touched.add(p.name)
            elif p.kind is PlacementKind.TRACED:
                _write_traced(plan.traced[p.name], p)
                touched.add(p.name)
            elif p.kind is PlacementKind.EMPTY:
                touched.add(p.name)
        for name, ws in view_writes.items():
            _xor_views(ws)
            touched.add(name)
            prepared[name].view_writes = ws
        return touched, prepared

    def _rewrite(self, plan: PlacementPlan, written: Mapping[str, _Prepared]) -> None:
        """XOR the XOR-only records ``_write`` wrote once more (undoing them)."""
        for p in written.values():
            if p.ow_idx is not None or p.kind is PlacementKind.TRANSFORM:
                raise LoaderError(f"{p.name}: only XOR records can be undone by writing them again")
            if p.kind is PlacementKind.DIRECT:
                _write_direct(plan.direct[p.name], p)
            elif p.kind is PlacementKind.TRACED:
                _write_traced(plan.traced[p.name], p)
            elif p.kind is PlacementKind.VIEW:
                _xor_views(p.view_writes)

    def _prepare(self, name: str, records: list[TensorDelta]) -> _Prepared:
        kind = self._plan.placements[name].kind
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
        if not self.placements:
            raise LoaderError("call prewarm() before canonical_bits()")
        try:
            kind = self._plan.placements[name].kind
        except KeyError:
            raise DeltaValidationError(f"{name}: not a canonical tensor of this runtime") from None
        bits_dtype = BITS_DTYPE[self._specs[name].dtype]
        if kind is PlacementKind.DIRECT:
            return self._plan.direct[name].numpy().view(bits_dtype)
        if kind is PlacementKind.VIEW:
            return self._read_view_bits(name).view(bits_dtype)
        if kind is PlacementKind.TRACED:
            target = self._plan.traced[name]
            runs, flats = target.runs, target.flats
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
        raise LoaderError(f"{name}: the loader drops this tensor; it has no canonical bits here")

    def canonical_bits_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        """``canonical_bits(name)[positions]`` (a copy), reading only those elements where
        the placement allows (DIRECT, TRACED): the journal's undo values of a version cost
        O(changed), not O(numel) per changed tensor."""
        placement = self._plan.placements.get(name) if self.placements else None
        if placement is None:  # canonical_bits says why
            return np.asarray(self.canonical_bits(name))[positions]
        kind, bits_dtype = placement.kind, BITS_DTYPE[self._specs[name].dtype]
        if kind is PlacementKind.DIRECT:
            return self._plan.direct[name].numpy().view(bits_dtype).take(positions)
        if kind is PlacementKind.TRACED:
            target = self._plan.traced[name]
            owner, dest = target.runs.locate(positions)
            if len(target.flats) == 1:
                return target.flats[0].take(dest).view(bits_dtype)
            out = np.empty(owner.size, dtype=target.flats[0].dtype)
            for i, flat in enumerate(target.flats):
                sel = owner == i
                out[sel] = flat.take(dest[sel])
            return out.view(bits_dtype)
        return np.asarray(self.canonical_bits(name))[positions]

    def _read_view_bits(self, name: str) -> np.ndarray:
        """Current canonical bits of a VIEW tensor, gathered back through its copies.

        Elements no copy covers read as 0: the loader drops them, so their value never
        reaches the runtime.  O(numel) int64 index memory; used only for overwrites.
        """
        spec = self._specs[name]
        out = int_view(torch.zeros(spec.numel, dtype=spec.torch_dtype))
        positions = torch.arange(spec.numel, dtype=torch.int64)
        for w in self._plan.view_writes[name]:
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
            for n in self._plan.unit_of.get(p.name, ()):
                if n not in fed:
                    fed[n] = torch.zeros(self._specs[n].shape, dtype=self._specs[n].torch_dtype)
        capture = WriteCapture(module_storages(self._adapter.module), fed, execute=False)
        with capture:
            self._adapter.load_weights(fed.items())
        out: dict[str, list[CapturedWrite]] = defaultdict(list)
        for w in capture.writes:
            if not w.plain or w.fed_name is None:
                raise LoaderError(
                    f"loader made a non-plain write {w.op} into {w.dest_owner.name} during a VIEW apply"
                )
            out[w.fed_name].append(w)
        for name in checked:
            seen = Counter((w.dest_owner.name, w.dest_geometry, Geometry.of(w.source)) for w in out.get(name, []))
            want = Counter((c.dest, c.dest_geometry, c.source_geometry) for c in self._plan.placements[name].copies)
            if seen != want:
                raise LoaderError(f"{name}: the loader's placement changed since prewarm; call prewarm() again")
        return dict(out)

    def _overwrite_through_loader(self, unit: tuple[str, ...], ps: list[_Prepared]) -> None:
        """Feed the new mirrors of ``ps`` (and the current ones of the rest of their load
        unit) through the loader, executing its writes."""
        fed = {n: unit_tensor(self._specs[n], self._mirror) for n in unit}
        fed.update({p.name: p.fed for p in ps})
        capture = WriteCapture(module_storages(self._adapter.module), fed, execute=True)
        with capture:
            self._adapter.load_weights(fed.items())
        want = {c.dest for n in unit for c in self._plan.placements[n].copies}
        if {w.dest_owner.name for w in capture.writes} != want:
            raise IncompleteApplyError(
                f"{ps[0].name}: the loader wrote other destinations than at prewarm ({sorted(want)[:4]})"
            )
        for p in ps:
            self._mirror[p.name] = p.fed


def _xor_views(writes: Sequence[CapturedWrite]) -> None:
    for w in writes:
        dest, src = int_view(w.dest), int_view(w.source)
        assert dest.dtype == src.dtype
        dest.bitwise_xor_(src)


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


def _write_traced(target: TracedTarget, p: _Prepared) -> None:
    """O(nnz log runs): locate changed canonical elements through the runs, then the same
    gather / XOR / scatter as ``_write_direct`` on each destination storage."""
    runs, flats = target.runs, target.flats
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
