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

import errno
import hashlib
import hmac
import json
import os
import secrets
import shlex
import stat
import sys

from nemo_dcr.errors import FormatError, ProtocolError, ValidationError
from nemo_dcr.protocol.jsondoc import parse_document

KEY_ENV = "NEMO_DCR_KEY_FILE"
"""Environment variable naming the key file when no path is configured."""
MIN_KEY_BYTES = 16
MAX_DOC_BYTES = 64 << 20
_MAX_KEY_FILE_CHARS = 4096
_PREFIX = "hmac-sha256:"
UNSIGNED = "none"


class SignatureError(ProtocolError):
    """A document is unsigned, or its signature does not match, where a key is configured."""


def canonical_bytes(doc: dict) -> bytes:
    # allow_nan=False: a NaN would seal into a document every reader refuses (jsondoc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def new_key_file(path: str) -> str:
    """Create a fresh 32-byte key as hex in ``path`` (mode 0600); refuses to overwrite, and
    says so when the folder it would go in does not exist (``FileNotFoundError``)."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise NotADirectoryError(errno.ENOTDIR, f"{folder} is not a folder", path)
        raise FileNotFoundError(errno.ENOENT, f"the folder {folder} does not exist (create it first)", path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def load_key(path: str | None = None, *, log=None) -> bytes | None:
    """The shared key from ``path``, else from the file named by ``$NEMO_DCR_KEY_FILE``;
    ``None`` (with one warning on ``log``) when neither is set.  The file holds the key as
    hex (at least 16 bytes) and must be private to its owner (no group or other
    permission bits, as ssh demands of its keys).  A path that is set but unreadable,
    malformed or too open is an error, never a silent fall-back to unsigned."""
    path = path or os.environ.get(KEY_ENV) or None
    if path is None:
        if log is not None:
            log("nemo_dcr: no signing key configured (refit.key_file / $NEMO_DCR_KEY_FILE): "
                "protocol documents are not authenticated; integrity against accidents only")
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SignatureError(f"signing key {path!r}: {e.strerror or e}") from None
    with os.fdopen(fd) as f:
        mode = os.fstat(fd).st_mode  # the file that is read, not whatever the path names later
        if mode & 0o077:
            raise SignatureError(f"signing key {path!r}: permissions {stat.S_IMODE(mode):04o} are too open "
                                 f"({_who(mode)}); run: chmod 600 {shlex.quote(path)}")
        try:
            text = f.read(_MAX_KEY_FILE_CHARS + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise SignatureError(f"signing key {path!r}: {getattr(e, 'strerror', None) or e}") from None
    if len(text) > _MAX_KEY_FILE_CHARS:
        raise SignatureError(f"signing key {path!r}: more than {_MAX_KEY_FILE_CHARS} characters")
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SignatureError(f"signing key {path!r}: not a hex string") from None
    if len(key) < MIN_KEY_BYTES:
        raise SignatureError(f"signing key {path!r}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed")
    return key


def _who(mode: int) -> str:
    """``readable by group and others``, ``writable by group``, ...: who may do what."""
    parts = []
    for verb, bit in (("readable", 4), ("writable", 2), ("executable", 1)):
        who = [name for name, shift in (("group", 3), ("others", 0)) if mode & (bit << shift)]
        if who:
            parts.append(f"{verb} by {' and '.join(who)}")
    return ", ".join(parts)


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
            raise ValidationError("document already carries a signature field")
        sig = self._mac(kind, canonical_bytes(doc)) if self.key is not None else UNSIGNED
        return json.dumps({**doc, "signature": sig}, indent=1, sort_keys=True, allow_nan=False).encode()

    def open(self, kind: str, data: bytes, what: str, *, max_bytes: int = MAX_DOC_BYTES) -> dict:
        """Parse ``data`` (a JSON object of at most ``max_bytes``, see
        :func:`~nemo_dcr.protocol.jsondoc.parse_document`) and check its signature; returns
        the document without the ``signature`` field.  Raises ``FormatError`` for bytes that
        are not such a document and ``SignatureError`` for a bad or missing signature."""
        obj = parse_document(data, what, max_bytes=max_bytes)
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


def signature_of(data: bytes) -> str | None:
    """The ``signature`` field of a sealed document, unchecked (None if it does not parse):
    a side without a key uses it to notice that a run IS signed."""
    try:
        obj = parse_document(data, "document", max_bytes=MAX_DOC_BYTES)
    except FormatError:
        return None
    sig = obj.get("signature")
    return sig if isinstance(sig, str) else None
