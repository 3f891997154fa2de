"""What vLLM's weight-transfer routes hand the ``nemo_dcr`` backend: JSON only, checked here.

``/init_weight_transfer_engine {"init_info": {...}}`` (or ``LLM.init_weight_transfer_engine``)
carries :class:`BackendInitInfo`; ``/update_weights {"update_info": {...}}`` carries
:class:`UpdateInfo`.  Both are parsed from plain JSON values (never pickle): an unknown key,
a missing required one or a value of the wrong type is one ``ConfigError`` line naming the
key, raised before anything is opened or written.  No vLLM import (the engine that uses them
is ``backend.py``).
"""
from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, fields

from nemo_dcr.configs.check import ConfigError, ConfigTypeError, check_number
from nemo_dcr.protocol.keys import is_receiver_id

BACKEND = "nemo_dcr"
"""The name the backend is registered under (``--weight-transfer-config '{"backend": "nemo_dcr"}'``)."""


def _parse(cls, raw, what: str):
    if not isinstance(raw, dict):
        raise ConfigTypeError(f"{what} must be a JSON object, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    for k in raw:
        if k not in known:
            raise ConfigError(f"{what}: unknown key {k!r} (known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in known.items():
        if name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{what}: {name!r} is required")
            continue
        values[name] = _typed(f"{what}.{name}", raw[name], hints[name])
    return cls(**values)


def _typed(key: str, v, tp):
    """``v`` as annotation ``tp``: str, int (not bool), float (an int is taken), bool, a
    ``X | None``, or a ``Literal`` alternative."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    if v is None:
        if type(None) in options:
            return None
        raise ConfigTypeError(f"{key} must not be null")
    errors = []
    for t in options:
        if t is type(None):
            continue
        if typing.get_origin(t) is typing.Literal:
            if v in typing.get_args(t) and type(v) is type(typing.get_args(t)[0]):
                return v
            errors.append(" or ".join(repr(a) for a in typing.get_args(t)))
        elif t is bool:
            if isinstance(v, bool):
                return v
            errors.append("true or false")
        elif t is int:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            errors.append("an integer")
        elif t is float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            errors.append("a number")
        elif t is str:
            if isinstance(v, str):
                return v
            errors.append("a string")
    raise ConfigTypeError(f"{key} must be {' or '.join(errors)}, got {v!r}")


@dataclass(kw_only=True, frozen=True)
class BackendInitInfo:
    """How one vLLM engine follows a run as a member of its joint commit."""

    store: str
    """Where the run is published: a directory, ``s3://...``, ``relay://host:port``, or an
    ordered comma-separated list of these (failover, as ``nemo-dcr receive --store``)."""
    receiver_id: str
    """The name this engine acknowledges under (``acks/<id>/``): one of the trainer's
    ``refit.receivers``, or any name with ``join``."""
    model_id: str
    """Manifests of any other model are refused."""
    key_file: str | None = None
    """The run's signing key (``nemo-dcr keygen``); None: ``NEMO_DCR_KEY_FILE`` of the
    engine's environment, else none (then only with ``insecure_no_key``)."""
    insecure_no_key: bool = False
    """Follow a signed run without checking any signature (testing only: anyone who can
    write to the store could then make the engine apply anything)."""
    run_id: str | None = None
    """Follow only this run (default: the store's)."""
    join: bool = False
    """Elastic membership: ask the trainer to admit this engine (``refit.membership=elastic``)."""
    poll_s: float = 0.05
    """Interval between checks for the next version while idle."""
    fetch_threads: int = 0
    """Chunks downloaded, verified and decoded at once; 0: one per CPU core, at most 8."""
    stream: bool = True
    """Fetch and decode a version's chunks as they land, before its manifest (streaming receive)."""
    start_version: int = 0
    """The committed version the engine's checkpoint holds: 0 (the run's version 0), or N for
    a committed-version snapshot (``nemo-dcr checkpoint`` writes one: N's snapshot files with
    version 0's others), checked file by file against the run's signed snapshot record."""
    start_timeout_s: float = 600.0
    """How long ``init`` waits for the run record and version 0 to be published."""
    update_timeout_s: float = 600.0
    """How long an update waits for its version to be decided (an update's own
    ``timeout_s`` overrides it)."""
    status_path: str | None = None
    """A file the engine rewrites (atomically, JSON) on every change: the version committed,
    the one staged, the last protocol event.  The controller reads it to wait until a
    version is staged before pausing generation."""

    def __post_init__(self) -> None:
        if not is_receiver_id(self.receiver_id):
            raise ConfigError(f"init_info.receiver_id: invalid receiver id {self.receiver_id[:80]!r} "
                              "(letters, digits, _ and -, at most 64)")
        if not self.store or not self.model_id:
            raise ConfigError("init_info: 'store' and 'model_id' must not be empty")
        check_number("init_info.poll_s", self.poll_s, kind=float, positive=True)
        check_number("init_info.fetch_threads", self.fetch_threads, min=0)
        check_number("init_info.start_version", self.start_version, min=0)
        check_number("init_info.start_timeout_s", self.start_timeout_s, kind=float, positive=True)
        check_number("init_info.update_timeout_s", self.update_timeout_s, kind=float, positive=True)

    @classmethod
    def from_json(cls, raw) -> BackendInitInfo:
        return _parse(cls, raw, "init_info")


@dataclass(kw_only=True, frozen=True)
class UpdateInfo:
    """One ``/update_weights`` request: which version to apply."""

    version: int | typing.Literal["latest"]
    """The version to hold after the update; ``"latest"``: the one the run's signed
    ``HEAD.json`` names when the request arrives."""
    timeout_s: float | None = None
    """How long to wait for it to be decided (default: ``update_timeout_s``)."""

    def __post_init__(self) -> None:
        if self.version != "latest":
            check_number("update_info.version", self.version, min=0)
        check_number("update_info.timeout_s", self.timeout_s, kind=float, positive=True, allow_none=True)

    @classmethod
    def from_json(cls, raw) -> UpdateInfo:
        return _parse(cls, raw, "update_info")


