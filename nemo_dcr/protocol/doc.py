"""One codec for every signed document: a frozen dataclass <-> a sealed JSON object.

A document class derives from :class:`SignedDoc` and declares, besides its fields:

* ``KIND``: the seal's kind and the byte cap (``DOC_LIMITS[KIND]``, read before the object);
* ``WHAT``: how messages name it (``"join request"``);
* ``TAGS``: constant fields written first and required as they are (``format``, a format
  version), so a document of another kind or release is refused, never half-read;
* ``OPTIONAL``: fields an older writer may have left out (their defaults apply);
* ``OMIT_EMPTY``: fields left out when empty, so older readers still open the document.

Reading is strict and driven by the fields' annotations: unknown or missing fields, a
``bool`` where a number is due, a string where a list is due, a list of the wrong elements
are each a :class:`ManifestError` with one line naming the document and the field.  The
types a field may have: ``str``, ``int``, ``float`` (an ``int`` too), ``bool``, ``Any``,
``tuple[T, ...]`` (a JSON list), ``dict[str, T]`` (a JSON object) and a nested dataclass
(a JSON object, read by the same rules).  The bytes go through the bounded parser first
(``Sealer.open`` -> ``jsondoc.parse_document``), unchanged; the class's ``__post_init__``
then checks what the types cannot say (digests, id shapes, ranges).  Every document
carries ``run_id``, checked on read here.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Callable
from typing import Any, ClassVar

from nemo_dcr.errors import FormatError, ValidationError
from nemo_dcr.protocol.signing import Sealer

MAX_JSON_BYTES = 64 << 20
DOC_LIMITS = {"run": 64 << 10, "init": 64 << 10, "head": 64 << 10, "ack": 1 << 20, "decision": 1 << 20,
              "committed": 1 << 20, "join": 64 << 10, "snapshot": 64 << 10, "manifest": MAX_JSON_BYTES}
"""Byte cap per document kind, known before an object is read (``get(max_bytes=...)``) and
checked again by the parser: what a key-less writer plants under a document's key can
cost a reader at most this much memory."""
UNSIGNED = Sealer(None)
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class ManifestError(FormatError):
    """A document that is not what its key says: unparsable, of another format, or with a
    field of the wrong type or value."""


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ManifestError(f"invalid run id {str(run_id)[:80]!r} (32 lowercase hex digits)")
    return run_id


def load(data: bytes, what: str, kind: str, sealer: Sealer | None) -> dict:
    """Open a sealed document (signature checked when ``sealer`` has a key), parsed by the
    bounded parser under ``DOC_LIMITS[kind]``."""
    try:
        return (sealer or UNSIGNED).open(kind, data, what, max_bytes=DOC_LIMITS[kind])
    except FormatError as e:
        raise ManifestError(str(e)) from None


class SignedDoc:
    """Base of the protocol's documents (frozen dataclasses): ``to_json`` / ``from_json``."""

    KIND: ClassVar[str]
    WHAT: ClassVar[str]
    TAGS: ClassVar[dict[str, Any]] = {}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    OMIT_EMPTY: ClassVar[frozenset[str]] = frozenset()

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        body = to_plain(self)
        for name in self.OMIT_EMPTY:
            if not body[name]:
                del body[name]
        return (sealer or UNSIGNED).seal(self.KIND, {**self.TAGS, **body})

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None):
        obj = load(data, cls.WHAT, cls.KIND, sealer)
        for tag, want in cls.TAGS.items():
            got = obj.pop(tag, None)
            if got != want or type(got) is not type(want):
                raise ManifestError(f"{cls.WHAT}: {tag} {str(got)[:80]!r} not supported (this nemo_dcr reads "
                                    f"{want!r}; a run is written and read by one release)")
        check_run_id(obj.get("run_id"))
        return from_plain(cls, obj, cls.WHAT, optional=cls.OPTIONAL)


def to_plain(doc) -> dict:
    """A dataclass as JSON values: tuples as lists, nested dataclasses as objects."""
    return {f.name: _plain(getattr(doc, f.name)) for f in dataclasses.fields(doc)}


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_plain(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def from_plain(cls: type, obj: object, what: str, *, optional: frozenset[str] = frozenset()):
    """``cls`` from a parsed JSON object, every field checked against its annotation."""
    return _reader(cls)(obj, lambda: what, optional)


@functools.cache
def _reader(cls: type) -> Callable:
    """The reader of a document class, built once per class from its fields' annotations
    (evaluating annotations per object would dominate the parse of a manifest of many chunks).  ``where()`` names
    the value in a message; it is formatted only when one is raised."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _converter(hints[f.name]) for f in dataclasses.fields(cls) if f.init}

    def read(obj: object, where: Callable[[], str], optional: frozenset[str] = frozenset()):
        if not isinstance(obj, dict):
            raise ManifestError(f"{where()}: not an object")
        unknown = obj.keys() - fields.keys()
        if unknown:
            raise ManifestError(f"{where()}: unknown fields {sorted(str(k)[:40] for k in unknown)[:8]}")
        kwargs = {}
        for name, convert in fields.items():
            if name not in obj:
                if name in optional:
                    continue
                raise ManifestError(f"{where()}: missing field {name!r}")
            kwargs[name] = convert(obj[name], lambda name=name: f"{where()}: field {name!r}")
        try:
            return cls(**kwargs)
        except ManifestError:
            raise
        except ValidationError as e:  # a field's own check (an id's shape)
            raise ManifestError(f"{where()}: {e}") from None

    return read


def _converter(hint: object) -> Callable[[object, Callable[[], str]], object]:
    """A checking converter from a JSON value to ``hint`` (see the module docstring)."""
    if hint is Any:
        return lambda v, where: v
    origin = typing.get_origin(hint)
    if origin is tuple:
        elem = _converter(typing.get_args(hint)[0])

        def tuple_of(v, where):
            if not isinstance(v, list):
                raise ManifestError(f"{where()} must be a list, got {type(v).__name__}")
            return tuple(elem(x, lambda i=i: f"{where()}[{i}]") for i, x in enumerate(v))
        return tuple_of
    if origin is dict:
        elem = _converter(typing.get_args(hint)[1])

        def dict_of(v, where):
            if not isinstance(v, dict):
                raise ManifestError(f"{where()} must be an object, got {type(v).__name__}")
            return {k: elem(x, lambda k=k: f"{where()}[{str(k)[:40]!r}]") for k, x in v.items()}
        return dict_of
    if dataclasses.is_dataclass(hint):
        return lambda v, where: _reader(hint)(v, where)
    if hint is float:
        def number(v, where):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ManifestError(f"{where()} must be a number, got {type(v).__name__}")
            return v
        return number
    if hint in (int, str, bool):
        def plain(v, where):
            if isinstance(v, bool) is not (hint is bool) or not isinstance(v, hint):
                raise ManifestError(f"{where()} must be {hint.__name__}, got {type(v).__name__}")
            return v
        return plain
    raise TypeError(f"no JSON rule for the annotation {hint!r}")  # a document class's bug
