"""``nemo-dcr relay``: one node of the relay tree (``docs/relay.md``, HTTP API v1).

Modules: ``config.py`` (:class:`RelayConfig`, the API's bounds, which keys are immutable),
``cache.py`` (what it holds and its memory / spool accounting), ``node.py`` (:class:`Relay`:
single-flight and cut-through fetching, the run check, stats), ``stats.py`` (typed counters),
``http.py`` (routes and handlers), ``thread.py`` (:class:`RelayThread`), ``cli.py``.

A relay serves the read side of ONE run's store to its children (receivers or other
relays) over HTTP, and reads each object from its own upstream (an ``ObjectStore``: the
origin directory or ``s3://`` prefix, another relay, or an ordered list of these, a
``FailoverStore``) at most once while it holds it.  It holds no key and checks nothing a
key would be needed for: children verify every byte against the signed manifest.

What it keeps (the caching rules of ``docs/relay.md``):

* **immutable keys** (``v/<n>/chunks/*``, ``v/<n>/MANIFEST.json``, ``v/<n>/DECISION.json``,
  ``init/*``, ``RUN.json``): cached once fetched, in memory and, with ``--spool``, written
  through to the spool directory, so that leaving memory costs nothing; least recently
  used first out of memory (and of the spool when it is full);
* **mutable keys** (``HEAD.json``, ``COMMITTED.json``, anything else), every "not found",
  every ``stat`` and every ``list``: kept only for the coalescing window, so children
  polling at once share one upstream request;
* **single flight**: concurrent requests for one key wait on one upstream call;
* **cut-through**: every chunk key (``v/<n>/chunks/*``) a ``list`` reveals is fetched at
  once, ``prefetch`` at a time, before any child asks for it (a child asking for one still
  queued starts it at once); a prefetch neither waits for memory nor evicts an object no
  child has read, so it stops at the caps instead of fetching twice;
* **bounds**: memory (objects held plus fetches in flight, each reserved at the size the
  upstream's ``stat`` gave before its body is read), spool bytes, and versions
  (``keep_versions``: more versions than that and the oldest ``v/<n>/`` is dropped).  A
  request that cannot be admitted under the memory cap is answered ``503``.

A slow child is served from the one shared copy in pieces through aiohttp's flow control
(``await response.write`` waits while the socket's buffers are full), so it costs the
relay a socket buffer, not a copy; a child that reads nothing for ``send_timeout_s`` is
disconnected, which unpins what it held.

Concurrency: one asyncio loop owns every table and counter below (no locks); blocking
upstream calls run in a bounded thread pool (``fetch_threads``).
"""
from nemo_dcr.transport.relay.cli import byte_count, check_input, main, parse_listen, parser
from nemo_dcr.protocol.keys import ACK_PREFIX, RUN_KEY, is_immutable, key_version
from nemo_dcr.transport.relay.config import API, MAX_LIST_KEYS, MAX_PUT_BYTES, PROG, RelayConfig
from nemo_dcr.transport.relay.node import Relay
from nemo_dcr.transport.relay.stats import RelayCounters
from nemo_dcr.transport.relay.thread import RelayThread

__all__ = [
    "ACK_PREFIX", "API", "MAX_LIST_KEYS", "MAX_PUT_BYTES", "PROG", "RUN_KEY", "Relay", "RelayConfig", "RelayCounters",
    "RelayThread", "byte_count", "check_input", "is_immutable", "key_version", "main", "parse_listen", "parser",
]
