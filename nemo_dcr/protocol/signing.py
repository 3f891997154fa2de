"""Authenticated protocol documents: HMAC-SHA256 over canonical JSON bytes.

Every control document (run record, version-0 record, manifest, ack, decision, head
pointer) is a JSON object sealed by :meth:`Sealer.seal` and opened by
:meth:`Sealer.open`.  Chunks are not signed themselves: the signed manifest lists each
chunk's size and sha256, so a chunk is authentic when its digest matches.

* Canonical bytes: ``json.dumps(doc, sort_keys=True, separators=(",", ":"),
  ensure_ascii=True)`` of the document without its ``signature`` field.
* MAC input: ``b"nemo-dcr/" + kind + b"\\0" + canonical``.  The kind (``manifest``,
  ``ack``, ...) separates domains, so a signed ack can never pass as a manifest.
* ``signature``: ``"hmac-sha256:<64 hex>"`` with a key, ``"none"`` without one.

With a key, an unsigned or badly signed document is refused (``SignatureError``) before
any field is trusted.  Without a key nothing can be authenticated: documents are written
with ``"signature": "none"``, signatures are not checked, and :func:`load_key` says so
once in the log (integrity against accidents only; see docs/protocol.md, threat model).
The key is shared by the trainer and its receivers; whoever holds it is trusted.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys

from nemo_dcr.errors import FormatError, ProtocolError

KEY_ENV = "NEMO_DCR_KEY_FILE"
"""Environment variable naming the key file when no path is configured."""
MIN_KEY_BYTES = 16
MAX_DOC_BYTES = 64 << 20
_PREFIX = "hmac-sha256:"
UNSIGNED = "none"


class SignatureError(ProtocolError):
    """A document is unsigned, or its signature does not match, where a key is configured."""


def canonical_bytes(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def new_key_file(path: str) -> str:
    """Create a fresh 32-byte key as hex in ``path`` (mode 0600); refuses to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def load_key(path: str | None = None, *, log=None) -> bytes | None:
    """The shared key from ``path``, else from the file named by ``$NEMO_DCR_KEY_FILE``;
    ``None`` (with one warning on ``log``) when neither is set.  The file holds the key as
    hex (at least 16 bytes).  A path that is set but unreadable or malformed is an error,
    never a silent fall-back to unsigned."""
    path = path or os.environ.get(KEY_ENV) or None
    if path is None:
        if log is not None:
            log("nemo_dcr: no signing key configured (refit.key_file / $NEMO_DCR_KEY_FILE): "
                "protocol documents are not authenticated; integrity against accidents only")
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as e:
        raise SignatureError(f"signing key {path!r}: {e.strerror or e}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SignatureError(f"signing key {path!r}: not a hex string") from None
    if len(key) < MIN_KEY_BYTES:
        raise SignatureError(f"signing key {path!r}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed")
    return key


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Sealer:
    """Seals and opens documents of one run with one key (or none)."""

    def __init__(self, key: bytes | None):
        self.key = key

    @property
    def signed(self) -> bool:
        return self.key is not None

    def _mac(self, kind: str, body: bytes) -> str:
        assert self.key is not None
        return _PREFIX + hmac.new(self.key, b"nemo-dcr/" + kind.encode() + b"\0" + body, hashlib.sha256).hexdigest()

    def seal(self, kind: str, doc: dict) -> bytes:
        if "signature" in doc:
            raise ValueError("document already carries a signature field")
        sig = self._mac(kind, canonical_bytes(doc)) if self.key is not None else UNSIGNED
        return json.dumps({**doc, "signature": sig}, indent=1, sort_keys=True).encode()

    def open(self, kind: str, data: bytes, what: str) -> dict:
        """Parse ``data`` (a JSON object of at most 64 MiB) and check its signature; returns
        the document without the ``signature`` field.  Raises ``FormatError`` for bytes that
        are not such a document and ``SignatureError`` for a bad or missing signature."""
        if len(data) > MAX_DOC_BYTES:
            raise FormatError(f"{what}: {len(data)} bytes exceeds {MAX_DOC_BYTES}")
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{what}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise FormatError(f"{what}: top level must be an object")
        sig = obj.pop("signature", None)
        if not isinstance(sig, str):
            raise SignatureError(f"{what}: no signature field")
        if self.key is None:
            return obj
        if sig == UNSIGNED:
            raise SignatureError(f"{what}: unsigned, but this side has a signing key")
        if not hmac.compare_digest(sig, self._mac(kind, canonical_bytes(obj))):
            raise SignatureError(f"{what}: bad signature (written without the run's key, or altered)")
        return obj
