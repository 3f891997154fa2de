"""The packaged Hydra config (``refit.yaml``, package data found through
``importlib.resources``, so an installed wheel finds it as the source tree does) and the
one strict loader that turns it (and the test bed's ``demo.yaml``) into keyword-only dataclasses.

:func:`load_config` composes ``<name>.yaml`` with Hydra's override grammar
(``refit.receivers=[r0,r1]``, ``steps=5``) over the typed schema (the yaml's defaults list
starts with it), then builds the dataclasses:

* an override naming a key the schema does not have (``refit.colour=red``, ``+x=1``,
  ``++x=1``, ``~x``) is refused before Hydra composes, with the closest key named;
* a key in the yaml file the schema does not have is refused the same way;
* ``refit.receivers=N`` (a count) names ``N`` receivers ``r0 .. r<N-1>``
  (:func:`expand_counts`); every other value of the wrong type is refused by OmegaConf's typed nodes, a missing required one
  (``???``) by the composition; each dataclass's ``__post_init__`` checks the rest (a
  ``ValidationError``, or for a schema that is not this package's, a builtin ``ValueError``
  or ``TypeError``).

Every refusal is a :class:`ConfigError` (or the caller's subclass) with one line of text.
Hydra and OmegaConf are imported only here, inside the functions: the schemas are plain
dataclasses.
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import fields, is_dataclass
from importlib import resources

from nemo_dcr.configs.check import ConfigError, ConfigTypeError, check_number  # noqa: F401 - also found here

T = typing.TypeVar("T")


def schema_name(config_name: str) -> str:
    """The ConfigStore name ``<config_name>.yaml``'s defaults list must start with."""
    return f"nemo_dcr_{config_name}_schema"


def field_types(cls) -> dict[str, object]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: treat fields as leaves
        return {}


def check_field_types(obj, prefix: str) -> None:
    """Check (and normalise) the leaf fields of dataclass ``obj`` against their annotations:
    ``int`` (not bool), ``float`` (an int is converted), ``bool``, ``str``, ``tuple[str, ...]``
    (a list is converted).  For schemas built from Python, not through :func:`load_config`
    (where OmegaConf's typed nodes did this already).  Raises :class:`ConfigTypeError` (a
    ``TypeError``) naming the key."""
    types = field_types(type(obj))
    for f in fields(obj):
        name, tp = f.name, types.get(f.name)
        v, key = getattr(obj, name), f"{prefix}.{name}" if prefix else name
        if tp is bool and not isinstance(v, bool):
            raise ConfigTypeError(f"{key} must be true or false, got {v!r}")
        if tp is int:
            check_number(key, v, kind=int)
        if tp is float:
            object.__setattr__(obj, name, float(check_number(key, v, kind=float)))
        if tp is str and not isinstance(v, str):
            raise ConfigTypeError(f"{key} must be a string, got {v!r}")
        if typing.get_origin(tp) is tuple:
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                raise ConfigTypeError(f"{key} must be a list of strings, got {v!r}")
            object.__setattr__(obj, name, tuple(v))


def _unknown_key(path: str, name: str, cls) -> ConfigError:
    """Names a section of ``cls`` that has the key (``model_id`` -> ``refit.model_id``), else
    the closest key of ``cls``."""
    full, prefix = f"{path}.{name}" if path else name, f"{path}." if path else ""
    types = field_types(cls)
    close = [f"{f.name}.{name}" for f in fields(cls)
             if is_dataclass(types.get(f.name)) and name in {g.name for g in fields(types[f.name])}][:1]
    close = close or difflib.get_close_matches(name, [f.name for f in fields(cls)], n=1)
    hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {full!r} ({cls.__name__} has no field {name!r}{hint})")


def build(cls: type[T], d, path: str = "") -> T:
    """Strict: the dataclass ``cls`` from a plain dict; a key ``cls`` does not have is an
    error naming it (a key left out takes the schema default)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config key {path!r} must be a mapping of {cls.__name__} fields, got {d!r}")
    names = {f.name for f in fields(cls)}
    for name in d:
        if name not in names:
            raise _unknown_key(path, name, cls)
    types = field_types(cls)
    kwargs = {}
    for name, value in d.items():
        sub = types.get(name)
        full = f"{path}.{name}" if path else name
        kwargs[name] = build(sub, value, full) if isinstance(sub, type) and is_dataclass(sub) else value
    return cls(**kwargs)


def check_override_keys(overrides: Sequence[str], schema) -> None:
    """Refuse an override whose key ``schema`` does not have, before Hydra composes:
    ``model.famly=x``, ``+model.famly=x``, ``++colour=red`` and ``~model.famly`` all name a
    key that does not exist (Hydra would accept the additions and drop or pass them on)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for line in overrides:
        try:
            (o,) = parser.parse_overrides([line])
        except Exception as e:  # noqa: BLE001 - Hydra's parse errors: name the override
            raise ConfigError(f"override {line!r} does not parse: {describe_config_error(e)}") from None
        if o.package is not None:
            raise ConfigError(f"override {o.input_line!r}: package overrides (key@package) are not supported")
        cls, path = schema, ""
        for name in o.key_or_group.split("."):
            if not (isinstance(cls, type) and is_dataclass(cls)):
                raise ConfigError(f"override {o.input_line!r}: {path!r} is a value, it has no key {name!r}")
            if name not in {f.name for f in fields(cls)}:
                raise _unknown_key(path, name, cls)
            cls, path = field_types(cls).get(name), f"{path}.{name}" if path else name


def describe_config_error(e: BaseException) -> str:
    """One line for a configuration error: the message and its causes (Hydra puts the
    reason a value was refused in ``__cause__``), whitespace collapsed."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen and len(parts) < 4:
        seen.add(id(cur))
        text = " ".join(str(cur).split())
        text = re.sub(r"\s*See https://hydra\.cc/\S+ for details\.?", "", text)
        # OmegaConf's context lines: keep the key, drop the node types
        text = re.sub(r"\s*full_key: (\S*)(?: reference_type=\S+)?(?: object_type=\S+)?",
                      lambda m: f" (key {m.group(1)})" if m.group(1) else "", text)
        if text and not any(text in p for p in parts):
            parts.append(text)
        cur = cur.__cause__
    return ": ".join(parts) or type(e).__name__


def _schema_node(cls):
    """``cls`` as a writable OmegaConf node: typed leaves (wrong types refused at merge),
    nested dataclasses expanded even where they have no default (required fields stay
    ``???``).  Frozen dataclasses make read-only nodes; overrides must write them."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cls)
    OmegaConf.set_readonly(node, False)
    types = field_types(cls)
    for f in fields(cls):
        sub = types.get(f.name)
        if isinstance(sub, type) and is_dataclass(sub):
            if OmegaConf.is_missing(node, f.name):
                node[f.name] = _schema_node(sub)
            else:
                _writable(node._get_node(f.name))
    return node


def _writable(node) -> None:
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for k in node:
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                _writable(child)


COUNTED_LISTS = {"refit.receivers": "r"}
"""Lists of ids an override may give as a count: ``refit.receivers=4`` is
``refit.receivers=[r0,r1,r2,r3]`` (the ids the demo and the receivers' default names use)."""
MAX_COUNT = 1024
_COUNT = re.compile(r"^(\+{0,2})([A-Za-z_.]+)=([0-9]{1,6})$")


def expand_counts(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with every count for a key of :data:`COUNTED_LISTS` written as its list
    of ids; a count over :data:`MAX_COUNT` is refused."""
    out = []
    for line in overrides:
        m = _COUNT.match(line.strip())
        if m and m.group(2) in COUNTED_LISTS:
            n = int(m.group(3))
            if n > MAX_COUNT:
                raise ConfigError(f"override {line!r}: at most {MAX_COUNT} receivers")
            prefix = COUNTED_LISTS[m.group(2)]
            line = f"{m.group(1)}{m.group(2)}=[{','.join(f'{prefix}{i}' for i in range(n))}]"
        out.append(line)
    return out


def load_config(schema: type[T], config_name: str, overrides: Sequence[str], *,
                config_dir: str | None = None, error: type[Exception] = ConfigError) -> T:
    """The validated ``schema`` instance from ``<config_dir>/<config_name>.yaml`` (by default
    this package's own file) composed with Hydra ``overrides``.  Any refusal is one ``error``
    with a one-line message (``error`` takes the message, as ``ConfigError`` does)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    where = f"{config_name}.yaml"
    try:
        overrides = expand_counts(overrides)
        check_override_keys(overrides, schema)
        ConfigStore.instance().store(name=schema_name(config_name), node=_schema_node(schema))
        with ExitStack() as stack:
            if config_dir is None:
                config_dir = str(stack.enter_context(resources.as_file(resources.files(__name__))))
            where = os.path.join(config_dir, where)
            with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
                composed = compose(config_name=config_name, overrides=overrides)
            raw = OmegaConf.to_container(composed, resolve=True, throw_on_missing=True)
    except ConfigError as e:
        raise error(str(e)) from None
    # Hydra and OmegaConf raise builtin ValueError / TypeError for some values they refuse
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        raise error(describe_config_error(e)) from None
    try:
        return build(schema, raw)
    except ConfigTypeError as e:  # a dataclass's own type check (check_field_types, check_number)
        raise error(describe_config_error(e)) from None
    except ConfigError as e:  # the overrides were checked: the key is in the file
        raise error(f"{where}: {e}") from None
    # a value the caller's schema refuses in its __post_init__: the schema is the caller's
    # (the test bed's DemoConfig and ModelConfig refuse with the builtins), so the builtins
    # too; the try holds the one build call
    except (ValueError, TypeError) as e:  # ValidationError is a ValueError
        raise error(describe_config_error(e)) from None
