"""Make a NeMo 2.7.3 recipe (``nemo.collections.llm``, ``MegatronStrategy``) train on CPU.

Test bed, not product: ``nemo_dcr.integrations`` never imports this module.  A launched
training script calls :func:`apply` once, before the recipe runs.  It first applies the
megatron-core CPU shim (``cpu_shim.apply()``, patches 1-6 there), then the six NeMo patches
below.  Each one replaces behaviour that *raises* on a CPU-only torch build (N2 on any
machine with megatron-core 0.16.1), and each is scoped to a named NeMo module or callable.
``docs/megatron-on-cpu.md`` ("NeMo 2 recipes on CPU") lists them with the errors they avoid.

N1. ``torch.cuda.Stream()`` returns ``None`` for ``nemo.lightning.megatron_parallel`` only:
    ``MegatronParallel.init_model_parallel`` wraps DDP setup in
    ``torch.cuda.stream(torch.cuda.Stream())``; ``Stream()`` raises on a CPU build, and
    ``torch.cuda.stream(None)`` is torch's documented no-op context.
N2. ``get_megatron_optimizer`` accepts NeMo's legacy keywords ``no_weight_decay_cond``,
    ``scale_lr_cond``, ``lr_mult`` at their defaults (None, None, 1.0) and drops them:
    NeMo 2.7.3 (``_strategy_lib.setup_megatron_optimizer``) calls megatron-core 0.15's
    signature, which 0.16.1 replaced by ``config_overrides`` (TypeError on every machine).
    Non-default values raise: they would need a translation this test bed does not have.
N3. ``Tensor.cuda()`` is the identity while ``GPTModel.data_step`` (NeMo's LightningModule)
    runs: ``gpt_data_step`` moves every batch tensor with ``.cuda(non_blocking=True)``.
N4. ``MockDataModule.setup`` passes ``create_attention_mask`` by keyword: NeMo passes it
    positionally into ``_MockGPTDataset``'s ``seed`` slot, so without Transformer Engine
    (where the module asks for a mask) the mask is dropped and the seed becomes 1.
N5. ``megatron_init._set_random_seed`` also installs megatron's CUDA-free (inference) RNG
    tracker: NeMo seeds the model-parallel tracker only ``if torch.cuda.device_count() > 0``,
    and the unseeded tracker's ``fork()`` raises when layers initialise their weights.
N6. ``torch.tensor(..., pin_memory=True)`` pins nothing in ``data_sampler`` and
    ``megatron_strategy``, and ``Tensor.to("cuda")`` stays on the CPU while
    ``MegatronDataSampler.on_megatron_step_end`` or ``MegatronStrategy.training_step`` /
    ``optimizer_step`` run: they log scalars through ``torch.tensor(x, pin_memory=True).to("cuda", non_blocking=True)``.

Not patched, set in the recipe instead (``examples/nemo_llama3_refit.py``): the CPU
accelerator, context parallelism 1, no sanity validation, no checkpoints, fusions off
(no Apex / TE kernels) and CPU weight initialisation -- see the docs for why.  The recipe's
distributed optimizer (with ``overlap_param_gather``) needs nothing here: the CPU shim's
patch 4 covers ``DistributedOptimizer.__init__``.
"""
from __future__ import annotations

import functools
import importlib
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from nemo_dcr_testbed import cpu_shim

__all__ = ["apply", "is_applied"]

_lock = threading.Lock()
_applied: tuple[str, ...] | None = None


class _TorchWith(types.ModuleType):
    """``torch`` as one NeMo module sees it: the real module except for ``overrides``."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__("torch")
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _rebind_torch(module_name: str, proxy: types.ModuleType) -> None:
    module = importlib.import_module(module_name)
    if getattr(module, "torch", None) is not torch:
        raise cpu_shim.CpuShimError(f"{module_name}: expected a module-level `torch`, NeMo changed")
    module.torch = proxy  # type: ignore[attr-defined]


# ---------------------------------------------------------------- N1
def _cuda_without_streams() -> types.ModuleType:
    return _TorchWith(cuda=_TorchCudaWith(Stream=lambda *a, **k: None))


class _TorchCudaWith(types.ModuleType):
    def __init__(self, **overrides: Any) -> None:
        super().__init__("torch.cuda")
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


# ---------------------------------------------------------------- N2
_LEGACY_DEFAULTS = {"no_weight_decay_cond": None, "scale_lr_cond": None, "lr_mult": 1.0}


def _accept_legacy_keywords(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        for name, default in _LEGACY_DEFAULTS.items():
            if name in kwargs:
                value = kwargs.pop(name)
                if value != default:
                    raise NotImplementedError(
                        f"get_megatron_optimizer({name}={value!r}): megatron-core 0.16.1 expresses this "
                        "through config_overrides; the NeMo CPU test bed only drops the default")
        return fn(*args, **kwargs)

    get_megatron_optimizer.__nemo_dcr_nemo_cpu__ = True  # type: ignore[attr-defined]
    return get_megatron_optimizer


# ---------------------------------------------------------------- N6
_ORIGINAL_TENSOR_TO = torch.Tensor.to
_to_scope = threading.local()


def _cuda_target(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda"


def _to_in_scope(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if getattr(_to_scope, "n", 0) > 0 and self.device.type == "cpu" and _cuda_target(args, kwargs):
        return self
    return _ORIGINAL_TENSOR_TO(self, *args, **kwargs)


def _scoped_to_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_to_scope, "n", 0)
        _to_scope.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _to_scope.n = depth

    return inner


def _tensor_unpinned(*args: Any, **kwargs: Any) -> torch.Tensor:
    kwargs.pop("pin_memory", None)
    return torch.tensor(*args, **kwargs)


# ---------------------------------------------------------------- apply
def apply() -> tuple[str, ...]:
    """The CPU shim, then patches N1-N6; idempotent.  Returns the patched names."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        cpu_shim.apply()

        # N1
        _rebind_torch("nemo.lightning.megatron_parallel", _cuda_without_streams())

        # N2 (looked up by name at call time: `from megatron.core.optimizer import ...` inside
        # nemo.lightning._strategy_lib.setup_megatron_optimizer)
        import megatron.core.optimizer as mcore_optimizer

        mcore_optimizer.get_megatron_optimizer = _accept_legacy_keywords(mcore_optimizer.get_megatron_optimizer)

        # N3 (the scope helper of cpu_shim's patch 6)
        from nemo.collections.llm.gpt.model.base import GPTModel as NemoGPTModel

        torch.Tensor.cuda = cpu_shim._cuda_noop_in_scope  # type: ignore[method-assign]
        NemoGPTModel.data_step = cpu_shim._scoped_cuda_noop(NemoGPTModel.data_step)  # type: ignore[method-assign]

        # N4
        from nemo.collections.llm.gpt.data import mock

        def setup(self, stage: str = "") -> None:
            for attr, split, n in (("_train_ds", "train", self.num_train_samples),
                                   ("_validation_ds", "valid", self.num_val_samples),
                                   ("_test_ds", "test", self.num_test_samples)):
                setattr(self, attr, mock._MockGPTDataset(self.tokenizer, split, n, self.seq_length,
                                                         create_attention_mask=self.create_attention_mask))

        mock.MockDataModule.setup = setup  # type: ignore[method-assign]

        # N5
        from nemo.lightning import megatron_init

        original_seed = megatron_init._set_random_seed

        @functools.wraps(original_seed)
        def _set_random_seed(seed_: int) -> None:
            original_seed(seed_)
            from megatron.core import parallel_state, tensor_parallel

            seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()  # NeMo's own rule
            tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)

        megatron_init._set_random_seed = _set_random_seed

        # N6
        unpinned = _TorchWith(tensor=_tensor_unpinned)
        _rebind_torch("nemo.lightning.pytorch.plugins.data_sampler", unpinned)
        _rebind_torch("nemo.lightning.pytorch.strategies.megatron_strategy", unpinned)
        from nemo.lightning.pytorch.plugins.data_sampler import MegatronDataSampler
        from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy

        torch.Tensor.to = _to_in_scope  # type: ignore[method-assign]
        MegatronDataSampler.on_megatron_step_end = _scoped_to_cpu(MegatronDataSampler.on_megatron_step_end)
        MegatronStrategy.training_step = _scoped_to_cpu(MegatronStrategy.training_step)
        MegatronStrategy.optimizer_step = _scoped_to_cpu(MegatronStrategy.optimizer_step)

        _applied = (
            "nemo.lightning.megatron_parallel.torch.cuda.Stream",
            "megatron.core.optimizer.get_megatron_optimizer",
            "nemo.collections.llm.gpt.model.base.GPTModel.data_step",
            "nemo.collections.llm.gpt.data.mock.MockDataModule.setup",
            "nemo.lightning.megatron_init._set_random_seed",
            "nemo.lightning.pytorch.plugins.data_sampler.torch.tensor",
            "nemo.lightning.pytorch.strategies.megatron_strategy.torch.tensor",
            "MegatronDataSampler.on_megatron_step_end",
            "MegatronStrategy.training_step",
            "MegatronStrategy.optimizer_step",
        )
        return _applied


def is_applied() -> bool:
    return _applied is not None
