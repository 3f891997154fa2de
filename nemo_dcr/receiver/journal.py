"""Undo/redo journal of the version a receiver applies tentatively.

Before the first write of version ``v`` the journal records, for every changed element,
its position, its bits at the base (``old``) and its bits at ``v`` (``new``).  Both
repairs are overwrites, so they are idempotent and correct whichever writes happened
before a failure (replaying an XOR would undo the elements already written):

* undo (``v`` aborted, or the apply failed half-way): overwrite with ``old``;
* redo (an interrupted apply of a version that must end applied): overwrite with ``new``.

With a directory, the journal is also written to disk (``journal-v<v>.safetensors`` +
``journal.json``, fsync'd, then renamed) before the first write, for a runtime whose
weights outlive the receiver process; :meth:`ApplyJournal.load` reads it back.  Without
one it lives in memory (enough to repair a failed apply in a live process).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta
from nemo_dcr.errors import FormatError, ProtocolError

_STATE = "journal.json"


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    element_range: tuple[int, int] | None
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray

    def record(self, values: np.ndarray) -> TensorDelta:
        return TensorDelta(name=self.name, dtype=self.dtype, shape=self.shape, op=DeltaOp.OVERWRITE,
                           positions=self.positions, values=values, element_range=self.element_range)


class ApplyJournal:
    def __init__(self, directory: str | None = None):
        self.directory = directory
        self.version: int | None = None
        self.base_version: int | None = None
        self.phase = "idle"
        self._entries: list[_Entry] = []
        if directory:
            os.makedirs(directory, exist_ok=True)

    @property
    def active(self) -> bool:
        return self.version is not None

    def begin(self, version: int, base_version: int, deltas: Sequence[TensorDelta],
              base_bits: Mapping[str, np.ndarray]) -> None:
        """Record undo and redo values of ``deltas`` (``base_bits[name]``: the flat canonical
        bits held now) and persist them; call before the first write."""
        if self.active:
            raise ProtocolError(f"journal already holds version {self.version}")
        entries = []
        changed = [d for d in deltas if d.nnz]
        at_many = getattr(base_bits, "at_many", None)  # HeldBits: only the changed elements, in one read
        olds = at_many([(d.name, d.positions) for d in changed]) if at_many else \
            [np.asarray(base_bits[d.name])[d.positions] for d in changed]  # copies
        for d, old in zip(changed, olds):
            new = old ^ d.values if d.op is DeltaOp.XOR else d.values.copy()
            entries.append(_Entry(d.name, d.dtype, tuple(d.shape), d.element_range, d.positions, old, new))
        self._entries = entries
        self.version, self.base_version = version, base_version
        self._persist("writing")

    def mark(self, phase: str) -> None:
        """``applied`` once every write is done (tentative until the decision)."""
        self._persist(phase)

    def undo_records(self) -> list[TensorDelta]:
        return [e.record(e.old) for e in self._entries]

    def redo_records(self) -> list[TensorDelta]:
        return [e.record(e.new) for e in self._entries]

    def clear(self) -> None:
        if self.directory and self.version is not None:
            for f in (_STATE, f"journal-v{self.version}.safetensors"):
                try:
                    os.unlink(os.path.join(self.directory, f))
                except FileNotFoundError:
                    pass
        self.version = self.base_version = None
        self.phase = "idle"
        self._entries = []

    def clear_stale(self) -> bool:
        """Drop a journal an earlier process left on disk (its weights are gone, e.g. an
        in-process runtime that reloaded version 0); True if there was one."""
        if self.active or not self.directory:
            return False
        found = False
        for f in os.listdir(self.directory):
            if f == _STATE or (f.startswith("journal-v") and f.endswith((".safetensors", ".tmp"))):
                os.unlink(os.path.join(self.directory, f))
                found = True
        return found

    # ------------------------------------------------------------------ disk
    def _persist(self, phase: str) -> None:
        self.phase = phase
        if not self.directory:
            return
        from safetensors.numpy import save_file

        data = f"journal-v{self.version}.safetensors"
        path = os.path.join(self.directory, data)
        if phase == "writing":
            arrays = {}
            for i, e in enumerate(self._entries):
                arrays[f"{i}.positions"] = e.positions
                arrays[f"{i}.old"] = e.old
                arrays[f"{i}.new"] = e.new
            write_durably(path, lambda p: save_file(arrays, p))
        state = {"version": self.version, "base_version": self.base_version, "phase": phase, "data": data,
                 "entries": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape),
                              "element_range": list(e.element_range) if e.element_range else None}
                             for e in self._entries]}
        try:
            write_durably(os.path.join(self.directory, _STATE), lambda p: write_text(p, json.dumps(state)))
        except OSError:
            if phase == "writing":  # nothing written to the weights yet: no journal of this version either
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise

    @classmethod
    def load(cls, directory: str) -> ApplyJournal:
        """The journal a previous receiver process left in ``directory`` (idle if none)."""
        j = cls(directory)
        path = os.path.join(directory, _STATE)
        if not os.path.exists(path):
            return j
        from safetensors.numpy import load_file

        try:
            with open(path) as f:
                state = json.load(f)
            arrays = load_file(os.path.join(directory, state["data"]))
            entries = []
            for i, m in enumerate(state["entries"]):
                dt = BITS_DTYPE[m["dtype"]]
                old, new = arrays[f"{i}.old"].astype(dt, copy=False), arrays[f"{i}.new"].astype(dt, copy=False)
                er = tuple(m["element_range"]) if m["element_range"] else None
                entries.append(_Entry(m["name"], m["dtype"], tuple(m["shape"]), er,
                                      arrays[f"{i}.positions"].astype(np.int64, copy=False), old, new))
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise FormatError(f"receiver journal {path}: unreadable ({type(e).__name__}: {e})") from None
        j._entries, j.version, j.base_version, j.phase = entries, state["version"], state["base_version"], state["phase"]
        return j


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def write_durably(path: str, write) -> None:
    """``write(tmp)``, fsync, then rename over ``path``: a crash leaves the old file or the new."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        # e.g. ENOSPC: ``path`` keeps its old content; the partial temporary file goes, so
        # a full disk is not made fuller.  The OSError itself propagates unchanged: it is
        # not a refusal the follower may answer and go on from (the weights may already
        # hold bits this record was to describe); the receiver stops, and a restart
        # repairs from the journal.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_committed(path: str, version: int, digest: str) -> None:
    """The receiver's own record of what it committed (its link in the run's chain), next
    to the journal: a restart over persistent weights reads both."""
    write_durably(path, lambda p: write_text(p, json.dumps({"committed": version, "digest": digest})))


def read_committed(path: str) -> tuple[int, str]:
    """(version, decision digest) recorded by :func:`write_committed`; (0, '') when none."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return 0, ""
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"{path}: unreadable committed-version record ({e})") from None
    if not isinstance(rec, dict) or "committed" not in rec or "digest" not in rec:
        raise ProtocolError(f"{path}: unreadable committed-version record (not an object with committed and digest)")
    v, digest = rec["committed"], rec["digest"]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or not isinstance(digest, str):
        raise ProtocolError(f"{path}: committed version must be a non-negative int with a digest, got {v!r}")
    return v, digest
