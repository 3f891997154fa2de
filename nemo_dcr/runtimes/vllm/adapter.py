"""The worker side of a vLLM receiver: ``RuntimeAdapter`` over one worker's model.

What vLLM's CPU build does to the weights after loading (vLLM 0.32, found by reading
``model_executor/layers/{linear,utils,vocab_parallel_embedding}.py`` and confirmed on a
running engine):

* ``UnquantizedLinearMethod.process_weights_after_loading`` (qkv_proj, o_proj,
  gate_up_proj, down_proj) calls ``dispatch_cpu_unquantized_gemm(layer,
  remove_weight=True)``: the weight is packed into a oneDNN (or SGL / zentorch) handle held
  by the ``layer.cpu_linear`` closure and the parameter is replaced by an empty one.  No
  storage is left to write into, and ``load_weights`` into the empty parameter fails.
* ``UnquantizedEmbeddingMethod`` (embed_tokens, lm_head) keeps the weight but also builds a
  packed handle from it (``remove_weight=False``): the embedding lookup reads the
  parameter, the lm_head GEMM reads the handle.  An in-place write changes the former
  only, so every layer with a ``quant_method`` whose weights changed needs its handle
  rebuilt.
* Norms (``RMSNorm.weight``) are plain parameters read directly.

Decision: *kernel-layout staging* (a mirror kept in vLLM's own pre-packing layout, not in
canonical coordinates).  For every layer whose weight was packed away, the adapter
restores the plain parameter vLLM had before packing, from the metadata vLLM records for
weight reloading (``reload.layerwise.get_layerwise_info(layer).restore_metadata``:
class, shape, ``weight_loader`` and TP attributes, materialised with vLLM's
``materialize_meta_tensor`` / ``restore_layer_refs``), registers it as ``layer.weight``
(the packed kernels ignore the ``weight`` argument, a plain fallback GEMM reads it), and
fills it by running the model's own ``load_weights`` on the checkpoint.  From then on:

* ``load_weights`` is the worker model's own ``load_weights``: vLLM's loaders narrow the
  TP shard and copy q/k/v into the fused ``qkv_proj`` rows, gate/up into
  ``gate_up_proj``, etc.  ``DeltaApplier`` observes those copies, so every tensor has an
  XOR placement (DIRECT or VIEW) and no canonical mirror is needed;
* ``post_load(names)`` re-runs vLLM's own ``quant_method.process_weights_after_loading``
  on exactly the layers whose storages those names write (learned by capture when the
  staging is filled), which rebuilds the packed handle from the updated plain weight as a
  dense load would; for a packed layer the staging parameter is then registered again
  (vLLM replaces it by an empty one), so parameters are never rebound across an apply.

Two phases (``DeltaApplier.stage``), for an engine that serves while a version waits:
set-up checks, per layer, that a kernel built by vLLM's own method on a stand-in object
(:func:`_build_kernel`; the engine's layer untouched) gives the engine kernel's bits, owns
a copy of its weight, and (for ``unserved``) that the engine's kernel ignores the weight
argument.  Then the plain weights of packed layers are ``unserved()`` (no forward pass reads
them; a stock engine has none): a version's XORs into them and the kernels built from them
are done before the window (``prepare``), and the window only swaps ``layer.cpu_linear``
(``install``).  The embedding table and lm_head are kept by vLLM (served, or at least
reported by ``/weight_checker``) and also packed (``kernel_weights()``): their kernels are
built before the window from patched copies, the weights themselves XORed inside.

Costs: one shard-sized copy of every packed weight per worker (what vLLM holds between
loading and packing), and per apply a repack of each touched layer, O(layer size), the
same work a dense load does for that layer -- done while the engine serves when the
version is staged first (the backend), inside the apply otherwise (``nemo-dcr receive``);
one packed copy more of each touched layer between staging and the window.  Not chosen: (a) a plain-weight linear method
(a quantization plugin in every worker) changes the serving kernels, so the engine would
no longer match a stock one; (b) a canonical mirror fed through vLLM's layerwise reload
holds full canonical tensors in every worker (TP times the bytes), must feed whole fused
groups (a partial group leaves the rest of the layer uninitialised), and costs O(group)
per touched tensor even for one changed element.
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_dcr.receiver.capture import WriteCapture, module_storages
from nemo_dcr.receiver.errors import LoaderError
from nemo_dcr.receiver.runtime import TensorSpec
from nemo_dcr.runtimes.hf import checkpoint_specs, read_checkpoint_tensor


@dataclass
class _Staged:
    """A layer whose weight vLLM packed away, with the plain weight the adapter keeps."""

    layer: torch.nn.Module
    staging: torch.nn.Parameter


class _Standin:
    """What vLLM's CPU ``process_weights_after_loading`` reads from and writes to a layer
    (``weight``, ``bias``, ``cpu_linear``), without being the engine's layer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias


def _build_kernel(layer: torch.nn.Module, weight: torch.Tensor):
    """The GEMM kernel vLLM's own method builds for ``layer`` from ``weight``, built on a
    stand-in: the engine's layer keeps serving with its kernel meanwhile."""
    standin = _Standin(weight, layer._parameters.get("bias"))
    layer.quant_method.process_weights_after_loading(standin)
    kernel = getattr(standin, "cpu_linear", None)
    if kernel is None:
        raise LoaderError(f"{type(layer.quant_method).__name__} built no cpu_linear kernel")
    return kernel


def _checkpoint_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = path
    return out


class VLLMWorkerAdapter:
    """``RuntimeAdapter`` for the model of one vLLM worker (see the module docstring).

    model: the worker's model (``worker.model_runner.get_model()``), loaded from
        ``checkpoint_dir`` and not yet updated.
    checkpoint_dir: the safetensors checkpoint the engine was started from; gives the
        canonical specs, fills the staging weights and seeds ``initial_tensor``.
    """

    def __init__(self, model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str]) -> None:
        self._model = model
        self._specs = checkpoint_specs(checkpoint_dir)
        self._files = _checkpoint_files(checkpoint_dir)
        self._staged: dict[str, _Staged] = {}
        self._rebuild: dict[str, tuple[str, ...]] = {}
        self._by_proxy: set[str] = set()  # layers whose kernel is built on a stand-in (_build_kernel)
        self._unserved: dict[str, str] = {}  # layer -> its weight's name, read by no forward pass
        self._copied: dict[str, str] = {}  # layer -> its served weight's name, its kernel built from a copy
        self._install_staging()
        self._fill_staging()

    # ---------------------------------------------------------------- set-up
    def _install_staging(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        for lname, layer in self._model.named_modules():
            if getattr(layer, "quant_method", None) is None:
                continue
            weight = layer._parameters.get("weight")
            if weight is None or weight.numel() or weight.is_meta:
                continue  # plain weight (or none): nothing was packed away
            info = get_layerwise_info(layer)
            meta = info.restore_metadata[0].get("weight")
            if meta is None or meta.numel() == 0:
                raise LoaderError(f"{lname}: packed weight without vLLM reload metadata to restore it from")
            with info.restore_device:
                staging = restore_layer_refs(materialize_meta_tensor(meta), layer)
            layer.register_parameter("weight", staging)
            self._staged[lname] = _Staged(layer, staging)

    def _quant_layers_by_storage(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = defaultdict(list)
        for lname, layer in self._model.named_modules():
            if getattr(layer, "quant_method", None) is None:
                continue
            for p in layer._parameters.values():
                if p is not None and p.numel():
                    out[p.untyped_storage().data_ptr()].append(lname)
        return out

    def _fill_staging(self) -> None:
        """Learn which canonical tensors write into layers with a packed kernel (probe with
        writes suppressed), fill the staging weights through the model's loader, and check
        the rebuilt kernels compute bit-for-bit what the engine's own kernels compute."""
        tensors = {name: self.initial_tensor(name) for name in self._specs}
        storages = module_storages(self._model)
        capture = WriteCapture(storages, tensors, execute=False)
        with torch.no_grad(), capture:
            self._model.load_weights(tensors.items())
        by_storage = self._quant_layers_by_storage()
        rebuild: dict[str, set[str]] = defaultdict(set)
        staged_ptrs = {s.staging.untyped_storage().data_ptr() for s in self._staged.values()}
        to_fill: set[str] = set()
        for w in capture.writes:
            if w.fed_name is None:
                continue
            ptr = w.dest_owner.tensor.untyped_storage().data_ptr()
            rebuild[w.fed_name].update(by_storage.get(ptr, ()))
            if ptr in staged_ptrs:
                to_fill.add(w.fed_name)
        self._rebuild = {n: tuple(sorted(ls)) for n, ls in rebuild.items()}
        with torch.no_grad():
            self._model.load_weights((n, tensors[n]) for n in sorted(to_fill))
        unfilled = [n for n, s in self._staged.items() if not any(n in ls for ls in self._rebuild.values())]
        if unfilled:
            raise LoaderError(f"no checkpoint tensor fills the packed weight of {unfilled[:3]}")
        for lname in sorted(set(self._staged) | {l for ls in self._rebuild.values() for l in ls}):
            if hasattr(self._model.get_submodule(lname), "cpu_linear"):  # (a GPU engine packs nothing)
                self._check_rebuilt_kernel(lname)

    def _check_rebuilt_kernel(self, lname: str) -> None:
        """A kernel rebuilt from the layer's plain weight must give the engine's kernel's bits on
        a fixed input.  Built on a stand-in (:func:`_build_kernel`) where vLLM's method allows,
        the engine's layer untouched.  When the engine's kernel ignores the weight argument it
        is passed (a zero weight gives the same bits) and the kernel owns a copy of the weight
        (writing the weight leaves it unchanged), a staging weight joins ``unserved()`` and a
        weight vLLM keeps joins ``kernel_weights()``.  A kernel that computes from the weight
        argument (vLLM's torch fallback where oneDNN cannot pack, e.g. an AVX2 CPU) joins
        neither: its writes are served at once, there is nothing to build ahead of the window."""
        layer = self._model.get_submodule(lname)
        weight = layer._parameters["weight"]
        k = weight.shape[1]
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        bias = layer._parameters.get("bias")
        engine_kernel = layer.cpu_linear
        with torch.no_grad():
            before = engine_kernel(x, weight, bias)
            source = weight.detach().clone()
            try:
                kernel = _build_kernel(layer, source)
            except Exception:  # noqa: BLE001 - a method that needs the real layer: rebuilt in place
                kernel = None
            if kernel is None:
                self._rebuild_layer(lname)
                after = layer.cpu_linear(x, weight, bias)
                layer.cpu_linear = engine_kernel
            else:
                after = kernel(x, weight, bias)
        if not torch.equal(before.view(torch.int16), after.view(torch.int16)):
            raise LoaderError(
                f"{lname}: the checkpoint does not reproduce the engine's packed weight "
                "(engine not at the checkpoint's version?)"
            )
        if kernel is None:
            return
        self._by_proxy.add(lname)
        with torch.no_grad():
            if not torch.equal(engine_kernel(x, torch.zeros_like(weight), bias).view(torch.int16),
                               before.view(torch.int16)):
                return  # it computes from the weight it is passed: nothing is built ahead
            int_bits = source.view(torch.int16)
            int_bits.bitwise_xor_(1)  # the kernel's own copy must not see this
            owns_copy = torch.equal(kernel(x, weight, bias).view(torch.int16), after.view(torch.int16))
        if not owns_copy:
            return
        owner = module_storages(self._model).get(weight.untyped_storage().data_ptr())
        if not owner.aliases and lname in self._staged:
            self._unserved[lname] = owner.name
        else:  # a weight vLLM keeps (embedding, lm_head) is served, or at least reported
            self._copied[lname] = owner.name  # (/weight_checker): written inside the window

    def _rebuild_layer(self, lname: str) -> None:
        if lname in self._by_proxy:  # built beside the serving one, then swapped in
            layer = self._model.get_submodule(lname)
            layer.cpu_linear = _build_kernel(layer, self._weight(lname))
            return
        layer = self._model.get_submodule(lname)
        layer.quant_method.process_weights_after_loading(layer)
        staged = self._staged.get(lname)
        if staged is not None:  # vLLM registered an empty weight in its place
            layer.register_parameter("weight", staged.staging)

    def _weight(self, lname: str) -> torch.Tensor:
        staged = self._staged.get(lname)
        return staged.staging if staged is not None else self._model.get_submodule(lname)._parameters["weight"]

    # ------------------------------------------------------ two-phase apply
    def unserved(self) -> frozenset[str]:
        """Parameters no forward pass reads: the plain weights of layers whose GEMM reads a
        packed copy (checked per layer at set-up, ``_check_rebuilt_kernel``)."""
        return frozenset(self._unserved.values())

    def kernel_weights(self) -> frozenset[str]:
        """Parameters vLLM keeps that a packed kernel is also built from (the embedding table,
        lm_head): ``prepare`` builds those kernels from patched copies."""
        return frozenset(self._copied.values())

    def prepare(self, names: frozenset[str], copies: Mapping[str, torch.Tensor]) -> dict:
        """Kernels for the layers ``names`` write, built beside the ones serving: from the
        (unserved) plain weight, or from the patched copy of a served one in ``copies``
        (parameter name -> flat integer copy).  ``install`` swaps them in."""
        out: dict[str, object] = {}
        for lname in sorted({lname for n in names for lname in self._rebuild.get(n, ())}):
            if lname in self._unserved:
                out[lname] = _build_kernel(self._model.get_submodule(lname), self._weight(lname))
            elif self._copied.get(lname) in copies:
                weight = self._weight(lname)
                flat = copies[self._copied[lname]]
                if flat.numel() == weight.numel():
                    out[lname] = _build_kernel(self._model.get_submodule(lname),
                                               flat.view(weight.dtype).view(weight.shape))
        return out

    def install(self, prepared: dict, names: frozenset[str], covered: frozenset[str]) -> None:
        """``post_load(names)``, the layers ``prepare`` built swapped in instead of rebuilt,
        except a layer that names outside ``covered`` (records ``prepare`` did not see, e.g.
        an overwrite of another tensor fused into the same weight) also wrote: rebuilt."""
        def layers(ns):
            return {lname for n in ns for lname in self._rebuild.get(n, ())}

        for lname, kernel in prepared.items():
            self._model.get_submodule(lname).cpu_linear = kernel
        for lname in sorted((layers(names) - prepared.keys()) | layers(names - covered)):
            self._rebuild_layer(lname)

    # ---------------------------------------------------------- RuntimeAdapter
    @property
    def module(self) -> torch.nn.Module:
        return self._model

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._model.load_weights(weights)

    def post_load(self, names: frozenset[str]) -> None:
        for lname in sorted({lname for n in names for lname in self._rebuild.get(n, ())}):
            self._rebuild_layer(lname)

    def initial_tensor(self, name: str) -> torch.Tensor | None:
        path = self._files.get(name)
        return None if path is None else read_checkpoint_tensor(path, self._specs[name])

    # ----------------------------------------------------------------- extras
    def staging_bytes(self) -> int:
        """Bytes of plain weights kept beside vLLM's packed kernels (this worker)."""
        return sum(s.staging.numel() * s.staging.element_size() for s in self._staged.values())

    def staged_layers(self) -> tuple[str, ...]:
        return tuple(self._staged)

    def rebuilt_layers(self, name: str) -> tuple[str, ...]:
        """Layers whose kernel ``post_load`` rebuilds after ``name`` changed."""
        return self._rebuild.get(name, ())
