"""The store's key layout: every key a run writes, what it names, and which keys never change.

Store layout (all keys relative to the store URI)::

    RUN.json                                   the run that owns this prefix (written first)
    init/config.json, init/model.safetensors   version 0: the initial canonical checkpoint
    init/INIT.json                             version 0's file digests (written after them)
    v/00000003/chunks/r001-00000.dcr           chunk payloads of version 3 (rank 1, seq 0)
    v/00000003/MANIFEST.json                   written after every chunk: publishes v3
    v/00000003/dense.safetensors               optional dense reference (verification only)
    HEAD.json                                  the latest published version (after its manifest)
    acks/<receiver>/00000003.json              a receiver's ack (or refusal) of v3
    acks/join.d/<receiver>.json                a receiver's request to join (elastic membership)
    v/00000003/DECISION.json                   the trainer's decision on v3: commit or abort
    COMMITTED.json                             the latest committed version
    snapshots/v00000040/model.safetensors      committed v40's canonical state (refit.snapshot_every)
    snapshots/v00000040/SNAPSHOT.json          its file digests + v40's decision digest (written last)

The one owner of this layout: the documents (``manifest.py``), the relay (which keys it may
cache and which it writes through) and the stores (which keys are chunks) read it here.
"""
from __future__ import annotations

import re

from nemo_dcr.errors import ValidationError

RECEIVER_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
"""A receiver id: letters, digits, ``_`` and ``-``, at most 64 (it is a path component)."""
CHUNK_KEY = re.compile(r"^v/([0-9]{8})/chunks/r[0-9]{3,6}-[0-9]{5,9}\.dcr$")
"""A chunk key exactly as :func:`chunk_key` writes it (what a manifest may name)."""
CHUNK_MARK = "/chunks/"
"""What a chunk object's key contains (``v/<v>/chunks/r<rank>-<seq>.dcr``)."""
IMMUTABLE = re.compile(r"^(?:v/(?P<v>[0-9]+)/(?:chunks/[^/]+|MANIFEST\.json|DECISION\.json)|init/.+|RUN\.json)$")
"""Keys written once per run (a chunk, a manifest, a decision, version 0's files, the run
record): a cache may keep them.  Everything else (``HEAD.json``, ``COMMITTED.json``, acks,
join requests, snapshots, anything planted) may change or vanish."""
CHUNK_OBJECT = re.compile(r"^v/(?P<v>[0-9]+)/chunks/[^/]+$")
"""Any object under a version's ``chunks/`` (looser than :data:`CHUNK_KEY`: what a relay
prefetches from a listing; a child checks each against its manifest)."""
ACK_PREFIX = "acks/"
WRITABLE_THROUGH = re.compile(r"^acks/(?:[A-Za-z0-9_\-]{1,64}/[0-9]{8}\.json|join\.d/[A-Za-z0-9_\-]{1,64}\.json)$")
"""The keys a receiver writes and a relay forwards: an ack (:func:`ack_key`) or a join
request (:func:`join_key`)."""


def is_immutable(key: str) -> bool:
    return IMMUTABLE.match(key) is not None


def key_version(key: str) -> int | None:
    """The version an immutable key belongs to (None: none, or not immutable)."""
    m = IMMUTABLE.match(key)
    return int(m["v"]) if m and m["v"] is not None else None


def is_chunk_object(key: str) -> bool:
    return CHUNK_OBJECT.match(key) is not None


def is_receiver_id(rid: object) -> bool:
    return isinstance(rid, str) and RECEIVER_ID.match(rid) is not None


VERSION_DIGITS = 8
"""Width of the version number in every key (``v/00000042/``, ``acks/<rx>/00000042.json``,
``snapshots/v00000042/``): keys sort by version, and a version beyond ``MAX_VERSION``
has no key (refused at publish, ``check_version``)."""
MAX_VERSION = 10 ** VERSION_DIGITS - 1


def check_version(version: int) -> int:
    """``version`` if it fits a key (0..``MAX_VERSION``), else ``ValidationError``."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValidationError(f"version {version!r} does not fit the store's {VERSION_DIGITS}-digit version keys "
                              f"(0..{MAX_VERSION}): start a new run on a fresh prefix")
    return version


def version_prefix(version: int) -> str:
    return f"v/{check_version(version):08d}"


def manifest_key(version: int) -> str:
    return f"{version_prefix(version)}/MANIFEST.json"


def chunk_key(version: int, rank: int, seq: int) -> str:
    return f"{version_prefix(version)}/chunks/r{rank:03d}-{seq:05d}.dcr"


def dense_key(version: int) -> str:
    return f"{version_prefix(version)}/dense.safetensors"


def ack_key(receiver: str, version: int) -> str:
    return f"acks/{check_receiver_id(receiver)}/{check_version(version):08d}.json"


def ack_key_parts(key: str) -> tuple[str, int] | None:
    """``(receiver, version)`` of an ack's key exactly as ``ack_key`` writes it, else None
    (a join request's key, a stray object under ``acks/``)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "acks" or not is_receiver_id(parts[1]) or not parts[2].endswith(".json"):
        return None
    try:
        version = int(parts[2][:-5])
        return (parts[1], version) if ack_key(parts[1], version) == key else None
    except ValueError:  # not a number; a version check_version refuses (a ValidationError)
        return None


JOIN_PREFIX = "acks/join.d/"
"""Where join requests live: under ``acks/`` so that a relay writes them through like acks
(``transport/relay/`` writes through nothing else), in a directory whose name holds a
``.``, which no receiver id does, so it never collides with a receiver's acks."""
_JOIN_KEY = re.compile(r"^acks/join\.d/([A-Za-z0-9_\-]{1,64})\.json$")


def join_key(receiver: str) -> str:
    return f"{JOIN_PREFIX}{check_receiver_id(receiver)}.json"


def join_key_receiver(key: str) -> str | None:
    """The receiver id of a join request's key (as ``join_key`` writes it), else None."""
    m = _JOIN_KEY.match(key)
    return m.group(1) if m else None


def decision_key(version: int) -> str:
    return f"{version_prefix(version)}/DECISION.json"


COMMITTED_KEY = "COMMITTED.json"
HEAD_KEY = "HEAD.json"
RUN_KEY = "RUN.json"
INIT_PREFIX = "init"
INIT_RECORD_KEY = f"{INIT_PREFIX}/INIT.json"
SNAPSHOT_PREFIX = "snapshots/"
SNAPSHOT_RECORD = "SNAPSHOT.json"


def snapshot_key(version: int, name: str) -> str:
    """A file of the committed-version snapshot of ``version`` (``protocol/snapshot.py``)."""
    return f"{SNAPSHOT_PREFIX}v{check_version(version):08d}/{name}"


def check_receiver_id(rid: str) -> str:
    if not is_receiver_id(rid):
        raise ValidationError(f"invalid receiver id {str(rid)[:80]!r} (letters, digits, _ and -, at most 64)")
    return rid


_KINDS = (
    (re.compile(r"^v/[0-9]+/chunks(?:/|$)"), "chunk"),
    (re.compile(r"^v/[0-9]+/MANIFEST\.json$"), "manifest"),
    (re.compile(r"^v/[0-9]+/DECISION\.json$"), "decision"),
    (re.compile(r"^v/[0-9]+/dense\.safetensors$"), "dense"),
    (re.compile(r"^HEAD\.json$"), "head"),
    (re.compile(r"^COMMITTED\.json$"), "committed"),
    (re.compile(r"^acks/join\.d(?:/|$)"), "join"),
    (re.compile(r"^acks(?:/|$)"), "ack"),
    (re.compile(r"^RUN\.json$"), "run"),
    (re.compile(r"^init(?:/|$)"), "init"),
    (re.compile(r"^snapshots(?:/|$)"), "snapshot"),
)


def key_kind(key: str) -> str:
    """What a key (or a listed prefix) names in this layout, as one word: ``chunk``,
    ``manifest``, ``decision``, ``dense``, ``head``, ``committed``, ``ack``, ``join``,
    ``run``, ``init``, ``snapshot``; anything else is ``other`` (request accounting,
    ``transport/store/meter.py``)."""
    if CHUNK_MARK in key:  # what a chunk object's key contains (and a listed chunks/ prefix)
        return "chunk"
    key = key.strip("/")
    for pattern, kind in _KINDS:
        if pattern.match(key):
            return kind
    return "other"
