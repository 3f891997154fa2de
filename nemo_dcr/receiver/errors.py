"""Errors the apply engine raises.  Every one is raised before the first write unless its
docstring says otherwise."""
from __future__ import annotations

from nemo_dcr import errors
from nemo_dcr.errors import ValidationError


class DeltaValidationError(ValidationError):
    """A delta batch does not fit the runtime's canonical tensors (unknown name, dtype or
    shape differing from the spec, a position out of range or named by two records)."""


class LoaderError(errors.PlacementError):
    """The runtime's loader does not behave as in-place apply needs (never copies a
    tensor, rebinds a parameter, writes one destination twice, changed placement since
    prewarm, transforms a tensor no canonical mirror can be seeded for): the library's
    ``PlacementError`` family, on the receiver's side."""


class IncompleteApplyError(LoaderError):
    """Names were requested but not written (set difference of requested vs touched).
    For tensors that go through the loader as overwrites this is detected after the
    loader ran, so earlier writes of the same batch may have happened."""
