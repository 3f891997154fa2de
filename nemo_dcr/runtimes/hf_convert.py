"""transformers' own checkpoint -> module weight conversions, run on in-memory tensors.

transformers v5 loads some checkpoints into another layout than they are stored in: a
Qwen3-MoE (or Mixtral, Qwen2-MoE, ...) checkpoint holds one tensor per expert
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), the module one fused 3-D parameter
per layer (``mlp.experts.gate_up_proj``), joined at load by a ``WeightConverter`` with
``[MergeModulelist(dim=0), Concatenate(dim=1)]`` (``transformers/conversion_mapping.py``).

Decision: the receiver's canonical names stay the checkpoint's names (what the trainer
publishes and ``save_pretrained`` writes), and the adapter's loader reproduces what
``from_pretrained`` does with them, using transformers' OWN pieces: the model's conversion
list (``model._weight_conversions`` when it was loaded by ``from_pretrained``, else
``get_model_conversion_mapping``), ``rename_source_key`` to find each name's target and
converter, and the converter's ``convert`` (its operations) to build the module tensors.
Only the last step differs: instead of ``set_param_for_module`` (which rebinds parameters,
on worker threads) the results go through ``load_state_dict(assign=False)``, a ``copy_``
into the existing storage.  Nothing here knows where an expert lives in the fused
parameter; the apply engine learns it by tracing the converter's data movement
(``nemo_dcr.receiver.provenance``).

A converter consumes a group of checkpoint tensors at once (all experts of one layer for
one target).  ``load_groups`` declares those groups so the apply engine feeds them whole;
``to_module`` refuses a group given incompletely, naming what is missing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from copy import deepcopy
from dataclasses import dataclass

import torch

from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.runtime import TensorSpec


@dataclass(frozen=True)
class _Target:
    """One module tensor and the checkpoint tensors it is made from (load order)."""

    key: str
    members: tuple[str, ...]
    patterns: tuple[str, ...]
    """The converter source pattern each member matched (``None`` entries: plain rename)."""
    converter: int | None
    """Index into the conversion's converters; ``None`` for a rename / identity."""


def conversion_transforms(model: torch.nn.Module) -> list:
    """The weight transforms transformers applies when loading ``model``'s checkpoint
    (empty for a model without conversions or a plain torch module)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    used = getattr(model, "_weight_conversions", None)
    if used is not None:  # exactly what from_pretrained used
        return list(used)
    # as revert_weight_conversion does for a model built in memory: no prefix guessing
    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]


class CheckpointConversion:
    """Checkpoint names -> module tensors for one model, through transformers' converters.

    names: the canonical (checkpoint) names; each must become a key of the module's state
        dict, and names sharing a converter target form one load group.
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[str], transforms: list) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self._model = model
        transforms = deepcopy(transforms)  # matching marks transforms as used: keep the model's own intact
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: i for i, c in enumerate(self._converters) for p in c.source_patterns}
        meta = dict(model.state_dict())
        prefix = getattr(model, "base_model_prefix", None)
        found: dict[str, list[tuple[str, str | None]]] = {}
        converter_of: dict[str, int | None] = {}
        unknown = []
        for name in sorted(names, key=dot_natural_key):  # the order from_pretrained collects in
            key, pattern = rename_source_key(name, self._renamings, self._converters, prefix, meta)
            if key not in meta and name in meta:
                key, pattern = rename_source_key(name, [], [], prefix, meta)
            if key not in meta:
                unknown.append(name)
                continue
            conv = by_pattern[pattern] if pattern is not None else None
            if converter_of.setdefault(key, conv) != conv:
                raise ValidationError(f"{name} and {found[key][0][0]} both load into {key} through different conversions")
            found.setdefault(key, []).append((name, pattern))
        if unknown:
            raise ValidationError(
                f"{type(model).__name__} has no parameter or buffer for {len(unknown)} canonical names, "
                f"e.g. {unknown[:3]}"
            )
        self._targets: dict[str, _Target] = {}
        self._target_of: dict[str, str] = {}
        for key, members in found.items():
            if converter_of[key] is None and len(members) > 1:
                raise ValidationError(f"{[m for m, _ in members][:3]} all load into {key}")
            self._targets[key] = _Target(
                key, tuple(m for m, _ in members), tuple(p for _, p in members), converter_of[key]
            )
            for m, _ in members:
                self._target_of[m] = key

    @property
    def converts(self) -> bool:
        """True when some module tensor is built from checkpoint tensors by a converter."""
        return any(t.converter is not None for t in self._targets.values())

    def load_groups(self) -> list[tuple[str, ...]]:
        """Checkpoint names a converter consumes together (groups of more than one)."""
        return [t.members for t in self._targets.values() if len(t.members) > 1]

    def to_module(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module state-dict tensors made from ``batch`` (whole load groups only)."""
        keys: dict[str, None] = {}
        for name in batch:
            key = self._target_of.get(name)
            if key is None:
                raise ValidationError(f"{name} is not a canonical name of this model")
            keys[key] = None
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            target = self._targets[key]
            missing = [m for m in target.members if m not in batch]
            if missing:
                raise ValidationError(
                    f"{key} is converted from {len(target.members)} checkpoint tensors; "
                    f"{len(missing)} were not given, e.g. {missing[:3]}"
                )
            if target.converter is None:
                out[key] = batch[target.members[0]]
                continue
            converter = deepcopy(self._converters[target.converter])
            for member, pattern in zip(target.members, target.patterns):
                converter.add_tensor(key, member, pattern, batch[member])
            made = converter.convert(key, model=self._model, config=self._model.config)
            for name, tensor in made.items():
                out[name] = tensor[0] if isinstance(tensor, list) else tensor
        return out


def reverted_specs(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The specs ``save_pretrained`` writes for a converted model: transformers' own reverse
    conversion, run on meta tensors (shapes only, no copy of the weights)."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
    return {k: TensorSpec.of(k, t) for k, t in revert_weight_conversion(model, meta).items()}
