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


def check_store_uri(name: str, uri, *, reader: bool = False, **options) -> str:
    """``uri`` if the store it names can be used, else one :class:`ConfigError` naming the
    setting ``name`` (``store.uri``, ``refit.store_uri``, ``--store``), what is wrong and the
    fix: a local directory (for a ``reader``, one that exists), or an ``s3://`` store whose
    endpoint answers, credentials and region are accepted and bucket exists
    (``transport/preflight.check_store``, which writes nothing).  ``options``: the fsspec
    storage options the store is opened with.  Call it before any process starts: an
    unusable store is then bad input (exit 2), not a trainer that fails (exit 1)."""
    from nemo_dcr.transport.preflight import check_store  # imported here: this module imports only errors

    try:
        check_store(uri, reader=reader, **options)
    except ValidationError as e:
        raise ConfigError(f"{name}: {e}") from None
    return uri
