"""The serving runtimes a receiver can keep current, by name.

One table, ``_RUNTIMES``: name -> (``"module:factory"``, the runtime options it supports).
The strings are resolved with ``importlib`` on first use, so importing the receiver (or
listing the names, as config validation does) imports no runtime, and a runtime whose
engine is not installed costs nothing until it is asked for.  The options are checked
against the row (:func:`check_options`) before anything is downloaded or loaded.

A factory takes a :class:`RuntimeRequest` (what the bootstrap knows once version 0 is
verified on disk) and returns a :class:`ServedRuntime`: the ``ServedModel`` the receiver
engine drives (``receiver/served.py``), plus the runtime's own answers to the few things
the bootstrap cannot do generically (dump the served state, shut the engine down, say
whether weights persisted by an earlier process were mapped instead of loaded).

Adding a runtime: a package under ``nemo_dcr/runtimes/`` with such a factory, and one row
here.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from nemo_dcr.configs.check import check_number
from nemo_dcr.configs.flags import flag
from nemo_dcr.errors import ValidationError

_RUNTIMES: dict[str, tuple[str, frozenset[str]]] = {
    "hf": ("nemo_dcr.runtimes.hf:serve", frozenset({"persistent"})),
    "vllm": ("nemo_dcr.runtimes.vllm.served:serve",
             frozenset({"tensor_parallel_size", "max_model_len", "sample_tokens", "engine_log"})),
}


_REQUIRES: dict[str, tuple[str, str]] = {
    "hf": ("transformers", "hf"),
    "vllm": ("vllm", "vllm"),
}
"""Runtime name -> (the module its engine needs, the ``nemo-dcr`` extra that installs it)."""


class UnknownRuntimeError(ValidationError):
    """A runtime name that is not in the registry."""


class RuntimeUnavailable(ValidationError):
    """A registered runtime whose engine is not installed (or does not import): one line
    naming the extra to install."""


def _unavailable(name: str, why: str) -> RuntimeUnavailable:
    module, extra = _REQUIRES.get(name, (name, name))
    return RuntimeUnavailable(f"runtime {name!r} needs the {module} package, which {why}: "
                              f"pip install 'nemo-dcr[{extra}]'")


def check_installed(name: str) -> None:
    """Refuse (``RuntimeUnavailable``) runtime ``name`` when the package its engine needs
    cannot be found, without importing it (``importlib.util.find_spec``: milliseconds, where
    importing vllm takes seconds).  A package that is found but fails to import is caught
    when the runtime starts (:func:`runtime_factory`)."""
    import importlib.util

    _row(name)
    module = _REQUIRES.get(name, (None, None))[0]
    if module is None:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _unavailable(name, "is not installed")


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """How to run a runtime.  Every runtime supports ``reference``; the others must stay at
    their defaults unless the runtime's registry row lists them."""

    reference: bool = False
    """Also build what ``ServedModel.verify_dense`` compares against (a second runtime of
    the same kind); without it ``verify_dense`` refuses."""
    persistent: bool = field(default=False, metadata=flag(
        "--persistent-weights", "keep the weights under --state-dir, so a receiver killed mid-apply restarts over its "
        "own weights and repairs them from the journal instead of reloading version 0 and catching up (runtimes: hf)"))
    """Keep the weights where a restarted receiver finds them (``state_dir/weights``)."""
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "--tensor-parallel-size", "workers the engine shards each tensor over (runtimes: vllm)"))
    """Workers the engine shards each tensor over."""
    max_model_len: int | None = field(default=None, metadata=flag(
        "--max-model-len", "the engine's context length (runtimes: vllm)"))
    """The engine's context length (``None``: the runtime's default)."""
    sample_tokens: int = field(default=0, metadata=flag(
        "--sample-tokens", "greedy tokens generated after every refit and reported in the ack (runtimes: vllm)"))
    """Greedy tokens generated after every refit and reported in the ack (0: none)."""
    engine_log: str | None = field(default=None, metadata=flag(
        "--engine-log", "a file every engine process appends its own log lines to (default: stderr, so that "
        "stdout carries the receiver's JSON lines only; also $NEMO_DCR_ENGINE_LOG) (runtimes: vllm)"))
    """A file the engine's own log lines go to (``None``: stderr, or ``$NEMO_DCR_ENGINE_LOG``)."""

    def __post_init__(self) -> None:
        check_number("tensor_parallel_size", self.tensor_parallel_size, min=1)
        check_number("max_model_len", self.max_model_len, min=1, allow_none=True)
        check_number("sample_tokens", self.sample_tokens, min=0)

    def set_options(self) -> list[str]:
        """The runtime-specific options set away from their defaults."""
        return [name for name, is_set in (
            ("persistent", self.persistent),
            ("tensor_parallel_size", self.tensor_parallel_size != 1),
            ("max_model_len", self.max_model_len is not None),
            ("sample_tokens", self.sample_tokens != 0),
            ("engine_log", self.engine_log is not None),
        ) if is_set]


@dataclass(frozen=True, kw_only=True)
class RuntimeRequest:
    """What a runtime factory is given."""

    init_dir: str
    """The checkpoint directory (HF layout) to load, already checked against the run's signed
    records: version 0 (``init/INIT.json``) or a committed-version snapshot (``SNAPSHOT.json``)."""
    run_id: str
    """The run being followed (persistent weights are bound to it)."""
    state_dir: str
    """This receiver's local directory; a runtime keeps what must outlive it under it."""
    options: RuntimeOptions = field(default_factory=RuntimeOptions)


@dataclass(kw_only=True)
class ServedRuntime:
    """What a runtime factory returns."""

    served: object
    """The ``ServedModel`` (``receiver/served.py``) the receiver engine applies versions to."""
    restored: bool = False
    """True when the weights were mapped from an earlier process's persistent state instead
    of loaded from ``init_dir``: they hold the committed version plus possibly a
    half-applied one, which the bootstrap repairs from the journal."""
    dump: Callable[[str], None] | None = None
    """Testing aid, ``dump(path)``: write every parameter and buffer served now to the
    safetensors file ``path``; ``None`` where the runtime cannot."""
    close: Callable[[], None] = field(default=lambda: None)
    """Release the runtime (engine processes, memory); called once when the receiver stops."""


RuntimeFactory = Callable[[RuntimeRequest], ServedRuntime]


def runtime_names() -> tuple[str, ...]:
    """The registered runtime names, in registry order."""
    return tuple(_RUNTIMES)


def _row(name: str) -> tuple[str, frozenset[str]]:
    try:
        return _RUNTIMES[name]
    except (KeyError, TypeError):
        raise UnknownRuntimeError(f"unknown runtime {name!r} (known: {', '.join(_RUNTIMES)})") from None


def supported_options(name: str) -> frozenset[str]:
    """The runtime options (``RuntimeOptions`` field names besides ``reference``) that
    runtime ``name`` supports, from its row (imports nothing)."""
    return _row(name)[1]


def check_options(name: str, options: RuntimeOptions) -> None:
    """Refuse an unknown runtime, or options it does not support, without importing it."""
    _, supported = _row(name)
    unsupported = [o for o in options.set_options() if o not in supported]
    if unsupported:
        raise ValidationError(f"runtime {name!r} does not support {', '.join(unsupported)} "
                              f"(it supports: {', '.join(sorted(supported)) or 'none of the runtime options'})")


def runtime_factory(name: str) -> RuntimeFactory:
    """The factory registered as ``name`` (its module is imported now, not before)."""
    target, _ = _row(name)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # the engine is missing or broken: one line, not the import's traceback
        raise _unavailable(name, f"does not import ({type(e).__name__}: {' '.join(str(e).split())})") from None
    return getattr(module, attr)


def start_runtime(name: str, request: RuntimeRequest) -> ServedRuntime:
    """Check ``request.options`` against runtime ``name``'s row, then run its factory."""
    check_options(name, request.options)
    factory = runtime_factory(name)
    module = _REQUIRES.get(name, ("", ""))[0]
    try:
        return factory(request)
    except ModuleNotFoundError as e:  # the engine, imported by the factory itself
        if not module or not (e.name == module or (e.name or "").startswith(module + ".")):
            raise
        raise _unavailable(name, f"does not import ({' '.join(str(e).split())})") from None
