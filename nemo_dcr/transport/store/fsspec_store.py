"""Any fsspec file system as a store (``s3://``, ``gs://``, ``memory://``, ...)."""
from __future__ import annotations

import time
from typing import Any, Callable

from nemo_dcr.errors import ValidationError
from nemo_dcr.transport.store.base import ObjectInfo, ObjectTooLarge, StoreError, check_key, check_limit, stat_then_put
from nemo_dcr.transport.store.policy import Attempt, BoundedStore, StorePolicy, http_status, in_watched_thread, one_line

_S3_PROTOCOLS = ("s3", "s3a")


class FsspecStore(BoundedStore):
    """Any fsspec file system (``s3://bucket/prefix``, ``memory://x``, ...).

    ``storage_options`` are passed to fsspec as given (e.g. ``endpoint_url`` for an
    S3-compatible server); nothing is read from the environment here.  For S3 the store
    adds, unless given: botocore ``connect_timeout`` / ``read_timeout`` = the policy's
    ``timeout_s`` and no botocore retries (``config_kwargs``), no s3fs retries, no
    listings cache (a cached listing would hide a manifest published after it), and its
    own client (``skip_instance_cache``), since these settings are per store.
    """

    def __init__(self, uri: str, *, policy: StorePolicy | None = None, **storage_options):
        import fsspec

        self._init_policy(policy)
        self.uri = uri
        protocol = uri.split("://", 1)[0].lower()
        self._socket_timeouts = protocol in _S3_PROTOCOLS
        if self._socket_timeouts:
            storage_options = _s3_options(storage_options, self.policy)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(uri, **storage_options)
        except Exception as e:  # noqa: BLE001 - unknown protocol, missing package, bad option
            raise StoreError(f"{uri}: cannot open store: {one_line(e)}", uri=uri, op="open") from None
        if self._socket_timeouts:
            self.fs.retries = 1  # s3fs's own retry loop: one attempt, ours decide
        self.root = self.root.rstrip("/")
        self._async = bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _fs_call(self, name: str, att: Attempt, *args, watchdog: bool = True, **kwargs) -> Any:
        """``fs.<name>(*args, **kwargs)`` for one attempt.  On an async file system the
        coroutine runs on fsspec's loop under ``sync(timeout=...)``, which cancels it at the
        deadline; ``watchdog=False`` leaves the bound to the client's socket timeouts."""
        t0 = time.monotonic()
        try:
            if not self._async:
                return getattr(self.fs, name)(*args, **kwargs)
            from fsspec.asyn import sync
            from fsspec.exceptions import FSTimeoutError

            try:
                return sync(self.fs.loop, getattr(self.fs, "_" + name), *args,
                            timeout=att.budget_s if watchdog else None, **kwargs)
            except FSTimeoutError:
                raise att.timed_out() from None
        finally:
            self.meter.request(name, time.monotonic() - t0)

    def _run_attempt(self, op: str, fn: Callable[[Attempt], Any], att: Attempt) -> Any:
        return fn(att) if self._async else in_watched_thread(fn, att)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call("put", key, lambda att: self._fs_call("pipe_file", att, path, data), nbytes=len(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """S3: one ``PutObject`` with ``If-None-Match: *`` (a 412 -> False).  Other fsspec
        file systems offer no conditional create: ``stat``, then ``put`` when absent
        (atomic only within one process; the caller's read-back catches a race)."""
        path = self._path(key)
        if not self._socket_timeouts:
            return stat_then_put(self, key, data)

        def attempt(att: Attempt) -> bool:
            try:
                self._fs_call("pipe_file", att, path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:  # a 412 that s3fs did not map (no Condition in the answer)
                if http_status(e) == 412:
                    return False
                raise
            return True

        return self._call("put", key, attempt, nbytes=len(data))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """With ``max_bytes``: one ranged read of at most ``max_bytes + 1`` bytes (S3: one
        ``GET`` with ``Range``, no ``HEAD`` first); more than ``max_bytes`` came back ->
        ``ObjectTooLarge`` (the size named is what was read, not the object's)."""
        path = self._path(key)
        if max_bytes is None:
            return self._call("get", key, lambda att: self._fs_call(
                "cat_file", att, path, watchdog=not self._socket_timeouts))
        if max_bytes < 0:
            raise ValidationError(f"max_bytes must be >= 0, got {max_bytes}")

        def attempt(att: Attempt) -> bytes:
            att.add_bytes(max_bytes)
            try:
                data = self._fs_call("cat_file", att, path, start=0, end=max_bytes + 1,
                                     watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                raise
            except OSError as e:  # S3 answers a range on an empty object with 416
                if http_status(e) == 416 or "range is not satisfiable" in str(e):
                    return b""
                raise
            if len(data) > max_bytes:
                raise ObjectTooLarge(self.uri, key, len(data), max_bytes, at_least=True)
            return data

        return self._call("get", key, attempt)

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """``info`` (S3: HEAD) first, then the body: with ``max_bytes`` a ranged read of at
        most ``max_bytes + 1`` bytes, so an object that grew in between is caught too.
        Race: a put between the two calls gives the new bytes with the old version's
        info.  The info is thus never newer than the bytes, and a reader that re-reads
        when ``stat`` shows another tag reads once too often at worst, never misses a
        version."""
        path = self._path(key)

        def attempt(att: Attempt) -> tuple[bytes, ObjectInfo]:
            info = self._fs_call("info", att, path, watchdog=not self._socket_timeouts)
            if info.get("type") != "file":
                raise FileNotFoundError(path)
            size = int(info["size"])
            if max_bytes is not None and size > max_bytes:
                raise ObjectTooLarge(self.uri, key, size, max_bytes)
            if size == 0:  # that version's bytes; S3 answers a range on an empty object with 416
                return b"", ObjectInfo(key, 0, _fsspec_tag(info))
            att.add_bytes(size)
            ranged = {} if max_bytes is None else {"start": 0, "end": max_bytes + 1}
            data = self._fs_call("cat_file", att, path, watchdog=not self._socket_timeouts, **ranged)
            if max_bytes is not None and len(data) > max_bytes:
                raise ObjectTooLarge(self.uri, key, len(data), max_bytes, grew=True)
            return data, ObjectInfo(key, size, _fsspec_tag(info))

        return self._call("get", key, attempt)

    def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)

        def attempt(att: Attempt) -> ObjectInfo | None:
            try:
                info = self._fs_call("info", att, path, watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                return None
            return ObjectInfo(key, int(info["size"]), _fsspec_tag(info)) if info.get("type") == "file" else None

        return self._call("stat", key, attempt)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._call("exists", key, lambda att: self._fs_call(
            "exists", att, path, watchdog=not self._socket_timeouts))

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """With ``limit`` on S3 (s3fs): one bounded listing in the store's key order (pages of
        at most ``2 x limit`` keys, stopped after ``limit``), not every key under ``prefix``.
        Other file systems list everything and keep the first ``limit``."""
        return [info.key for info in self.list_info(prefix, limit=limit)]

    def list_sizes(self, prefix: str, *, limit: int | None = None) -> list[tuple[str, int | None]]:
        return [(info.key, info.size) for info in self.list_info(prefix, limit=limit)]

    def list_info(self, prefix: str, *, limit: int | None = None) -> list[ObjectInfo]:
        """``list`` with each object's size and tag, from the same listing (S3: the
        ``ListObjectsV2`` entries' ``Size``, ``ETag`` and ``LastModified``): no ``HEAD`` per key."""
        limit = check_limit(limit)
        base = self._path(prefix.strip("/")) if prefix.strip("/") else self.root
        bounded = limit is not None and self._async and hasattr(self.fs, "_iterdir")

        def attempt(att: Attempt) -> list[dict]:
            try:
                if bounded:  # s3fs: a recursive listing (no delimiter) of at most `limit` keys
                    found = self._fs_call("lsdir", att, base, max_items=limit, delimiter="",
                                          watchdog=not self._socket_timeouts)
                    return [f for f in found if f.get("type") != "directory"]
                found = self._fs_call("find", att, base, detail=True, watchdog=not self._socket_timeouts)
                return [dict(f, name=name) for name, f in found.items() if f.get("type") != "directory"]
            except FileNotFoundError:
                return []

        found = self._call("list", prefix, attempt)
        n = len(self.root) + 1
        infos = sorted((ObjectInfo(f["name"][n:] if f["name"].startswith(self.root + "/") else f["name"],
                                   int(f.get("size") or 0), _fsspec_tag(dict(f, size=int(f.get("size") or 0))))
                        for f in found), key=lambda i: i.key)
        return infos if limit is None else infos[:limit]

    def delete(self, key: str) -> None:
        path = self._path(key)

        def attempt(att: Attempt) -> None:
            try:
                self._fs_call("rm_file", att, path, watchdog=not self._socket_timeouts)
            except FileNotFoundError:
                pass

        self._call("delete", key, attempt)


# What identifies a version in the ``info`` of the fsspec back ends (see ObjectInfo).
_VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "LastModified", "mtime", "updated", "created")


def _fsspec_tag(info: dict) -> str:
    return ";".join([f"{k}={info[k]}" for k in _VERSION_FIELDS if info.get(k) not in (None, "")]
                    + [f"size={info['size']}"])


def _s3_options(options: dict, policy: StorePolicy) -> dict:
    options = dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", policy.timeout_s)
    config.setdefault("read_timeout", policy.timeout_s)
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config
    options.setdefault("use_listings_cache", False)
    options.setdefault("skip_instance_cache", True)
    return options
