"""A relay on its own event loop in a daemon thread (tests, benchmarks, one-process tools)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from nemo_dcr.transport.relay.config import RelayConfig
from nemo_dcr.transport.relay.node import Relay
from nemo_dcr.transport.store.base import ObjectStore


class RelayThread:
    """A relay on its own event loop in a daemon thread (tests, benchmarks, one-process
    tools): ``with RelayThread(store, cfg) as r: r.uri``."""

    def __init__(self, store: ObjectStore, config: RelayConfig | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[dict], None] | None = None, ssl_context=None):
        self.relay = Relay(store, config, log=log or (lambda e: None))
        self._host, self._port, self._ssl = host, port, ssl_context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nemo-dcr-relay", daemon=True)

    def start(self) -> "RelayThread":
        self._thread.start()
        host, port = asyncio.run_coroutine_threadsafe(self.relay.start(self._host, self._port, ssl_context=self._ssl),
                                                      self._loop).result(30)
        self.uri = f"{'https' if self._ssl else 'relay'}://{host}:{port}"
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the relay's loop (to read its state consistently)."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stats(self) -> dict:
        return self.call(self.relay.stats)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.relay.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> "RelayThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
