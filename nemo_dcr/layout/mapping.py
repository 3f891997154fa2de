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
import itertools
import math
import string
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np
import torch

from nemo_dcr.layout.shards import ShardSpec
from nemo_dcr.errors import PlacementError, ValidationError
from nemo_dcr.layout.shards import LayoutError


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The architecture of one model, as far as the canonical (Hugging Face) checkpoint and
    its ``config.json`` depend on it.  Derived from the Megatron model itself
    (``nemo_dcr.integrations.megatron_model.describe_gpt``); canonical = unpadded vocabulary."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """Canonical (tokenizer) vocabulary; Megatron's padded rows beyond it are dropped."""
    num_moe_experts: int = 0
    """Routed experts per MoE layer (0: dense MLP)."""
    moe_ffn_hidden_size: int = 0
    """Width of each expert's gate/up branch (MoE only)."""
    moe_router_topk: int = 0
    """Experts per token (MoE only)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    tied_embeddings: bool = False
    """The output layer is the word embedding (one canonical tensor)."""
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValidationError(
                f"num_attention_heads={self.num_attention_heads} not divisible by "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.num_moe_experts and (self.moe_ffn_hidden_size <= 0 or self.moe_router_topk <= 0):
            raise ValidationError("an MoE model needs moe_ffn_hidden_size > 0 and moe_router_topk > 0")


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

    def project_whole(self, flat: np.ndarray, src_shape: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray] | None:
        """``project`` for a shard that is the whole source tensor, from flat indices into it
        (no multi-indices): (part numbers, None when all are part 0; canonical flat
        indices).  None: this transform has no such shortcut."""
        return None


class Identity(Transform):
    def parts(self, src_shape, dims):
        return {"": tuple(src_shape)}

    def project_whole(self, flat, src_shape):
        return None, flat

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
            raise LayoutError(f"padded vocab {src_shape[0]} < vocab_size {dims.vocab_size}")
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
            raise LayoutError(f"GLU weight with odd row count {src_shape[0]}")
        half = (src_shape[0] // 2, *src_shape[1:])
        return {self.names[0]: half, self.names[1]: half}

    def project_whole(self, flat, src_shape):
        half = math.prod(src_shape) // 2  # row-major: the first half of the rows is the first half of the elements
        part = (flat >= half).astype(np.int64)
        return part, flat - part * half

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
            raise LayoutError(f"fused QKV rows {src_shape[0]} != query_groups*(heads/group+2)*head_dim")
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


LAYER = ("layer",)
"""Prepended axes of stacked ``decoder.layers.*`` keys: the global layer index."""
LAYER_EXPERT = ("layer", "expert")
"""Prepended axes of MoE expert keys (``...mlp.experts.experts.*``): global layer, then
global expert index (Megatron's expert-parallel offset is already in the latter)."""


@dataclass(frozen=True)
class Rule:
    """One Megatron checkpoint key -> canonical tensor name template(s).

    ``targets`` maps each transform part to a name template.  ``axes`` names the axes
    Megatron prepends to the key's global shape (``ShardedTensor.prepend_axis_num`` of
    them); each shard sits at one index along each, and the templates receive those indices
    by name (``{layer}``, ``{expert}``).
    """

    megatron_key: str
    targets: Mapping[str, str]
    transform: Transform = field(default_factory=Identity)
    axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for part, template in self.targets.items():
            fields_ = {f for _, f, _, _ in string.Formatter().parse(template) if f}
            if fields_ != set(self.axes):
                raise ValidationError(f"rule {self.megatron_key}: target {template!r} (part {part!r}) uses "
                                      f"{sorted(fields_)}, the rule's prepended axes are {list(self.axes)}")


@dataclass(frozen=True)
class CanonicalSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


class UnmappedKeyError(PlacementError, KeyError):
    pass


class CanonicalProjector:
    """Applies a rule table to ShardSpecs: projection of changed positions and dense export."""

    def __init__(self, rules: tuple[Rule, ...], dims: ModelDims):
        self.dims = dims
        self._rules: dict[str, Rule] = {}
        for r in rules:
            if r.megatron_key in self._rules:
                raise ValidationError(f"duplicate rule for {r.megatron_key}")
            self._rules[r.megatron_key] = r
        # per shard: its rule, source shape and canonical specs, checked once.  A projection
        # runs for every changed parameter of every version, and an MoE model has tens of
        # thousands of small ones: re-deriving (and re-formatting the names of) the same
        # specs each time was most of its cost.
        self._geometry: dict[ShardSpec, tuple[Rule, tuple[int, ...], tuple[CanonicalSpec, ...], bool]] = {}

    def _shard(self, spec: ShardSpec) -> tuple[Rule, tuple[int, ...], tuple[CanonicalSpec, ...], bool]:
        """(rule, source shape, canonical specs, whether the shard is the whole source tensor)."""
        got = self._geometry.get(spec)
        if got is None:
            rule = self.rule(spec.key)
            self.check(spec)
            src = self._src_shape(rule, spec.global_shape)
            parts = rule.transform.parts(src, self.dims)
            index = tuple(spec.global_offset[: len(rule.axes)])
            specs = tuple(CanonicalSpec(n, spec.dtype, shape)
                          for n, shape in zip(self._names(rule, index, parts), parts.values()))
            p = spec.prepend_axis_num
            whole = tuple(spec.local_shape) == src and not any(spec.global_offset[p:])
            got = self._geometry[spec] = (rule, src, specs, whole)
        return got

    def rule(self, key: str) -> Rule:
        try:
            return self._rules[key]
        except KeyError:
            raise UnmappedKeyError(
                f"no canonical mapping for Megatron key {key!r}; known: {sorted(self._rules)}"
            ) from None

    def _src_shape(self, rule: Rule, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(global_shape[len(rule.axes):])

    def _names(self, rule: Rule, index: tuple[int, ...], parts: dict) -> list[str]:
        missing = set(parts) - set(rule.targets)
        if missing:
            raise LayoutError(f"rule for {rule.megatron_key} has no target for parts {sorted(missing)}")
        fmt = dict(zip(rule.axes, index))
        return [rule.targets[p].format(**fmt) for p in parts]

    def check(self, spec: ShardSpec) -> None:
        """Raise ``LayoutError`` (a ``ValueError``) unless the rule of ``spec.key`` fits its geometry."""
        rule = self.rule(spec.key)
        if spec.prepend_axis_num != len(rule.axes):
            raise LayoutError(f"{spec.key}: Megatron prepends {spec.prepend_axis_num} axes, the "
                              f"layout table expects {len(rule.axes)} ({', '.join(rule.axes) or 'none'})")
        rule.transform.parts(self._src_shape(rule, spec.global_shape), self.dims)

    def canonical_specs(self, spec: ShardSpec) -> list[CanonicalSpec]:
        """The canonical tensors a shard contributes to."""
        return list(self._shard(spec)[2])

    def project(
        self, spec: ShardSpec, local_flat: np.ndarray
    ) -> Iterator[tuple[CanonicalSpec, np.ndarray, np.ndarray]]:
        """Yield ``(canonical tensor, canonical flat indices, selection into local_flat)``
        for the shard-local flat indices ``local_flat``; dropped elements (vocab padding)
        are not yielded."""
        rule, src, cspecs, whole = self._shard(spec)
        # a shard that is its whole source tensor (an expert, any weight without tensor
        # parallelism) projects from its flat indices: no multi-indices
        fast = rule.transform.project_whole(np.asarray(local_flat, dtype=np.int64), src) if whole else None
        if fast is not None:
            part, flat = fast
        else:
            gidx = spec.global_index(local_flat)[:, len(rule.axes):]
            part, flat = rule.transform.project(gidx, src, self.dims)
        if part is None:
            if flat.size:
                yield cspecs[0], flat, slice(None)
            return
        for p_no, cspec in enumerate(cspecs):
            sel = np.flatnonzero(part == p_no)
            if sel.size:
                yield cspec, flat[sel], sel

    def dense(self, key: str, global_tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Canonical tensors from one whole Megatron global tensor."""
        rule = self.rule(key)
        out: dict[str, torch.Tensor] = {}
        for index in itertools.product(*(range(n) for n in global_tensor.shape[: len(rule.axes)])):
            src = global_tensor[index]
            parts = rule.transform.dense(src, self.dims)
            for name, t in zip(self._names(rule, index, parts), parts.values()):
                out[name] = t
        return out
