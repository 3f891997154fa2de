"""The serving runtimes a receiver can keep current, by name.

One table, ``_RUNTIMES``: name -> ``"module:factory"``.  The strings are resolved with
``importlib`` on first use, so importing the receiver (or listing the names, as config
validation does) imports no runtime, and a runtime whose engine is not installed costs
nothing until it is asked for.

A factory takes a :class:`RuntimeRequest` (what the bootstrap knows once version 0 is
verified on disk) and returns a :class:`ServedRuntime`: the ``ServedModel`` the receiver
engine drives (``receiver/served.py``), plus the runtime's own answers to the few things
the bootstrap cannot do generically (dump the served state, shut the engine down, say
whether weights persisted by an earlier process were mapped instead of loaded).  A factory
refuses, with ``ValidationError``, a request option its runtime does not support.

Adding a runtime: a package under ``nemo_dcr/runtimes/`` with such a factory, and one row
here.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from nemo_dcr.errors import ValidationError

_RUNTIMES: dict[str, str] = {
    "hf": "nemo_dcr.runtimes.hf:serve",
    "vllm": "nemo_dcr.runtimes.vllm.served:serve",
}


class UnknownRuntimeError(ValidationError):
    """A runtime name that is not in the registry."""


@dataclass(frozen=True, kw_only=True)
class RuntimeRequest:
    """What a runtime factory is given.  Options a runtime does not support must be at
    their defaults, or its factory refuses the request."""

    init_dir: str
    """The version-0 checkpoint directory (HF layout), already checked against the run's
    signed ``init/INIT.json``."""
    run_id: str
    """The run being followed (persistent weights are bound to it)."""
    state_dir: str
    """This receiver's local directory; a runtime keeps what must outlive it under it."""
    reference: bool = False
    """Also build what ``ServedModel.verify_dense`` compares against (a second runtime of
    the same kind); without it ``verify_dense`` refuses."""
    persistent: bool = False
    """Keep the weights where a restarted receiver finds them (``state_dir/weights``)."""
    tensor_parallel_size: int = 1
    """Workers the engine shards each tensor over."""
    max_model_len: int | None = None
    """The engine's context length (``None``: the runtime's default)."""
    sample_tokens: int = 0
    """Greedy tokens generated after every refit and reported in the ack (0: none)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValidationError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.sample_tokens < 0:
            raise ValidationError(f"sample_tokens must be >= 0, got {self.sample_tokens}")

    def refuse_unsupported(self, runtime: str, *, persistent: bool = False, tensor_parallel: bool = False,
                           max_model_len: bool = False, sample_tokens: bool = False) -> None:
        """Raise ``ValidationError`` for every option set away from its default that
        ``runtime`` does not support (the keyword arguments say which it does)."""
        unsupported = [name for name, supported, is_set in (
            ("persistent", persistent, self.persistent),
            ("tensor_parallel_size", tensor_parallel, self.tensor_parallel_size != 1),
            ("max_model_len", max_model_len, self.max_model_len is not None),
            ("sample_tokens", sample_tokens, self.sample_tokens != 0),
        ) if is_set and not supported]
        if unsupported:
            raise ValidationError(f"runtime {runtime!r} does not support {', '.join(unsupported)}")


@dataclass(kw_only=True)
class ServedRuntime:
    """What a runtime factory returns."""

    served: object
    """The ``ServedModel`` (``receiver/served.py``) the receiver engine applies versions to."""
    restored: bool = False
    """True when the weights were mapped from an earlier process's persistent state instead
    of loaded from ``init_dir``: they hold the committed version plus possibly a
    half-applied one, which the bootstrap repairs from the journal."""
    dump: Callable[[str, int], None] | None = None
    """Testing aid, ``dump(directory, version)``: write the served state to
    ``directory/v<version>.safetensors``; ``None`` where the runtime cannot."""
    close: Callable[[], None] = field(default=lambda: None)
    """Release the runtime (engine processes, memory); called once when the receiver stops."""


RuntimeFactory = Callable[[RuntimeRequest], ServedRuntime]


def runtime_names() -> tuple[str, ...]:
    """The registered runtime names, in registry order."""
    return tuple(_RUNTIMES)


def runtime_factory(name: str) -> RuntimeFactory:
    """The factory registered as ``name`` (its module is imported now, not before)."""
    try:
        target = _RUNTIMES[name]
    except (KeyError, TypeError):
        raise UnknownRuntimeError(f"unknown runtime {name!r} (known: {', '.join(_RUNTIMES)})") from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
