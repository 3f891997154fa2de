"""The errors a refused setting raises.

Imports nothing but :mod:`nemo_dcr.errors` (the store and the receiver import it).
"""
from __future__ import annotations

from nemo_dcr.errors import ValidationError, WrongTypeError


class ConfigError(ValidationError):
    """A configuration that cannot be loaded: unknown key, wrong type, bad value."""


class ConfigTypeError(ConfigError, WrongTypeError):
    """A setting of the wrong type (also a ``TypeError``, as raised before this class)."""
