"""Megatron global tensors -> canonical (Hugging Face checkpoint) tensors.

A ``Rule`` names one Megatron checkpoint key (the ``ShardedTensor.key``, e.g.
``decoder.layers.self_attention.linear_qkv.weight``), the canonical tensor(s) it becomes,
and a ``Transform`` for the documented fused layouts (grouped QKV, GLU halves, padded
vocabulary).  Every transform is a pure re-indexing -- a canonical element's bits are
exactly the Megatron element's bits -- so an XOR mask can be projected element by element.

Each transform has two implementations that the tests check against each other:
``project`` (vectorised, changed positions only: O(changed) work, no weight gather) and
``dense`` (whole tensors, used for the initial checkpoint and the dense-refit reference).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np
import torch

from nemo_dcr.layout.shards import ShardSpec


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """Shapes the fused layouts depend on (canonical = unpadded vocabulary)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} not divisible by "
                f"num_query_groups={self.num_query_groups}"
            )


class Transform(abc.ABC):
    """Re-indexing from one Megatron global tensor (layer axis removed) to canonical parts."""

    @abc.abstractmethod
    def parts(self, src_shape: tuple[int, ...], dims: ModelDims) -> dict[str, tuple[int, ...]]:
        """Canonical part name -> canonical shape."""

    @abc.abstractmethod
    def project(
        self, idx: np.ndarray, src_shape: tuple[int, ...], dims: ModelDims
    ) -> tuple[np.ndarray, np.ndarray]:
        """``idx``: (n, ndim) global indices.  Returns (part number per index, -1 = dropped;
        canonical flat index per index).  Part numbers follow ``parts()`` order."""

    @abc.abstractmethod
    def dense(self, src: torch.Tensor, dims: ModelDims) -> dict[str, torch.Tensor]:
        """Whole canonical parts of a whole global tensor (views where possible)."""


class Identity(Transform):
    def parts(self, src_shape, dims):
        return {"": tuple(src_shape)}

    def project(self, idx, src_shape, dims):
        flat = np.ravel_multi_index(tuple(idx.T), src_shape) if len(src_shape) else np.zeros(len(idx), np.int64)
        return np.zeros(len(idx), np.int64), np.asarray(flat, np.int64)

    def dense(self, src, dims):
        return {"": src}


class VocabRows(Transform):
    """Megatron pads the vocabulary (to a multiple of ``make_vocab_size_divisible_by * TP``);
    the canonical tensor has the first ``vocab_size`` rows only.  Padding rows are dropped."""

    def parts(self, src_shape, dims):
        if src_shape[0] < dims.vocab_size:
            raise ValueError(f"padded vocab {src_shape[0]} < vocab_size {dims.vocab_size}")
        return {"": (dims.vocab_size, *src_shape[1:])}

    def project(self, idx, src_shape, dims):
        keep = idx[:, 0] < dims.vocab_size
        part = np.where(keep, 0, -1).astype(np.int64)
        shape = (dims.vocab_size, *src_shape[1:])
        clipped = idx.copy()
        clipped[~keep, 0] = 0
        return part, np.asarray(np.ravel_multi_index(tuple(clipped.T), shape), np.int64)

    def dense(self, src, dims):
        return {"": src[: dims.vocab_size]}


@dataclass(frozen=True)
class RowHalves(Transform):
    """GLU ``linear_fc1``: rows ``[0, F)`` are the gate projection, ``[F, 2F)`` the up
    projection (Megatron's SwiGLU checkpoint factory stores them in this order)."""

    names: tuple[str, str] = ("gate", "up")

    def parts(self, src_shape, dims):
        if src_shape[0] % 2:
            raise ValueError(f"GLU weight with odd row count {src_shape[0]}")
        half = (src_shape[0] // 2, *src_shape[1:])
        return {self.names[0]: half, self.names[1]: half}

    def project(self, idx, src_shape, dims):
        half = src_shape[0] // 2
        part = idx[:, 0] // half
        rows = idx[:, 0] - part * half
        flat = np.ravel_multi_index((rows, *idx[:, 1:].T), (half, *src_shape[1:]))
        return part.astype(np.int64), np.asarray(flat, np.int64)

    def dense(self, src, dims):
        a, b = src.chunk(2, dim=0)
        return {self.names[0]: a, self.names[1]: b}


class GroupedQKV(Transform):
    """Megatron's fused ``linear_qkv`` weight: rows grouped by query group, each group
    holding its ``heads_per_group`` query heads, then one key head, then one value head
    (each head ``head_dim`` rows).  Canonical q/k/v concatenate the heads in order."""

    def _geometry(self, dims: ModelDims) -> tuple[int, int, int]:
        qpg = dims.num_attention_heads // dims.num_query_groups
        return qpg, dims.head_dim, (qpg + 2) * dims.head_dim

    def parts(self, src_shape, dims):
        qpg, d, blk = self._geometry(dims)
        if src_shape[0] != dims.num_query_groups * blk:
            raise ValueError(f"fused QKV rows {src_shape[0]} != query_groups*(heads/group+2)*head_dim")
        cols = tuple(src_shape[1:])
        return {
            "q": (dims.num_attention_heads * d, *cols),
            "k": (dims.num_query_groups * d, *cols),
            "v": (dims.num_query_groups * d, *cols),
        }

    def project(self, idx, src_shape, dims):
        qpg, d, blk = self._geometry(dims)
        r = idx[:, 0]
        g, w = np.divmod(r, blk)
        is_q = w < qpg * d
        is_k = ~is_q & (w < (qpg + 1) * d)
        part = np.where(is_q, 0, np.where(is_k, 1, 2)).astype(np.int64)
        row = np.where(is_q, g * qpg * d + w, g * d + w - np.where(is_k, qpg * d, (qpg + 1) * d))
        ncols = int(np.prod(src_shape[1:], dtype=np.int64))
        col = np.ravel_multi_index(tuple(idx[:, 1:].T), src_shape[1:]) if len(src_shape) > 1 else 0
        return part, np.asarray(row * ncols + col, np.int64)

    def dense(self, src, dims):
        qpg, d, _ = self._geometry(dims)
        g = src.reshape(dims.num_query_groups, qpg + 2, d, *src.shape[1:])
        cols = tuple(src.shape[1:])
        return {
            "q": g[:, :qpg].reshape(dims.num_attention_heads * d, *cols),
            "k": g[:, qpg].reshape(dims.num_query_groups * d, *cols),
            "v": g[:, qpg + 1].reshape(dims.num_query_groups * d, *cols),
        }


@dataclass(frozen=True)
class Rule:
    """One Megatron checkpoint key -> canonical tensor name template(s).

    ``targets`` maps each transform part to a name template; ``{layer}`` is the global
    layer index (the first, prepended axis of stacked ``decoder.layers.*`` keys).
    """

    megatron_key: str
    targets: Mapping[str, str]
    transform: Transform = field(default_factory=Identity)
    layered: bool = False


@dataclass(frozen=True)
class CanonicalSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


class UnmappedKeyError(KeyError):
    pass


class CanonicalProjector:
    """Applies a rule table to ShardSpecs: projection of changed positions and dense export."""

    def __init__(self, rules: tuple[Rule, ...], dims: ModelDims):
        self.dims = dims
        self._rules: dict[str, Rule] = {}
        for r in rules:
            if r.megatron_key in self._rules:
                raise ValueError(f"duplicate rule for {r.megatron_key}")
            self._rules[r.megatron_key] = r

    def rule(self, key: str) -> Rule:
        try:
            return self._rules[key]
        except KeyError:
            raise UnmappedKeyError(
                f"no canonical mapping for Megatron key {key!r}; known: {sorted(self._rules)}"
            ) from None

    def _src_shape(self, rule: Rule, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(global_shape[1:]) if rule.layered else tuple(global_shape)

    def _names(self, rule: Rule, layer: int | None, parts: dict) -> list[str]:
        missing = set(parts) - set(rule.targets)
        if missing:
            raise ValueError(f"rule for {rule.megatron_key} has no target for parts {sorted(missing)}")
        return [rule.targets[p].format(layer=layer) for p in parts]

    def canonical_specs(self, spec: ShardSpec) -> list[CanonicalSpec]:
        """The canonical tensors a shard contributes to."""
        rule = self.rule(spec.key)
        src = self._src_shape(rule, spec.global_shape)
        parts = rule.transform.parts(src, self.dims)
        layer = spec.global_offset[0] if rule.layered else None
        return [
            CanonicalSpec(n, spec.dtype, shape)
            for n, shape in zip(self._names(rule, layer, parts), parts.values())
        ]

    def project(
        self, spec: ShardSpec, local_flat: np.ndarray
    ) -> Iterator[tuple[CanonicalSpec, np.ndarray, np.ndarray]]:
        """Yield ``(canonical tensor, canonical flat indices, selection into local_flat)``
        for the shard-local flat indices ``local_flat``; dropped elements (vocab padding)
        are not yielded."""
        rule = self.rule(spec.key)
        if rule.layered and spec.prepend_axis_num != 1:
            raise ValueError(f"{spec.key}: layered rule needs exactly one prepended (layer) axis")
        gidx = spec.global_index(local_flat)
        if rule.layered:
            gidx = gidx[:, 1:]
        src = self._src_shape(rule, spec.global_shape)
        part, flat = rule.transform.project(gidx, src, self.dims)
        for p_no, cspec in enumerate(self.canonical_specs(spec)):
            sel = np.flatnonzero(part == p_no)
            if sel.size:
                yield cspec, flat[sel], sel

    def dense(self, key: str, global_tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Canonical tensors from one whole Megatron global tensor."""
        rule = self.rule(key)
        out: dict[str, torch.Tensor] = {}
        layers = range(global_tensor.shape[0]) if rule.layered else [None]
        for layer in layers:
            src = global_tensor[layer] if layer is not None else global_tensor
            parts = rule.transform.dense(src, self.dims)
            for name, t in zip(self._names(rule, layer, parts), parts.values()):
                out[name] = t
        return out
