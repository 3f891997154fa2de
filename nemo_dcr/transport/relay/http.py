"""The relay's HTTP API v1 (``docs/relay.md``): routes, handlers and how errors map to statuses."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from nemo_dcr.errors import DcrError, ProtocolError, ValidationError
from nemo_dcr.transport.relay.cache import Entry, NotHeld, Overloaded
from nemo_dcr.protocol.keys import WRITABLE_THROUGH
from nemo_dcr.transport.relay.config import API, DRAIN_PUT_BYTES, MAX_LIST_KEYS, MAX_PUT_BYTES
from nemo_dcr.transport.store.base import ObjectNotFound, ObjectTooLarge, check_key, check_limit
from nemo_dcr.transport.store.policy import one_line

if TYPE_CHECKING:
    from nemo_dcr.transport.relay.node import Relay


def make_app(relay: Relay):
    """The aiohttp application of ``relay``: ``docs/relay.md``'s HTTP API v1."""
    from aiohttp import web

    h = RelayHTTP(relay)
    app = web.Application(client_max_size=MAX_PUT_BYTES)
    r = app.router
    r.add_route("GET", f"{API}/object/{{key:.*}}", h._h_get)
    r.add_route("HEAD", f"{API}/object/{{key:.*}}", h._h_head)
    r.add_route("PUT", f"{API}/object/{{key:.*}}", h._h_put)
    r.add_route("DELETE", f"{API}/object/{{key:.*}}", h._h_delete)
    r.add_route("GET", f"{API}/list", h._h_list)
    r.add_route("GET", f"{API}/stats", h._h_stats)
    r.add_route("GET", f"{API}/health", h._h_health)
    return app


class RelayHTTP:
    """The request handlers: each maps a child's request onto the relay and its answer
    (object, status or one-line text) onto HTTP."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self._puts = (0.0, 0.0)  # token bucket of writes through: (tokens, loop time)

    async def _h_get(self, request):
        from aiohttp import web

        self.relay.counters.requests += 1
        try:
            key = self._key(request)
            max_bytes = _max_bytes(request)
            e = await self.relay.acquire(key)
        except _Answer as a:
            return a.response(self.relay)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self.relay, exc)
        try:
            headers = {"X-Dcr-Tag": e.tag, "X-Dcr-Size": str(e.size)}
            if max_bytes is not None and e.size > max_bytes:
                self.relay.counters.too_large += 1
                return web.Response(status=413, headers=headers,
                                    text=f"{key!r} is {e.size} bytes, over the limit of {max_bytes}\n")
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_length = e.size
            resp.content_type = "application/octet-stream"
            try:
                await self._send(request, resp, e)
            except (ConnectionError, asyncio.CancelledError):
                pass  # the child went away (or was cut off): nothing more to say to it
            return resp
        finally:
            self.relay.cache.unpin(e)

    async def _send(self, request, resp, e: Entry) -> None:
        """The object's bytes in pieces from the shared copy (memory or spool); each
        write waits while the child's socket is full (aiohttp drains)."""
        await resp.prepare(request)
        slot = id(resp)
        self.relay.sending[slot] = state = [e.key, e.size, 0]
        step = self.relay.cfg.piece_bytes
        try:
            if e.data is not None:
                view = memoryview(e.data)
                for i in range(0, e.size, step):
                    await self._write(request, resp, view[i:i + step])
                    state[2] += min(step, e.size - i)
                    self.relay.counters.served_bytes += min(step, e.size - i)
            else:
                with open(e.path, "rb") as fh:
                    sent = 0
                    while sent < e.size:
                        piece = await asyncio.get_running_loop().run_in_executor(self.relay.cache.disk, fh.read, min(step, e.size - sent))
                        if not piece:
                            raise OSError(f"spool file of {e.key!r} ended at {sent} of {e.size} bytes")
                        await self._write(request, resp, piece)
                        sent += len(piece)
                        state[2] = sent
                        self.relay.counters.served_bytes += len(piece)
            await resp.write_eof()
            self.relay.counters.served_objects += 1
        finally:
            del self.relay.sending[slot]

    async def _write(self, request, resp, piece) -> None:
        try:
            await asyncio.wait_for(resp.write(piece), self.relay.cfg.send_timeout_s)
        except asyncio.TimeoutError:
            self.relay.counters.send_timeouts += 1
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(f"child took no bytes for {self.relay.cfg.send_timeout_s} s") from None

    async def _h_head(self, request):
        from aiohttp import web

        self.relay.counters.requests += 1
        try:
            key = self._key(request)
            info = await self.relay.stat(key)
        except _Answer as a:
            return a.response(self.relay)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self.relay, exc)
        if info is None:
            self.relay.counters.not_found += 1
            return web.Response(status=404)
        return web.Response(status=200, headers={"X-Dcr-Size": str(info.size), "X-Dcr-Tag": info.tag})

    async def _h_list(self, request):
        from aiohttp import web

        self.relay.counters.requests += 1
        prefix = request.query.get("prefix", "").strip("/")
        try:
            if prefix:
                _check(prefix)
            limit = _list_limit(request.query.get("limit"))
            listed = await self.relay.list(prefix, limit)
        except _Answer as a:
            return a.response(self.relay)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self.relay, exc)
        if len(listed) > MAX_LIST_KEYS:
            self.relay.counters.lists_too_long += 1
            return _text(413, f"{prefix!r}: {len(listed)} keys, over {MAX_LIST_KEYS} (ask with a limit)",
                         {"X-Dcr-Limit": str(MAX_LIST_KEYS)})
        return web.json_response({"keys": [k for k, _ in listed], "sizes": [n for _, n in listed]})

    async def _h_put(self, request):
        from aiohttp import web

        self.relay.counters.requests += 1
        try:
            key = self._key(request)
        except _Answer as a:
            return a.response(self.relay)
        if not WRITABLE_THROUGH.match(key):
            return _text(403, f"{key!r}: a relay writes through only acks (acks/<receiver>/<v:08d>.json) and "
                              "join requests (acks/join.d/<receiver>.json)")
        if not self._put_allowed():
            self.relay.counters.puts_throttled += 1
            return _text(429, f"{key!r}: over {self.relay.cfg.put_rate:g} writes through per second; write to the "
                              "next upstream")
        too_big = _text(413, f"{key!r}: over {MAX_PUT_BYTES} bytes", {"X-Dcr-Limit": str(MAX_PUT_BYTES)})
        if request.content_length is not None and request.content_length > MAX_PUT_BYTES:
            if request.content_length <= DRAIN_PUT_BYTES:
                await request.content.read()  # let the client finish sending and read the answer
            self.relay.counters.too_large += 1
            return too_big
        body = bytearray()
        while len(body) <= MAX_PUT_BYTES:
            piece = await request.content.read(MAX_PUT_BYTES + 1 - len(body))
            if not piece:
                break
            body += piece
        if len(body) > MAX_PUT_BYTES:
            self.relay.counters.too_large += 1
            return too_big
        try:
            await self.relay.put(key, bytes(body))
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return _error_response(self.relay, exc)
        return web.Response(status=204)

    def _put_allowed(self) -> bool:
        """The token bucket of writes through (``put_rate``, burst ``4 * put_rate``)."""
        now = asyncio.get_running_loop().time()
        tokens, then = self._puts
        burst = 4 * self.relay.cfg.put_rate
        tokens = burst if then == 0.0 else min(burst, tokens + (now - then) * self.relay.cfg.put_rate)
        if tokens < 1:
            self._puts = (tokens, now)
            return False
        self._puts = (tokens - 1, now)
        return True

    async def _h_delete(self, request):
        self.relay.counters.requests += 1
        return _text(403, "a relay never deletes")

    async def _h_stats(self, request):
        from aiohttp import web

        return web.json_response(self.relay.stats())

    async def _h_health(self, request):
        return _text(200, "ok")

    def _key(self, request) -> str:
        """The key exactly as sent: the raw path, neither percent-decoded nor
        dot-segment-normalized (``a/./b`` is refused, not read as ``a/b``)."""
        raw = request.raw_path.split("?", 1)[0]
        prefix = f"{API}/object/"
        return _check(raw[len(prefix):] if raw.startswith(prefix) else "")


class _Answer(ProtocolError):
    """An HTTP answer other than the object (a status and its one-line text)."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status

    def response(self, relay: Relay):
        if self.status == 400:
            relay.counters.bad_requests += 1
        return _text(self.status, str(self))


def _check(key: str) -> str:
    try:
        return check_key(key)
    except ValidationError as e:
        raise _Answer(400, str(e)) from None


def _max_bytes(request) -> int | None:
    raw = request.query.get("max_bytes")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 20:
        raise _Answer(400, f"max_bytes must be an integer >= 0, got {raw[:40]!r}")
    return int(raw)


def _list_limit(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return check_limit(int(raw) if raw.isdigit() and len(raw) <= 8 else raw)
    except ValidationError as e:
        raise _Answer(400, str(e)) from None


def _text(status: int, text: str, headers: dict | None = None):
    from aiohttp import web

    return web.Response(status=status, text=" ".join(text.split()) + "\n", headers=headers)


def _error_response(relay: Relay, exc: BaseException):
    if isinstance(exc, NotHeld):
        relay.counters.not_found += 1
        return _text(404, f"{exc.args[0]!r}: no such object")
    if isinstance(exc, Overloaded):
        return _text(503, str(exc))
    if isinstance(exc, ObjectNotFound):
        relay.counters.not_found += 1
        return _text(404, str(exc))
    if isinstance(exc, ObjectTooLarge):
        relay.counters.too_large += 1
        return _text(413, str(exc), {"X-Dcr-Size": str(exc.size)})
    if isinstance(exc, ValidationError):
        relay.counters.bad_requests += 1
        return _text(400, str(exc))
    if isinstance(exc, (DcrError, OSError)):
        relay._log({"relay": "upstream_failed", "error": one_line(exc)})
        return _text(502, f"upstream failed: {one_line(exc)}")
    raise exc
