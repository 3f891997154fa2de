"""``RelayStore``: the ``ObjectStore`` a child of the relay tree reads through.

``relay://HOST:PORT`` and ``http://HOST:PORT`` speak plain HTTP to a relay
(``nemo-dcr relay``, ``transport/relay/``); ``https://HOST:PORT`` the same over TLS
(a terminating proxy in front of the relay).  The wire is the relay's HTTP API v1
(``docs/relay.md``).

Every call is bounded by the store's :class:`StorePolicy` like any other store: each
attempt has connect and read timeouts of ``timeout_s`` (urllib3, per socket wait) and runs
under the policy's watchdog (``timeout_s`` plus ``min_bytes_per_s`` for the bytes the
answer announced).  A ``get`` with ``max_bytes`` waits up to ``timeout_s + max_bytes /
min_bytes_per_s`` for each read, the first byte included: a relay answers once it holds
the whole object, which takes longer the bigger it is; urllib3's own retries are off, the policy retries.  How answers map:

* ``404``: not found (``get`` raises ``ObjectNotFound``; ``stat``/``exists`` give
  ``None``/``False``);
* ``413``: :class:`ObjectTooLarge` (the relay sends no body);
* ``5xx``, ``429``, refused/reset connections, timeouts, a body cut short: transient
  (retried);
* any other ``4xx``, and a TLS certificate that does not verify: permanent (``StoreError``
  at once).

A relay holds no key: whatever it serves is checked by the reader against the signed
manifest, exactly as bytes from the origin store are.
"""
from __future__ import annotations

import json
from typing import Any, Callable
from urllib.parse import quote, urlsplit

from nemo_dcr.errors import TransportError, ValidationError
from nemo_dcr.transport.store.base import ObjectInfo, ObjectTooLarge, check_key, check_limit
from nemo_dcr.transport.store.policy import Attempt, BoundedStore, StorePolicy

API = "/v1"
_PIECE = 4 << 20
MAX_LIST_BYTES = 32 << 20
"""Largest ``list`` answer read (a version's chunk keys are ~40 bytes each: 2^18 keys, the
relay's ``MAX_LIST_KEYS``, are ~12 MB of JSON)."""
MAX_LIST_KEYS = 1 << 18
"""Most keys a ``list`` answer may hold, counted in the raw bytes before it is parsed (a
64 MiB answer of short strings would otherwise cost the child over 1 GB to parse)."""


class RelayUnavailable(TransportError, ConnectionError):
    """The relay answered 5xx/429 or the connection failed mid-answer: worth another attempt
    (a ``ConnectionError``, which ``store.policy.is_transient`` retries)."""


class RelayRefused(TransportError):
    """The relay refused the request for good (a 4xx other than 404 and 413)."""


class RelayStore(BoundedStore):
    """An ``ObjectStore`` served by a relay at ``relay://``, ``http://`` or ``https://HOST:PORT``."""

    is_relay = True

    def __init__(self, uri: str, *, policy: StorePolicy | None = None):
        import urllib3

        self._init_policy(policy)
        parts = urlsplit(uri)
        scheme = parts.scheme.lower()
        if scheme not in ("relay", "http", "https") or not parts.hostname or parts.port is None:
            raise ValidationError(f"relay store URI must be relay://HOST:PORT, http://HOST:PORT or "
                                  f"https://HOST:PORT, got {uri!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValidationError(f"relay store URI takes no path, query or user: {uri!r}")
        self.uri = uri
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self.base = f"{'https' if scheme == 'https' else 'http'}://{host}:{parts.port}{API}"
        t = self.policy.timeout_s
        self._http = urllib3.PoolManager(num_pools=4, maxsize=32, block=False, retries=False,
                                         timeout=urllib3.Timeout(connect=t, read=t))

    # ------------------------------------------------------------------ one request
    def _request(self, method: str, path: str, *, fields: dict | None = None, body: bytes | None = None,
                 ok: tuple[int, ...] = (200,), read_s: float | None = None) -> Any:
        """The response (body not read yet) of one request whose status is in ``ok``; the
        status classes of the module docstring otherwise."""
        import urllib3

        url = f"{self.base}/{path}"
        if fields:
            url += "?" + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in fields.items())
        try:
            timeout = None if read_s is None else urllib3.Timeout(connect=self.policy.timeout_s, read=read_s)
            resp = self._http.request(method, url, body=body, preload_content=False, redirect=False,
                                      **({} if timeout is None else {"timeout": timeout}),
                                      headers={"Content-Type": "application/octet-stream"} if body is not None
                                      else None)
        except urllib3.exceptions.SSLError as e:  # an untrusted certificate: another attempt will not help
            raise RelayRefused(f"{method} {url}: {type(e).__name__}: {e}") from None
        except urllib3.exceptions.HTTPError as e:
            raise RelayUnavailable(f"{method} {url}: {type(e).__name__}: {e}") from e
        if resp.status in ok:
            return resp
        text = _error_text(resp)
        if resp.status == 404:
            raise FileNotFoundError(f"{path}: {text}")
        if resp.status >= 500 or resp.status == 429:
            raise RelayUnavailable(f"HTTP {resp.status}: {text}")
        if resp.status == 413:
            return resp  # the caller knows what was too large
        if resp.status == 403:
            raise PermissionError(f"HTTP 403: {text}")
        raise RelayRefused(f"HTTP {resp.status}: {text}")

    @staticmethod
    def _read(resp, att: Attempt, limit: int | None, *, counted: int = 0, stall_s: float | None = None) -> bytes:
        """The body, at most ``limit + 1`` bytes (so a body longer than announced is seen);
        ``counted``: bytes the watchdog already allows for.  ``stall_s``: once the answer
        has begun, a read that gets no byte for this long fails the attempt (the wait for
        the first byte may be long, a relay answers once it holds the whole object; a
        stall after it is not a slow link but a stalled relay)."""
        import urllib3

        pieces: list[bytes] = []
        got = 0
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if stall_s is not None and sock is not None:
            sock.settimeout(stall_s)  # urllib3 sets the next request's own timeout again
        try:
            length = _int_header(resp, "Content-Length")
            if length is not None and length > counted:
                att.add_bytes(length - counted)
            while True:
                want = _PIECE if limit is None else min(_PIECE, limit + 1 - got)
                if want <= 0:
                    break
                piece = resp.read(want)
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)  # one copy, no regrowth
        except urllib3.exceptions.HTTPError as e:
            resp.close()
            raise RelayUnavailable(f"reading the answer: {type(e).__name__}: {e}") from e
        finally:
            if limit is not None and got > limit:
                resp.close()  # the rest of an oversized body is not read: the connection goes
            resp.release_conn()

    # ------------------------------------------------------------------ ObjectStore
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        check_key(key)
        if max_bytes is not None and max_bytes < 0:
            raise ValidationError(f"max_bytes must be >= 0, got {max_bytes}")

        # a relay answers once it holds the whole object (cut-through per object), so the
        # wait for the first byte grows with the object: with a known bound, the read
        # timeout and the watchdog allow timeout_s + max_bytes / min_bytes_per_s, the
        # policy's rule for an attempt that moves that many bytes
        allowance = 0 if max_bytes is None else max_bytes
        read_s = self.policy.budget_s(allowance)

        def attempt(att: Attempt) -> tuple[bytes, ObjectInfo]:
            att.add_bytes(allowance)
            resp = self._request("GET", f"object/{key}", read_s=read_s,
                                 fields=None if max_bytes is None else {"max_bytes": max_bytes})
            if resp.status == 413:
                size = _int_header(resp, "X-Dcr-Size")
                resp.drain_conn()
                raise ObjectTooLarge(self.uri, key, size if size is not None else -1,
                                     max_bytes if max_bytes is not None else -1)
            data = self._read(resp, att, max_bytes, counted=allowance, stall_s=self.policy.timeout_s)
            if max_bytes is not None and len(data) > max_bytes:
                raise ObjectTooLarge(self.uri, key, len(data), max_bytes, grew=True)
            length = _int_header(resp, "Content-Length")
            if length is not None and len(data) != length:
                raise RelayUnavailable(f"body of {len(data)} bytes, Content-Length said {length}")
            return data, ObjectInfo(key, len(data), resp.headers.get("X-Dcr-Tag", ""))

        return self._call("get", key, attempt)

    def _head(self, key: str) -> Callable[[Attempt], ObjectInfo | None]:
        check_key(key)

        def attempt(att: Attempt) -> ObjectInfo | None:
            try:
                resp = self._request("HEAD", f"object/{key}")
            except FileNotFoundError:
                return None
            resp.drain_conn()
            size = _int_header(resp, "X-Dcr-Size")
            if size is None:
                raise RelayRefused("HEAD answer without X-Dcr-Size")
            return ObjectInfo(key, size, resp.headers.get("X-Dcr-Tag", ""))

        return attempt

    def stat(self, key: str) -> ObjectInfo | None:
        return self._call("stat", key, self._head(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self._head(key)) is not None

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        return [k for k, _ in self.list_sizes(prefix, limit=limit)]

    def list_sizes(self, prefix: str, *, limit: int | None = None) -> list[tuple[str, int | None]]:
        """The keys under ``prefix`` in key order, each with the size the relay's answer gives
        (``"sizes"``, beside ``"keys"``; None where the relay does not know it, or for every
        key of an answer without sizes).  A size bounds a later read of the key, nothing more."""
        p = prefix.strip("/")
        if p:
            check_key(p)
        fields = {"prefix": p} if check_limit(limit) is None else {"prefix": p, "limit": str(limit)}

        most = MAX_LIST_KEYS if limit is None else min(limit, MAX_LIST_KEYS)

        def attempt(att: Attempt) -> list[tuple[str, int | None]]:
            resp = self._request("GET", "list", fields=fields)
            if resp.status == 413:  # the relay's listing is over MAX_LIST_KEYS: an answer
                resp.drain_conn()
                raise ObjectTooLarge(self.uri, prefix or "/", -1, MAX_LIST_KEYS)
            data = self._read(resp, att, MAX_LIST_BYTES)
            if len(data) > MAX_LIST_BYTES:
                raise RelayRefused(f"list answer over {MAX_LIST_BYTES} bytes")
            if data.count(b'"') > 2 * most + 4:  # "keys", "sizes" and one pair per key, before parsing
                raise RelayRefused(f"list answer of over {most} keys")
            if data.count(b",") > 2 * most + 2:  # a key and a size per key, before parsing
                raise RelayRefused(f"list answer of over {most} keys")
            try:
                answer = json.loads(data)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise RelayUnavailable(f"unreadable list answer: {type(e).__name__}: {e}") from None
            if not isinstance(answer, dict) or "keys" not in answer:
                raise RelayUnavailable("unreadable list answer: no 'keys'")
            keys = answer["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise RelayRefused("list answer: 'keys' is not a list of strings")
            sizes = answer.get("sizes", [None] * len(keys))
            if not isinstance(sizes, list) or len(sizes) != len(keys) or not all(
                    n is None or (type(n) is int and 0 <= n < 1 << 63) for n in sizes):
                raise RelayRefused("list answer: 'sizes' is not one size (an integer >= 0, or null) per key")
            listed = sorted(zip(keys, sizes), key=lambda kv: kv[0])
            return listed if limit is None else listed[:limit]

        return self._call("list", prefix, attempt)

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        body = bytes(data)

        def attempt(att: Attempt) -> None:
            resp = self._request("PUT", f"object/{key}", body=body, ok=(200, 201, 204))
            if resp.status == 413:
                resp.drain_conn()
                raise ObjectTooLarge(self.uri, key, len(body), _int_header(resp, "X-Dcr-Limit") or -1)
            resp.drain_conn()

        self._call("put", key, attempt, nbytes=len(body))

    def delete(self, key: str) -> None:
        check_key(key)

        def attempt(att: Attempt) -> None:
            try:
                self._request("DELETE", f"object/{key}", ok=(200, 204)).drain_conn()
            except FileNotFoundError:
                pass

        self._call("delete", key, attempt)


def _int_header(resp, name: str) -> int | None:
    v = resp.headers.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:  # not a number: as if the header were not there
        return None


def _error_text(resp) -> str:
    try:
        text = resp.read(300).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the status says enough
        text = ""
    finally:
        resp.drain_conn()
    return " ".join(text.split()) or resp.reason or ""
