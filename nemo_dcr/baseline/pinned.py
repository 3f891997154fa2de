"""The committed bits of each local training shard, and the staged change to them.

The trainer diffs against the *committed* baseline (the version every receiver holds),
not against the previous step: if a version is not committed (a receiver did not
acknowledge it), the next delta is taken from the same baseline and still applies to what
the receivers hold.  Advancing the baseline replays only the staged XOR masks
(O(changed) work), so it costs nothing proportional to the model size.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.kernels import XorDiff, bits_view_np, xor_diff


class Change(NamedTuple):
    """One parameter's staged change: flat positions (sorted) and the XOR at each."""

    positions: np.ndarray
    xor_values: np.ndarray


class Baseline:
    def __init__(self, params: Mapping[str, torch.Tensor], *, version: int = 0):
        pin = torch.cuda.is_available()
        self._bits: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.detach())
            self._bits[name] = host
        self._staged: dict[str, Change] = {}
        self.version = version

    def reset(self, params: Mapping[str, torch.Tensor], *, version: int) -> None:
        """Take the committed bits from ``params`` again (into the same host buffers) and
        drop anything staged: a run starts, or resumes, from the weights the parameters hold
        at that moment, not from whatever they held when the baseline was built."""
        if list(params) != list(self._bits):
            raise ValidationError(f"reset with other parameters: {sorted(set(params) ^ set(self._bits))[:4]}")
        for name, p in params.items():
            host = self._bits[name]
            if p.dtype != host.dtype or tuple(p.shape) != tuple(host.shape):
                raise ValidationError(f"{name}: {p.dtype}{tuple(p.shape)} vs baseline {host.dtype}{tuple(host.shape)}")
            host.copy_(p.detach())
        self._staged.clear()
        self.version = version

    def names(self) -> list[str]:
        return list(self._bits)

    def diff(self, name: str, current: torch.Tensor) -> XorDiff:
        """XOR of ``current`` against the committed bits of ``name``; staged for commit."""
        base = self._bits[name]
        if current.dtype != base.dtype or current.shape != base.shape:
            raise ValidationError(f"{name}: {current.dtype}{tuple(current.shape)} vs baseline {base.dtype}{tuple(base.shape)}")
        d = xor_diff(current.detach(), base)
        self._staged[name] = Change(d.positions, d.xor_values)
        return d

    def diff_many(self, params: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, Change]]:
        """``diff`` of several parameters of one dtype in one XOR pass over their
        concatenation; returns the changed ones only, in the order given, each staged.

        For the many small parameters of an MoE model (3 per expert in each layer: tens of
        thousands), where a pass per parameter costs more in calls than in bytes.  Copies
        the parameters and their baselines once (the bytes one ``diff`` reads anyway)."""
        if not params:
            return []
        dtype = params[0][1].dtype
        bases = []
        for name, current in params:
            base = self._bits[name]
            if current.dtype != dtype or current.dtype != base.dtype or current.shape != base.shape:
                raise ValidationError(f"{name}: {current.dtype}{tuple(current.shape)} vs baseline "
                                      f"{base.dtype}{tuple(base.shape)} (one batch holds one dtype)")
            bases.append(base.reshape(-1))
        current = torch.cat([p.detach().reshape(-1) for _, p in params])
        d = xor_diff(current, torch.cat(bases))
        sizes = np.fromiter((p.numel() for _, p in params), dtype=np.int64, count=len(params))
        starts = np.concatenate(([0], np.cumsum(sizes)))
        cut = np.searchsorted(d.positions, starts)
        out = []
        for i in np.flatnonzero(cut[1:] > cut[:-1]).tolist():
            lo, hi = int(cut[i]), int(cut[i + 1])
            change = Change(d.positions[lo:hi] - starts[i], d.xor_values[lo:hi])
            self._staged[params[i][0]] = change
            out.append((params[i][0], change))
        return out

    def commit(self, version: int) -> None:
        """Advance to ``version``: the staged masks become part of the baseline."""
        if version <= self.version:
            raise ValidationError(f"commit of version {version} <= committed {self.version}")
        for name, d in self._staged.items():
            if d.positions.size:
                bits = bits_view_np(self._bits[name])
                bits[d.positions] ^= d.xor_values
        self._staged.clear()
        self.version = version

    def discard(self) -> None:
        self._staged.clear()

    def bits(self, name: str) -> np.ndarray:
        """Read-only flat view of the committed bits (for tests and verification)."""
        v = bits_view_np(self._bits[name]).view()
        v.flags.writeable = False
        return v
