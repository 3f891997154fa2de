"""Every exception the library raises on purpose is a ``DcrError`` of exactly one family,
and keeps the builtin base older callers caught."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import nemo_dcr
from nemo_dcr import errors

FAMILIES = (errors.FormatError, errors.ValidationError, errors.PlacementError,
            errors.ProtocolError, errors.TransportError)


def _library_exceptions():
    out = {}
    for mod in pkgutil.walk_packages(nemo_dcr.__path__, "nemo_dcr."):
        if mod.name.startswith(("nemo_dcr.testbed", "nemo_dcr.runtimes.vllm")):
            continue  # the test bed is not the product; vLLM imports need the engine
        m = importlib.import_module(mod.name)
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.__name__:
                out[f"{m.__name__}.{name}"] = obj
    return out


EXC = _library_exceptions()


def test_found_the_library_exceptions():
    # negative control for the walk itself: these must be among what it found
    for name in ("nemo_dcr.codec.format.ChunkFormatError", "nemo_dcr.transport.store.StoreError",
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
