"""The canonical bits a runtime holds, as the mapping the decoder and the journal read."""
from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np


class HeldBits(Mapping):
    """Context-mode base for the decoder: the canonical bits the runtime holds now (the
    version being applied is the base of), fetched on first use per tensor.  Valid only
    until the first write, which is why every chunk is decoded before any apply.  Chunks
    decode on several threads: a tensor is fetched once, under a lock."""

    def __init__(self, served):
        self._served = served
        self._names = frozenset(served.tensor_specs())
        self._cache: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def _load(self, name: str) -> np.ndarray:
        return self._served.canonical_bits(name)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)  # the Mapping protocol (``in``, ``get``), not an error report
        got = self._cache.get(name)
        if got is None:
            with self._lock:
                got = self._cache.get(name)
                if got is None:
                    got = self._cache[name] = self._load(name)
        return got

    def at(self, name: str, positions: np.ndarray) -> np.ndarray:
        """``self[name][positions]`` (a copy).  A tensor not read yet is read only at those
        positions where the model offers it (``canonical_bits_at``), and not cached."""
        got = self._cache.get(name)
        if got is not None:
            return got[positions]
        if name not in self._names:
            raise KeyError(name)
        read_at = getattr(self._served, "canonical_bits_at", None)
        if read_at is None or type(self) is not HeldBits:  # a mirror keeps what it reads
            return self[name][positions]
        return read_at(name, positions)

    def at_many(self, requests: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """``at`` of every ``(name, positions)``; the ones not cached in one call to the model
        where it offers ``canonical_bits_at_many`` (a vLLM engine: one round trip to its
        workers, not one per tensor)."""
        many = getattr(self._served, "canonical_bits_at_many", None)
        if many is None or type(self) is not HeldBits:
            return [self.at(name, pos) for name, pos in requests]
        out: list[np.ndarray | None] = [None] * len(requests)
        ask = []
        for i, (name, pos) in enumerate(requests):
            got = self._cache.get(name)
            if got is not None:
                out[i] = got[pos]
            elif name not in self._names:
                raise KeyError(name)
            else:
                ask.append(i)
        for i, bits in zip(ask, many([requests[i] for i in ask]) if ask else []):
            out[i] = bits
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class MirrorBits(HeldBits):
    """Writable copies of the held bits (made on first use per tensor), for decoding and
    applying a chain of versions without touching the runtime; ``held`` keeps the bits as
    first read."""

    def __init__(self, served):
        super().__init__(served)
        self.held: dict[str, np.ndarray] = {}

    def _load(self, name: str) -> np.ndarray:
        self.held[name] = self._served.canonical_bits(name)
        return np.array(self.held[name], copy=True)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self._cache
