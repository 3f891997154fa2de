"""Object storage behind one small protocol, addressed by ``str`` URIs.

A store holds immutable objects under relative ``/``-separated keys.  ``put`` is atomic:
a reader sees either nothing or the whole object (local directories write a temporary
file and rename it; object stores give this for free).  This is what lets a receiver
treat "the manifest exists" as "the version is published".

``open_store(uri)``: a plain path or ``file://`` URI is the embedded default
(``LocalDirStore``); any other scheme (``s3://``, ``memory://``, ...) goes through fsspec.
URIs stay strings: ``pathlib.Path`` would mangle ``s3://bucket``.
"""
from __future__ import annotations

import os
import re
import tempfile
from typing import Protocol, runtime_checkable

from nemo_dcr.errors import TransportError

_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


class StoreError(TransportError):
    pass


class ObjectNotFound(StoreError, KeyError):
    pass


def check_key(key: str) -> str:
    if not _KEY.match(key) or any(part in {".", ".."} for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}")
    return key


@runtime_checkable
class ObjectStore(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None:
        """Atomically create or replace ``key``."""

    def get(self, key: str) -> bytes:
        """Whole object; ``ObjectNotFound`` if absent."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a key prefix ending at a ``/`` boundary), sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""


class LocalDirStore:
    """The embedded default: a directory on a local or shared file system."""

    def __init__(self, root: str):
        self.uri = root
        self.root = os.path.abspath(root.removeprefix("file://"))
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str) -> list[str]:
        base = os.path.join(self.root, *check_key(prefix.rstrip("/")).split("/")) if prefix.strip("/") else self.root
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if f.startswith(".tmp-"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), self.root)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass


class FsspecStore:
    """Any fsspec file system (``s3://bucket/prefix``, ``memory://x``, ...).

    ``storage_options`` are passed to fsspec as given (e.g. ``endpoint_url`` for an
    S3-compatible server); nothing is read from the environment here.
    """

    def __init__(self, uri: str, **storage_options):
        import fsspec

        self.uri = uri
        self.fs, self.root = fsspec.core.url_to_fs(uri, **storage_options)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(p[n:] if p.startswith(self.root + "/") else p for p in found)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass


def open_store(uri: str, **storage_options) -> ObjectStore:
    if "://" not in uri or uri.startswith("file://"):
        if storage_options:
            raise ValueError("storage_options apply to fsspec URIs only")
        return LocalDirStore(uri)
    return FsspecStore(uri, **storage_options)
