"""The committed bits of each local training shard, and the staged change to them.

The trainer diffs against the *committed* baseline (the version every receiver holds),
not against the previous step: if a version is not committed (a receiver did not
acknowledge it), the next delta is taken from the same baseline and still applies to what
the receivers hold.  Advancing the baseline replays only the staged XOR masks
(O(changed) work), so it costs nothing proportional to the model size.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.kernels import XorDiff, bits_view_np, xor_diff


class Baseline:
    def __init__(self, params: Mapping[str, torch.Tensor], *, version: int = 0):
        pin = torch.cuda.is_available()
        self._bits: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.detach())
            self._bits[name] = host
        self._staged: dict[str, XorDiff] = {}
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
        self._staged[name] = d
        return d

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
