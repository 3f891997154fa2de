"""Make megatron-core (0.16.1 and 0.19.x, both tested) train on CPU with the gloo backend.

megatron-core assumes CUDA in a handful of places that lie on the training path.  This module
is the one place where we bend those assumptions, and :func:`apply` is the one call that does
it (importing this module changes nothing).  Every patch is listed here with its reason; the
rule that keeps them safe is that each one only replaces behaviour that *raises* where CUDA is
not usable -- a CPU-only torch build ("Torch not compiled with CUDA enabled") or a CUDA build
on a machine without a driver ("Found no NVIDIA driver", the PyPI torch for Python 3.12 that
``.venv-bridge`` runs) -- except the type-name patch, which is scoped to three megatron
functions.

What :func:`apply` patches
--------------------------
1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``.
   Megatron allocates activations, communication buffers and gradient buffers with
   ``device=torch.cuda.current_device()`` (tensor_parallel/mappings.py, layers.py,
   distributed/param_and_grad_buffer.py, p2p_communication.py, ...).  On a CPU build the
   original raises "Torch not compiled with CUDA enabled".
2. ``torch.cuda.synchronize`` -> no-op.
   Called after every pipeline p2p exchange (p2p_communication.py, "race condition with
   batch_isend_irecv") and by DDP's buffer teardown.  CPU ops are synchronous.
2b. ``torch.cuda.current_stream`` -> :data:`CPU_STREAM`, and ``torch.cuda.stream(s)`` -> a null
   context for ``s`` that is :data:`CPU_STREAM` or ``None`` (any other argument goes to
   torch's own).  The original ``current_stream`` raises; the original ``stream`` happens to
   do nothing once patch 1 is in (its ``StreamContext`` finds no CUDA device index), which is
   an accident of torch's internals, so the CPU stream gets an explicit null context.
   megatron-core 0.19's DDP grad sync
   (distributed/param_and_grad_buffer.py, ``_ParamAndGradBucketGroup.start_grad_sync``) takes
   ``torch.cuda.current_stream()`` on every call to wait on CUDA-graph replay events that a
   parameter may carry (``_cudagraph_wgrad_ready_event``; never set here), and
   ``finish_grad_sync`` / ``start_grad_sync`` wrap the collectives in
   ``torch.cuda.stream(...)`` / ``current_stream().wait_stream(...)`` when there are several
   distributed-optimizer instances.  :class:`_CpuStream` answers ``wait_event``,
   ``wait_stream`` and ``synchronize`` with no-ops: CPU ops run in program order on one stream.
   megatron-core 0.16.1 does not call these on the CPU training path (patched all the same).
3. The name ``torch`` inside a few megatron modules is rebound to :class:`_CpuFactoryTorch`,
   a proxy of the torch module whose tensor factories (``zeros``, ``ones``, ``empty``,
   ``tensor``, ``full``, ``arange``) map ``device="cuda"`` to the CPU.  These modules allocate
   small bookkeeping tensors with a literal ``device="cuda"`` that no config switch avoids:
   the token counter in every pipeline schedule (pipeline_parallel/schedules.py), the unit
   loss scale of the mixed-precision optimizer (optimizer/optimizer.py), the grad-norm and
   clip buffers (optimizer/clip_grads.py), the result of the non-Apex fallback of the
   multi-tensor L2 norm (utils.py, ``local_multi_tensor_l2_norm``) and the default causal mask
   (transformer/utils.py).
   Everything else in those modules sees the real torch.
4. ``torch.Tensor.type()`` reports ``torch.cuda.<X>Tensor`` for CPU tensors, **only while**
   ``Float16OptimizerWithFloat16Params.__init__``, ``DistributedOptimizer.__init__`` or
   ``clip_grad_by_total_norm_fp32`` runs.  They decide what a parameter is by comparing that
   legacy string with the CUDA names (optimizer.py: bf16 params get fp32 master copies, fp32
   params are used as they are; distrib_optimizer.py, ``_build_model_and_main_param_groups``
   and the ``main_param`` marking in ``__init__``: the same classification, else
   ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor...``; clip_grads.py
   asserts fp32 grads).  Outside those calls ``Tensor.type`` is untouched.
5. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is defined as ``None`` when it
   is missing.  moe_utils imports it from Transformer Engine inside ``try/except ImportError``
   without a fallback, but the MoE router's gating linear (``RouterGatingLinearFunction``,
   forward and backward) tests ``te_general_gemm is not None``; without Transformer Engine that
   raises ``NameError`` (any machine, not only CPU).  ``None`` selects the plain ``torch.mm``
   branch the code already has.  Set only if the name is absent: megatron-core 0.19 defines
   it as ``None`` itself without Transformer Engine, so there nothing is set.
6. ``torch.Tensor.cuda()`` returns the tensor itself, **only while**
   ``LanguageModule.setup_embeddings_and_output_layer`` runs.  With tied embeddings and PP > 1
   it moves the shared word-embedding / output weight to the GPU (``weight.data =
   weight.data.cuda()``) before all-reducing it over the embedding group, which raises on a
   CPU build.  On the CPU the tensor already is where the all-reduce needs it; outside that
   call ``Tensor.cuda`` is untouched (and still raises).

What it does not patch, and how callers avoid it instead
--------------------------------------------------------
* RNG: megatron's ``CudaRNGStatesTracker`` stores and restores CUDA generator states.  Call
  :func:`seed_model_parallel_rng` (``model_parallel_cuda_manual_seed(seed,
  inference_rng_tracker=True, force_reset_rng=True)``): the inference tracker's ``fork()`` is a
  null context, so no CUDA generator is touched.  What it gives up is a separate RNG stream for
  tensor-parallel regions, which only dropout inside those regions would use; the models built
  here have no dropout, and weights are initialised on CPU from the default generator
  (``use_cpu_initialization=True``: the full master weight is drawn, then split), so every TP
  rank draws identical full tensors and keeps its slice.
* psutil: megatron's checkpoint writer (dist_checkpointing async/filesystem strategies) imports
  it; it is a declared dependency (``pyproject.toml``, extra ``megatron``), not a patch.

The shim refuses to run where CUDA is available: there megatron must use the GPU, and
redirecting ``current_device`` would silently train on the CPU.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CPU_STREAM", "CpuShimError", "ShimReport", "apply", "is_applied", "seed_model_parallel_rng"]


class CpuShimError(RuntimeError):
    """The shim cannot (or must not) be applied in this process."""


@dataclass(frozen=True)
class ShimReport:
    """What :func:`apply` changed, for logs and tests."""

    torch_cuda_functions: tuple[str, ...]
    """Attributes of ``torch.cuda`` replaced (patches 1, 2 and 2b)."""
    factory_proxied_modules: tuple[str, ...]
    """Megatron modules whose global ``torch`` is the CPU-factory proxy (patch 3)."""
    type_name_scoped: tuple[str, ...]
    """Megatron callables during which ``Tensor.type()`` reports CUDA names (patch 4)."""
    cuda_noop_scoped: tuple[str, ...]
    """Megatron callables during which ``Tensor.cuda()`` returns the CPU tensor (patch 6)."""
    missing_globals_defined: tuple[str, ...]
    """``module.name`` globals megatron reads but never defines without Transformer Engine,
    set to ``None`` (patch 5)."""


# Modules with literal ``device="cuda"`` allocations on the training path (patch 3).
_FACTORY_PROXIED_MODULES: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)

_FACTORIES: frozenset[str] = frozenset({"zeros", "ones", "empty", "tensor", "full", "arange"})

_lock = threading.Lock()
_report: ShimReport | None = None

# The ``torch.cuda`` attributes patches 1, 2 and 2b replace, in the order applied.
_TORCH_CUDA_FUNCTIONS: tuple[str, ...] = ("current_device", "synchronize", "current_stream", "stream")


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:  # noqa: ARG001 - signature of the original
    return None


class _CpuStream:
    """The one stream of CPU execution (patch 2b): ops run in program order, so every wait is
    already satisfied."""

    device = torch.device("cpu")

    def wait_event(self, event: Any) -> None:  # noqa: ARG002 - torch.cuda.Stream's signature
        return None

    def wait_stream(self, stream: Any) -> None:  # noqa: ARG002
        return None

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "<nemo_dcr cpu_shim CPU stream>"


CPU_STREAM = _CpuStream()
"""What ``torch.cuda.current_stream()`` returns once :func:`apply` ran."""


def _cpu_current_stream(device: Any = None) -> _CpuStream:  # noqa: ARG001 - original's signature
    return CPU_STREAM


def _make_cpu_stream_context(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cpu_stream(stream: Any) -> Any:  # torch's parameter name, for keyword callers
        if stream is None or stream is CPU_STREAM:
            return contextlib.nullcontext()
        return original(stream)

    return cpu_stream


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


class _CpuFactoryTorch(types.ModuleType):
    """Stands in for ``torch`` inside one megatron module: CUDA factory calls land on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self._wrapped: dict[str, Callable[..., torch.Tensor]] = {}
        for name in _FACTORIES:
            self._wrapped[name] = self._wrap(getattr(torch, name))

    @staticmethod
    def _wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name: str) -> Any:
        wrapped = self.__dict__.get("_wrapped", {})
        if name in wrapped:
            return wrapped[name]
        return getattr(torch, name)


_ORIGINAL_TENSOR_TYPE = torch.Tensor.type
_type_scope_depth = threading.local()


def _cuda_named_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any):
    if dtype is None and not kw and getattr(_type_scope_depth, "n", 0) > 0 and self.device.type == "cpu":
        name = _ORIGINAL_TENSOR_TYPE(self)  # e.g. "torch.BFloat16Tensor"
        return name.replace("torch.", "torch.cuda.", 1)
    return _ORIGINAL_TENSOR_TYPE(self, dtype, non_blocking, **kw)


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    depth = getattr(_type_scope_depth, "n", 0)
    _type_scope_depth.n = depth + 1
    try:
        yield
    finally:
        _type_scope_depth.n = depth


def _scoped(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    inner.__nemo_dcr_cpu_shim__ = True  # type: ignore[attr-defined]
    return inner


_ORIGINAL_TENSOR_CUDA = torch.Tensor.cuda
_cuda_noop_depth = threading.local()


def _cuda_noop_in_scope(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if getattr(_cuda_noop_depth, "n", 0) > 0 and self.device.type == "cpu":
        return self
    return _ORIGINAL_TENSOR_CUDA(self, *args, **kwargs)


def _scoped_cuda_noop(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_cuda_noop_depth, "n", 0)
        _cuda_noop_depth.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _cuda_noop_depth.n = depth

    inner.__nemo_dcr_cpu_shim__ = True  # type: ignore[attr-defined]
    return inner


# Globals megatron tests against None but leaves undefined without Transformer Engine (patch 5).
_MISSING_TE_GLOBALS: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),
)


def apply() -> ShimReport:
    """Apply patches 1-6 and 2b (see the module docstring); idempotent and thread-safe.

    Returns the report of what is patched.  Raises :class:`CpuShimError` when CUDA is usable.
    """
    global _report
    with _lock:
        if _report is not None:
            return _report
        if torch.cuda.is_available():
            raise CpuShimError(
                "CUDA is available: megatron-core must run on the GPU; the CPU shim is for "
                "CPU-only torch builds"
            )
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
        torch.cuda.synchronize = _cpu_synchronize  # type: ignore[assignment]
        torch.cuda.current_stream = _cpu_current_stream  # type: ignore[assignment]
        torch.cuda.stream = _make_cpu_stream_context(torch.cuda.stream)  # type: ignore[assignment]

        proxy = _CpuFactoryTorch()
        for name in _FACTORY_PROXIED_MODULES:
            module = importlib.import_module(name)
            if getattr(module, "torch", None) is not torch:
                raise CpuShimError(f"{name}: expected a module-level `torch`, megatron changed")
            module.torch = proxy  # type: ignore[attr-defined]

        # Patch 4: install the scoped Tensor.type once, then scope it to three callables.
        torch.Tensor.type = _cuda_named_type  # type: ignore[method-assign]
        from megatron.core.optimizer import clip_grads, optimizer

        from megatron.core.optimizer import distrib_optimizer

        for cls in (optimizer.Float16OptimizerWithFloat16Params,
                    distrib_optimizer.DistributedOptimizer):
            cls.__init__ = _scoped(cls.__init__)  # type: ignore[method-assign]
        clip = _scoped(clip_grads.clip_grad_by_total_norm_fp32)
        clip_grads.clip_grad_by_total_norm_fp32 = clip
        optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there

        # Patch 6: Tensor.cuda() is the identity inside one megatron method.
        from megatron.core.models.common.language_module.language_module import LanguageModule

        torch.Tensor.cuda = _cuda_noop_in_scope  # type: ignore[method-assign]
        LanguageModule.setup_embeddings_and_output_layer = _scoped_cuda_noop(  # type: ignore[method-assign]
            LanguageModule.setup_embeddings_and_output_layer
        )

        # Patch 5: undefined Transformer-Engine globals -> None (only where absent).
        defined = []
        for mod_name, attr in _MISSING_TE_GLOBALS:
            module = importlib.import_module(mod_name)
            if not hasattr(module, attr):
                setattr(module, attr, None)
                defined.append(f"{mod_name}.{attr}")

        _report = ShimReport(
            torch_cuda_functions=_TORCH_CUDA_FUNCTIONS,
            factory_proxied_modules=_FACTORY_PROXIED_MODULES,
            type_name_scoped=(
                "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
                "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
                "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
            ),
            cuda_noop_scoped=(
                "megatron.core.models.common.language_module.language_module."
                "LanguageModule.setup_embeddings_and_output_layer",
            ),
            missing_globals_defined=tuple(defined),
        )
        return _report


def is_applied() -> bool:
    return _report is not None


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the CPU generator and install megatron's CUDA-free (inference) RNG tracker.

    Must run after ``parallel_state.initialize_model_parallel`` and before the model is built.
    The seed is the same on every rank so that CPU-initialised master weights agree.
    """
    if not is_applied():
        raise CpuShimError("call cpu_shim.apply() before seeding megatron's RNG")
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=True, force_reset_rng=True
    )
