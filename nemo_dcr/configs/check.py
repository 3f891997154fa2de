"""The one check of a number setting (:func:`check_number`) and the errors a refused setting
raises.  Every numeric setting is checked here: the config schemas (``check_field_types``; ``sender/options.py``'s
``RefitOptions``), the store's ``StorePolicy``, the relay's ``RelayConfig``, the receiver's
``ReceiverConfig`` and ``RuntimeOptions`` and the receiver's command line, so a
refusal reads the same wherever the number came from: one line naming the setting, what it
must be, and the value given.

Imports nothing but :mod:`nemo_dcr.errors` (the store and the receiver import it).
"""
from __future__ import annotations

from nemo_dcr.errors import ValidationError, WrongTypeError


class ConfigError(ValidationError):
    """A configuration that cannot be loaded: unknown key, wrong type, bad value."""


class ConfigTypeError(ConfigError, WrongTypeError):
    """A setting of the wrong type (also a ``TypeError``, as raised before this class)."""


_KINDS = {int: "an int", float: "a number"}


def check_number(name: str, value, *, kind: type = int, min: float | None = None, max: float | None = None,
                 positive: bool = False, allow_none: bool = False):
    """``value`` if it is a number setting that fits, else one :class:`ConfigError` naming
    ``name``.

    ``kind``: ``int`` (an int, not a bool) or ``float`` (an int or a float, not a bool); a
    value of another type is a :class:`ConfigTypeError` (``<name> must be an int, got
    'x'``).  ``positive``: ``> 0`` (``<name> must be positive, got 0``); ``min`` / ``max``:
    inclusive bounds (``<name> must be >= 1, got 0``).  ``allow_none``: ``None`` is
    accepted as it is (a setting left unset).  Returns ``value`` unchanged."""
    if kind not in _KINDS:
        raise WrongTypeError(f"check_number: kind must be int or float, got {kind!r}")
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ConfigTypeError(f"{name} must be {_KINDS[kind]}, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if min is not None and not value >= min:
        raise ConfigError(f"{name} must be >= {min}, got {value}")
    if max is not None and not value <= max:
        raise ConfigError(f"{name} must be <= {max}, got {value}")
    return value
