"""``open_store(uri)``: a URI to a store, through one table of schemes.

A transport is one module plus one row of :data:`SCHEMES` (a lazy ``module:Class``, so this
module imports no back end, and no back end imports it).  A plain path or ``file://`` is the
embedded default; a comma-separated list is an ordered upstream list that fails over
(``transport/failover.py``); a scheme with no row goes through fsspec.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from nemo_dcr.errors import ValidationError
from nemo_dcr.transport.store.base import ObjectStore
from nemo_dcr.transport.store.policy import HOP_POLICY, POLICY_FIELDS, StorePolicy


@dataclass(frozen=True)
class Scheme:
    """How a URI scheme opens: its store class (``module:Class``, imported on first use),
    and whether it takes fsspec storage options."""

    target: str
    storage_options: bool = False

    def load(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


SCHEMES: dict[str, Scheme] = {
    "": Scheme("nemo_dcr.transport.store.local:LocalDirStore"),
    "file": Scheme("nemo_dcr.transport.store.local:LocalDirStore"),
    "relay": Scheme("nemo_dcr.transport.relay_client:RelayStore"),
    "http": Scheme("nemo_dcr.transport.relay_client:RelayStore"),
    "https": Scheme("nemo_dcr.transport.relay_client:RelayStore"),
}
"""URI scheme -> store; any other scheme (``s3``, ``gs``, ``memory``, ...) is :data:`FSSPEC`."""
FSSPEC = Scheme("nemo_dcr.transport.store.fsspec_store:FsspecStore", storage_options=True)
FAILOVER = "nemo_dcr.transport.failover:FailoverStore"


def open_store(uri: str, *, policy: StorePolicy | None = None, create: bool = True, **options) -> ObjectStore:
    """Open ``uri``: a directory (the embedded default), ``relay://host:port`` /
    ``http(s)://host:port`` (a relay, ``transport/relay_client.py``), any other fsspec URI,
    or a comma-separated ordered list of these (a ``FailoverStore``: the node re-parents
    down the list, ``transport/failover.py``).  ``options`` named like :class:`StorePolicy`
    fields (``timeout_s``, ``retries``, ``backoff_s``, ``backoff_max_s``, ``min_bytes_per_s``)
    set the store's call policy (or pass ``policy=``); the rest are fsspec storage options.
    A URI that cannot be opened raises :class:`StoreError` naming it.  ``create=False``
    (readers): a local directory is not created (``LocalDirStore``); whether the store is
    there and usable is ``transport/preflight.check_store``."""
    given = {k: options.pop(k) for k in list(options) if k in POLICY_FIELDS}
    if given:
        if policy is not None:
            raise ValidationError(f"pass either policy= or {sorted(given)}, not both")
        policy = StorePolicy(**given)
    if "," in uri:  # an ordered upstream list: re-parenting (transport/failover.py)
        parts = [u.strip() for u in uri.split(",")]
        if any(not u for u in parts):
            raise ValidationError(f"empty entry in the upstream list {uri!r}")
        if len(set(parts)) != len(parts):
            raise ValidationError(f"upstream list {uri!r} names a store twice")
        retry_after_s = options.pop("retry_after_s", 30.0)
        # every member but the last has a next one to take over: unless a policy was given,
        # it gets HOP_POLICY (a stalled relay is left in ~10 s, not the default's ~158 s)
        hop = policy or HOP_POLICY
        failover = Scheme(FAILOVER).load()
        return failover([open_store(u, policy=hop if i < len(parts) - 1 else policy, create=create, **options)
                         for i, u in enumerate(parts)], retry_after_s=retry_after_s)
    name = uri.split("://", 1)[0].lower() if "://" in uri else ""
    scheme = SCHEMES.get(name, FSSPEC)
    if scheme.storage_options:
        return scheme.load()(uri, policy=policy, **options)
    if options:
        raise ValidationError(f"storage options {sorted(options)} apply to fsspec URIs only, not {uri!r}")
    if scheme.target == SCHEMES[""].target:
        return scheme.load()(uri, policy=policy, create=create)
    return scheme.load()(uri, policy=policy)
