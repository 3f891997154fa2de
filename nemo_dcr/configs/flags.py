"""Command-line flags made from a config dataclass's fields, so that a setting's default,
type and help live in one place: the field.

A field gets a flag by carrying it in its metadata::

    poll_s: float = field(default=0.05, metadata=flag("--poll-s", "interval between checks"))

and :class:`FieldFlags` adds it to an ``argparse`` parser: the field's type (``int``,
``float``, ``str``, or one of them or ``None``), its default, its help; a field without a
default is a required flag; a ``bool`` field is ``store_true`` (default ``False``) or, for a
``--no-<name>`` flag, ``store_false`` into the field's name (default ``True``).
:func:`field_values` reads the fields back from the parsed arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

FLAG, HELP = "flag", "help"


def flag(name: str, help: str) -> dict[str, str]:
    """A field's ``metadata``: its command-line flag ``name`` and the flag's ``help``."""
    return {FLAG: name, HELP: help}


def flagged_fields(cls) -> dict[str, dataclasses.Field]:
    """The fields of dataclass ``cls`` that carry a flag, by name, in field order."""
    return {f.name: f for f in dataclasses.fields(cls) if FLAG in f.metadata}


def _negated(f: dataclasses.Field) -> bool:
    return f.metadata[FLAG] == f"--no-{f.name.replace('_', '-')}"


def flag_dest(f: dataclasses.Field) -> str:
    """Where argparse stores field ``f``'s flag: its own name for ``--no-<name>``, else the
    flag's (``--persistent-weights`` -> ``persistent_weights``)."""
    return f.name if _negated(f) else f.metadata[FLAG].lstrip("-").replace("-", "_")


def _value_type(cls, f: dataclasses.Field):
    tp = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp


def flag_arguments(cls, f: dataclasses.Field) -> tuple[tuple[str, ...], dict]:
    """``(args, kwargs)`` of ``add_argument`` for field ``f`` of ``cls``."""
    name, kwargs = f.metadata[FLAG], {}
    tp = _value_type(cls, f)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        kwargs["required"] = True
    elif tp is bool:
        negated = _negated(f)
        if f.default is not negated:  # a class's bug: the flag could not set it
            raise AssertionError(f"{cls.__name__}.{f.name}: a {name} flag needs the default {negated}")
        if negated:
            kwargs.update(dest=f.name, action="store_false")
        else:
            kwargs.update(action="store_true")
    else:
        kwargs.update(type=tp, default=f.default)
    return (name,), {**kwargs, "help": f.metadata[HELP]}


class FieldFlags:
    """Adds the flags of config dataclasses' fields to ``parser``, in the order asked for
    (so they can sit between hand-written flags); :meth:`add_rest` adds those not asked for."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser
        self.added: set[tuple[type, str]] = set()

    def add(self, cls, *names: str) -> None:
        fields = flagged_fields(cls)
        for name in names:
            args, kwargs = flag_arguments(cls, fields[name])
            self.parser.add_argument(*args, **kwargs)
            self.added.add((cls, name))

    def add_rest(self, cls) -> None:
        self.add(cls, *[n for n in flagged_fields(cls) if (cls, n) not in self.added])


def field_values(args: argparse.Namespace, cls) -> dict:
    """The flagged fields of ``cls`` as parsed into ``args``, by field name."""
    return {name: getattr(args, flag_dest(f)) for name, f in flagged_fields(cls).items()}
