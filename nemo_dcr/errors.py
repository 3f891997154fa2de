"""One root exception for the library, with five families.

Callers classify a failure by family, not by builtin type::

    DcrError
      FormatError      bytes that do not parse: chunks, manifests, acks, records, files
      ValidationError  well-formed input that does not fit: another model or run, shapes
                       or counts a runtime does not have, budgets, settings
      PlacementError   a tensor that cannot be mapped: a Megatron layout no family
                       expresses, a runtime loader that does not behave as in-place
                       apply needs
      ProtocolError    versions and commits: a refusal, a missing acknowledgement, a bad
                       signature, a receiver that does not hold a delta's base
      TransportError   the store: an object that is missing, a call that failed or
                       timed out (the message names the key and the operation)

Each family also derives from the builtin that code written before this hierarchy caught
(``ValueError`` for format and validation, ``RuntimeError`` for placement and protocol,
``OSError`` for transport), so ``except ValueError`` keeps working.  A value of the wrong
type (a setting, an argument of the library's API) is a :class:`WrongTypeError`, a
``ValidationError`` that is also a ``TypeError`` (what was raised before).
"""
from __future__ import annotations


class DcrError(Exception):
    """Root of every error nemo_dcr raises on purpose."""


class FormatError(DcrError, ValueError):
    """Bytes that do not parse (corrupt, truncated, hostile, over a limit)."""


class ValidationError(DcrError, ValueError):
    """Well-formed input that does not fit what it is applied to or configured for."""


class WrongTypeError(ValidationError, TypeError):
    """A value of the wrong type: a setting, or an argument of the library's API (also a
    ``TypeError``, which code written before this hierarchy caught)."""


class PlacementError(DcrError, RuntimeError):
    """A tensor cannot be mapped between trainer shards, canonical names and a runtime."""


class ProtocolError(DcrError, RuntimeError):
    """A version, run, signature or commit decision that the protocol refuses."""


class TransportError(DcrError, OSError):
    """A store operation failed; the message names the key and the operation."""
