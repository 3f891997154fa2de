"""Hugging Face transformers as a receiver runtime (CPU, in place).

Loader choice (transformers 5.19).  ``from_pretrained`` loads through
``core_model_loading.convert_and_load_state_dict_in_model``, which materialises each
tensor on a thread pool and then *rebinds* it (``setattr(module, name, Parameter(...))``,
see ``set_param_for_module``).  Rebinding is not an in-place update: it drops the storage
any other holder (a tied head, an optimizer, a serving engine's captured graph) still
points to, and the copies happen on worker threads a dispatch mode does not see.  The path
transformers models offer that writes *into* the existing storages is the one
``PreTrainedModel`` inherits from ``torch.nn.Module``: ``load_state_dict(sd, strict=False,
assign=False)``, whose per-module ``_load_from_state_dict`` does ``param.copy_(input)``
under ``no_grad`` (after any load-state-dict pre-hooks a model registers).  That is the
loader this adapter exposes.

Consequences, stated rather than hidden:

* Canonical names are the names ``save_pretrained`` writes (``_keys_to_ignore_on_save`` and
  tied aliases removed, via transformers' own ``remove_tied_weights_from_state_dict``).
  Models whose checkpoint layout differs from the module layout through transformers'
  weight-conversion mapping (e.g. v5's fused MoE experts: per-expert checkpoint tensors,
  one 3-D parameter per layer) keep the checkpoint's names; ``load_weights`` first runs
  transformers' own converters on them (``nemo_dcr.runtimes.hf_convert``), then
  ``load_state_dict``.  Such a converter needs all of its inputs at once, so the adapter
  declares them as ``load_groups()`` and refuses an incomplete group.
* Tied weights behave as the runtime does: ``lm_head.weight`` and
  ``model.embed_tokens.weight`` are one ``Parameter``; the checkpoint carries only the
  source name and writing it updates both.
* Nothing is derived from the weights after loading (rotary ``inv_freq`` comes from the
  config), so ``post_load`` is a no-op.

Loading shows no progress bar (transformers' "Loading weights": a receiver's logs carry
lines, not bars).
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import FormatError, ValidationError
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.runtime import TensorSpec, dtype_name
from nemo_dcr.runtimes.hf_convert import CheckpointConversion, conversion_transforms, reverted_specs

def checkpoint_specs(directory: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Canonical specs read from the safetensors headers of an HF checkpoint directory."""
    return {name: spec for name, (spec, _) in _checkpoint_index(directory).items()}


def _checkpoint_index(directory: str | os.PathLike[str]) -> dict[str, tuple[TensorSpec, Path]]:
    from safetensors import safe_open

    root = Path(directory)
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {root}")
    out: dict[str, tuple[TensorSpec, Path]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                st_dtype = sl.get_dtype()
                try:
                    dtype = dtypes.from_safetensors(st_dtype)
                except ValidationError:
                    raise ValidationError(
                        f"{path.name}: {name} has dtype {st_dtype} the wire format cannot carry") from None
                if name in out:
                    raise FormatError(f"{name} appears in both {out[name][1].name} and {path.name}")
                out[name] = (TensorSpec(name, dtype.name, tuple(sl.get_shape())), path)
    return out


def read_checkpoint_tensor(path: str | os.PathLike[str], spec: TensorSpec) -> torch.Tensor:
    """``spec.name`` from one safetensors file, checked against ``spec`` (dtype, shape)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        t = f.get_tensor(spec.name)
    if dtype_name(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
        raise ValidationError(f"{Path(path).name}: {spec.name} is {t.dtype}{tuple(t.shape)}, spec says {spec}")
    return t


def module_specs(model: torch.nn.Module) -> dict[str, TensorSpec]:
    """The canonical specs ``save_pretrained`` would write for ``model``."""
    state = dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # a plain torch module: no tied-key conventions to honour
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        state = remove_tied_weights_from_state_dict(state, model)
        if conversion_transforms(model):
            return reverted_specs(model, state)
    return {name: TensorSpec.of(name, t) for name, t in state.items()}


class HFTransformersAdapter:
    """``RuntimeAdapter`` for a transformers model held on CPU (see the module docstring).

    specs: canonical specs; default: what ``save_pretrained`` would write for ``model``.
        Pass the checkpoint's own specs when the model holds another dtype (e.g. an fp32
        model serving a bf16 checkpoint): the wire carries the checkpoint's bits.
    checkpoint_dir: the safetensors directory the current weights were loaded from;
        lets ``initial_tensor`` seed the mirror of tensors the loader transforms.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        specs: Mapping[str, TensorSpec] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._model = model
        self._specs = dict(specs) if specs is not None else module_specs(model)
        for key, spec in self._specs.items():
            if key != spec.name:
                raise ValidationError(f"spec under key {key!r} is named {spec.name!r}")
        transforms = conversion_transforms(model)
        self._conversion = CheckpointConversion(model, self._specs, transforms) if transforms else None
        loadable = set(model.state_dict().keys())
        unknown = sorted(set(self._specs) - loadable) if self._conversion is None else []
        if unknown:
            raise ValidationError(
                f"{type(model).__name__}.load_state_dict does not know {len(unknown)} canonical "
                f"names, e.g. {unknown[:3]}"
            )
        self._files = (
            {name: path for name, (_, path) in _checkpoint_index(checkpoint_dir).items()}
            if checkpoint_dir is not None
            else {}
        )

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.bfloat16,
        model_class: type | None = None,
    ) -> HFTransformersAdapter:
        """Load ``directory`` (no hub access) and adapt it; specs come from its headers."""
        if model_class is None:
            from transformers import AutoModelForCausalLM as model_class  # noqa: N813
        with _no_progress_bars():
            model = model_class.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
        model.eval()
        return cls(model, specs=checkpoint_specs(directory), checkpoint_dir=directory)

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name in batch:
                raise ValidationError(f"load_weights: {name} given twice")
            batch[name] = tensor
        if self._conversion is not None:
            batch = self._conversion.to_module(batch)
        result = self._model.load_state_dict(batch, strict=False, assign=False)
        if result.unexpected_keys:
            raise LoaderError(f"load_state_dict did not take {sorted(result.unexpected_keys)}")

    def load_groups(self) -> list[tuple[str, ...]]:
        """Canonical names ``load_weights`` must be given together (one converter's inputs)."""
        return self._conversion.load_groups() if self._conversion is not None else []

    def post_load(self, names: frozenset[str]) -> None:
        del names

    def initial_tensor(self, name: str) -> torch.Tensor | None:
        path = self._files.get(name)
        return None if path is None else read_checkpoint_tensor(path, self._specs[name])


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' tqdm bars off for the block (its switch is process-wide: restored after)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def serve(request):
    """Registry factory ``hf`` (``receiver/registry.py``): the checkpoint loaded into a
    transformers model in this process, behind a prewarmed ``DeltaApplier``; with
    ``options.reference`` a second one for ``verify_dense``.  With ``options.persistent``
    the parameters live in ``state_dir/weights`` (``runtimes/persistent.py``): a restart
    maps them instead of reading the checkpoint (``restored``)."""
    from nemo_dcr.receiver.apply import DeltaApplier
    from nemo_dcr.receiver.registry import ServedRuntime
    from nemo_dcr.receiver.served import InProcessModel

    init_dir, options = request.init_dir, request.options
    restored = False
    if options.persistent:
        from nemo_dcr.runtimes.persistent import bind_persistent, model_skeleton

        wdir = os.path.join(request.state_dir, "weights")
        if os.path.exists(os.path.join(wdir, "weights.json")):  # restart: map our own weights
            adapter = HFTransformersAdapter(model_skeleton(init_dir), specs=checkpoint_specs(init_dir),
                                            checkpoint_dir=init_dir)
        else:
            adapter = HFTransformersAdapter.from_pretrained(init_dir)
        restored = bind_persistent(adapter.module, wdir, request.run_id)
    else:
        adapter = HFTransformersAdapter.from_pretrained(init_dir)
    applier = DeltaApplier(adapter)
    applier.prewarm()
    reference = HFTransformersAdapter.from_pretrained(init_dir) if options.reference else None
    return ServedRuntime(served=InProcessModel(applier, reference), restored=restored,
                         dump=lambda path: dump_module(adapter.module, path))


def dump_module(module: torch.nn.Module, path: str) -> None:
    """Every parameter and buffer of ``module`` to the safetensors file ``path``."""
    from safetensors.torch import save_file

    from nemo_dcr.receiver.verify import module_state

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in module_state(module).items()}, path)
