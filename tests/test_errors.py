"""Every exception the library raises on purpose is a ``DcrError`` of exactly one family,
and keeps the builtin base older callers caught."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import nemo_dcr
from nemo_dcr import errors

FAMILIES = (errors.FormatError, errors.ValidationError, errors.PlacementError,
            errors.ProtocolError, errors.TransportError)


def _library_exceptions():
    out = {}
    for mod in pkgutil.walk_packages(nemo_dcr.__path__, "nemo_dcr."):
        if mod.name.startswith("nemo_dcr.runtimes.vllm"):
            continue  # vLLM imports need the engine
        m = importlib.import_module(mod.name)
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.__name__:
                out[f"{m.__name__}.{name}"] = obj
    return out


EXC = _library_exceptions()


def test_found_the_library_exceptions():
    # negative control for the walk itself: these must be among what it found
    for name in ("nemo_dcr.codec.format.ChunkFormatError", "nemo_dcr.transport.store.base.StoreError",
                 "nemo_dcr.receiver.fetch.RefitRefused", "nemo_dcr.errors.DcrError"):
        assert name in EXC


@pytest.mark.parametrize("name", sorted(EXC))
def test_every_exception_is_a_dcr_error(name):
    cls = EXC[name]
    assert issubclass(cls, errors.DcrError), f"{name} does not derive from DcrError"
    if cls is errors.DcrError or cls in FAMILIES:
        return
    fams = [f for f in FAMILIES if issubclass(cls, f)]
    # StaleCountsError is an internal invariant breach, not a user-facing family
    assert len(fams) == 1 or (name.endswith("StaleCountsError") and not fams), (name, fams)


def test_builtin_bases_kept():
    from nemo_dcr.codec.format import ChunkFormatError
    from nemo_dcr.transport.store import ObjectNotFound

    assert issubclass(ChunkFormatError, ValueError)
    assert issubclass(ObjectNotFound, KeyError) and issubclass(ObjectNotFound, OSError)
    with pytest.raises(errors.TransportError):
        raise ObjectNotFound("x")


def test_layout_error_is_placement_and_value_error():
    from nemo_dcr.layout.shards import LayoutError

    assert issubclass(LayoutError, errors.PlacementError) and issubclass(LayoutError, ValueError)


# --- no bare ValueError / RuntimeError ------------------------------------------------

ROOT = Path(nemo_dcr.__file__).resolve().parent
BARE = ("ValueError", "RuntimeError")

def builtin_raises(source: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, builtin) of each ``raise NAME(...)`` / ``raise NAME`` for NAME in ``names``
    (with or without arguments or ``from``), however many lines the statement spans."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in names:
                out.append((node.lineno, exc.id))
    return sorted(out)


def bare_raises(source: str) -> list[tuple[int, str]]:
    return builtin_raises(source, BARE)


def _product_sources():
    for p in sorted(ROOT.rglob("*.py")):
        yield p.relative_to(ROOT).as_posix(), p.read_text()


def test_bare_raise_detector():
    # negative controls: a multi-line raise, a bare name, a chained raise; and what is fine
    src = ('def f(x):\n    if x:\n        raise ValueError(\n            "many"\n            " lines")\n'
           '    raise RuntimeError\n\ndef g():\n    try:\n        pass\n    except KeyError as e:\n'
           '        raise ValueError("x") from e\n')
    assert bare_raises(src) == [(3, "ValueError"), (6, "RuntimeError"), (12, "ValueError")]
    assert bare_raises('raise ValidationError("x")\nraise TypeError("y")\nraise\n') == []


def test_no_bare_value_or_runtime_error():
    found = {rel: sites for rel, src in _product_sources() if (sites := bare_raises(src))}
    assert not found, f"raise a family of nemo_dcr/errors.py instead: {found}"


# --- no bare TypeError / KeyError for what a user gave ----------------------------------

# the bare builtins left on purpose: a programming bug's assertion and a Mapping's protocol
BUILTIN_ALLOWED = {
    ("protocol/doc.py", "TypeError"),  # an annotation a document class may not use: that class's bug
    ("receiver/held.py", "KeyError"),  # HeldBits.__getitem__: the Mapping protocol (``in``, ``get``)
}


def test_no_bare_type_or_key_error():
    names = ("TypeError", "KeyError")
    assert builtin_raises('raise TypeError("x")\nraise KeyError(k)\nraise WrongTypeError("y")\n', names) == [
        (1, "TypeError"), (2, "KeyError")]  # negative control
    found = {rel: sites for rel, src in _product_sources()
             if (sites := [s for s in builtin_raises(src, names) if (rel, s[1]) not in BUILTIN_ALLOWED])}
    assert not found, f"raise a family of nemo_dcr/errors.py (WrongTypeError for a wrong type) instead: {found}"


def test_wrong_type_and_config_errors_keep_their_builtins():
    from nemo_dcr.configs import ConfigError, ConfigTypeError

    assert issubclass(errors.WrongTypeError, errors.ValidationError) and issubclass(errors.WrongTypeError, TypeError)
    assert issubclass(ConfigTypeError, ConfigError) and issubclass(ConfigTypeError, TypeError)
    assert issubclass(ConfigError, ValueError)


def test_c_decode_is_the_one_place_for_the_extensions_value_error():
    from nemo_dcr.codec.format import ChunkFormatError, c_decode

    def refuses(*args):
        raise ValueError("coded stream is not a valid LANES payload for this record")

    def buggy(*args):
        raise TypeError("a bug")

    with pytest.raises(ChunkFormatError, match=r"^LANES payload: coded stream is not a valid"):
        c_decode("LANES", refuses, 1, 2)
    with pytest.raises(TypeError, match="a bug"):  # anything else propagates as it is
        c_decode("LANES", buggy)
    for rel in ("codec/model.py", "codec/lanes.py", "codec/bucket.py"):
        assert "except ValueError" not in (ROOT / rel).read_text(), rel


def test_read_committed_refuses_a_record_that_is_not_an_object(tmp_path):
    from nemo_dcr.receiver.journal import read_committed

    p = tmp_path / "committed.json"
    for text in ("[1, 2]", '{"committed": 3}', "{not json"):
        p.write_text(text)
        with pytest.raises(errors.ProtocolError, match="unreadable committed-version record"):
            read_committed(str(p))
    p.write_text('{"committed": 3, "digest": "ab"}')
    assert read_committed(str(p)) == (3, "ab")
