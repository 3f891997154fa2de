"""Object storage behind one small protocol, addressed by ``str`` URIs.

A store holds immutable objects under relative ``/``-separated keys.  ``put`` is atomic:
a reader sees either nothing or the whole object (local directories write a temporary
file and rename it; object stores give this for free).  This is what lets a receiver
treat "the manifest exists" as "the version is published".

``open_store(uri)`` (``open.py``, one table of schemes): a plain path or ``file://`` URI is
the embedded default (``local.py``: ``LocalDirStore``); ``relay://host:port`` and
``http(s)://`` are a relay of the relay tree (``transport/relay_client.py``); any other scheme
(``s3://``, ``memory://``, ...) goes through fsspec (``fsspec_store.py``); a comma-separated
list is an ordered upstream list that fails over (``transport/failover.py``).  URIs stay
strings: ``pathlib.Path`` would mangle ``s3://bucket``.  The protocol, its errors and the key
rules are ``base.py``; the bounded calls below are ``policy.py``.

Bounded calls
-------------
Every call (put / get / stat / exists / list / delete) is bounded by the store's
:class:`StorePolicy`: each attempt has a timeout, transient failures (connection
errors, timeouts, HTTP 5xx and throttling) are retried a bounded number of times with
exponential backoff and jitter, and anything else (not found, permission, validation)
is not retried.  A call that still fails raises :class:`StoreError` with ONE line that
names the store, the operation and the key::

    s3://b/run: get 'v/00000003/MANIFEST.json' failed after 5 attempts in 157.6 s:
    ReadTimeoutError: Read timeout on endpoint URL: "http://..."

What bounds an attempt, per back end (each was checked against a stopped server):

- S3 (s3fs): botocore's ``connect_timeout`` / ``read_timeout`` (= ``timeout_s``) bound
  every wait for a response, per socket read, so a download that keeps moving is never
  cut.  They do NOT bound an upload: aiohttp waits for ``100 Continue`` (and a blocked
  send) without a timeout, so a put also runs under a watchdog (fsspec's ``sync``
  timeout, which cancels the request) of ``timeout_s + len(data) / min_bytes_per_s``.
  botocore's and s3fs's own retries are switched off so that this policy is the only one.
- Local directories, and fsspec back ends without a loop: the attempt runs in a worker
  thread under the same watchdog (``timeout_s``, plus ``min_bytes_per_s`` for the bytes
  it moves once their size is known).  An abandoned local put never renames its
  temporary file into place.
- Other async fsspec back ends: the watchdog bounds the whole attempt at ``timeout_s``
  (plus the put allowance); set ``timeout_s`` above the longest download there.

A timed-out request may still complete on the server later; keys are written once per
version, so a late duplicate of a put carries the same bytes.

Bounded reads and versions
--------------------------
``get(key, max_bytes=N)`` learns the object's size before reading its body (local: the
opened descriptor's ``fstat``; fsspec: ``info``) and refuses an object over ``N`` with
:class:`ObjectTooLarge` without reading it; the read itself stops after ``N + 1`` bytes,
so an object that grows in between is refused too.  ``stat(key)`` gives an
:class:`ObjectInfo` whose ``tag`` changes whenever the object's bytes may have changed
(what each back end offers is listed at :class:`ObjectInfo`), and
``get_with_info`` returns the bytes with the tag of the version they were read from.

The local store follows no symbolic link below its root: a key whose path crosses one
is refused (:class:`SymlinkRefused`), so nothing planted in the directory can make a
put, get, stat, exists or list reach outside it.
"""
from nemo_dcr.protocol.keys import CHUNK_MARK
from nemo_dcr.transport.store.base import (
    MAX_LIST_LIMIT,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    StoreError,
    SymlinkRefused,
    check_key,
    check_limit,
    list_sizes,
    put_if_absent,
)
from nemo_dcr.transport.store.fsspec_store import FsspecStore
from nemo_dcr.transport.store.local import LocalDirStore
from nemo_dcr.transport.store.open import SCHEMES, open_store
from nemo_dcr.transport.store.policy import HOP_POLICY, POLICY_FIELDS, StorePolicy, is_transient

__all__ = [
    "CHUNK_MARK", "HOP_POLICY", "MAX_LIST_LIMIT", "POLICY_FIELDS", "SCHEMES", "FsspecStore", "LocalDirStore",
    "ObjectInfo", "ObjectNotFound", "ObjectStore", "ObjectTooLarge", "StoreError", "StorePolicy", "SymlinkRefused",
    "check_key", "check_limit", "is_transient", "list_sizes", "open_store", "put_if_absent",
]
