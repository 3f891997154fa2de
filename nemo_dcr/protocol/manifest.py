"""Per-version manifests, receiver acknowledgements and the commit record.

Store layout (all keys relative to the store URI)::

    init/config.json, init/model.safetensors   version 0: the initial canonical checkpoint
    v/00000003/chunks/r001-00000.dcr           chunk payloads of version 3 (rank 1, seq 0)
    v/00000003/MANIFEST.json                   written LAST, by trainer rank 0: publishes v3
    v/00000003/dense.safetensors               optional dense reference (verification only)
    acks/<receiver>/00000003.json              a receiver's ack (or refusal) of v3
    COMMITTED.json                             the trainer's committed version (joint commit)

A manifest says: applying these chunks to base version ``base_version`` gives version
``version``.  Every chunk is listed with its size and sha256; a receiver downloads and
checks all of them before it writes anything.  All JSON here is parsed by ``_strict``
helpers: wrong types, unknown fields and oversize documents are errors.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from nemo_dcr.errors import FormatError

FORMAT = "nemo-dcr-manifest"
FORMAT_VERSION = 1
MAX_JSON_BYTES = 64 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_RECEIVER = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


class ManifestError(FormatError):
    pass


def version_prefix(version: int) -> str:
    return f"v/{version:08d}"


def manifest_key(version: int) -> str:
    return f"{version_prefix(version)}/MANIFEST.json"


def chunk_key(version: int, rank: int, seq: int) -> str:
    return f"{version_prefix(version)}/chunks/r{rank:03d}-{seq:05d}.dcr"


def dense_key(version: int) -> str:
    return f"{version_prefix(version)}/dense.safetensors"


def ack_key(receiver: str, version: int) -> str:
    return f"acks/{check_receiver_id(receiver)}/{version:08d}.json"


COMMITTED_KEY = "COMMITTED.json"
INIT_PREFIX = "init"


def check_receiver_id(rid: str) -> str:
    if not _RECEIVER.match(rid):
        raise ValueError(f"invalid receiver id {rid!r} (letters, digits, _ and -, at most 64)")
    return rid


def _load(data: bytes, what: str) -> dict:
    if len(data) > MAX_JSON_BYTES:
        raise ManifestError(f"{what}: {len(data)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{what}: top level must be an object")
    return obj


def _take(obj: dict, spec: dict[str, type | tuple[type, ...]], what: str, optional: frozenset = frozenset()) -> dict:
    unknown = set(obj) - set(spec)
    if unknown:
        raise ManifestError(f"{what}: unknown fields {sorted(unknown)}")
    out = {}
    for k, typ in spec.items():
        if k not in obj:
            if k in optional:
                continue
            raise ManifestError(f"{what}: missing field {k!r}")
        v = obj[k]
        if isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
            raise ManifestError(f"{what}: field {k!r} has type bool")
        if not isinstance(v, typ):
            raise ManifestError(f"{what}: field {k!r} must be {typ}, got {type(v).__name__}")
        out[k] = v
    return out


@dataclass(frozen=True)
class ChunkRef:
    key: str
    nbytes: int
    digest: str
    rank: int
    tensors: int
    changed: int

    def __post_init__(self) -> None:
        if not _DIGEST.match(self.digest):
            raise ManifestError(f"chunk {self.key}: bad digest {self.digest!r}")
        if min(self.nbytes, self.rank, self.tensors, self.changed) < 0:
            raise ManifestError(f"chunk {self.key}: negative count")


@dataclass(frozen=True)
class Manifest:
    model_id: str
    version: int
    base_version: int
    chunks: tuple[ChunkRef, ...]
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.base_version < self.version:
            raise ManifestError(f"manifest: base_version {self.base_version} must be in [0, {self.version})")
        prefix = version_prefix(self.version) + "/chunks/"
        keys = [c.key for c in self.chunks]
        if len(set(keys)) != len(keys):
            raise ManifestError("manifest: duplicate chunk keys")
        for k in keys:
            if not k.startswith(prefix):
                raise ManifestError(f"manifest v{self.version}: chunk {k!r} outside {prefix}")

    @property
    def wire_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def to_json(self) -> bytes:
        d = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        d["chunks"] = [asdict(c) for c in self.chunks]
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        obj = _load(data, "manifest")
        top = _take(obj, {"format": str, "format_version": int, "model_id": str, "version": int,
                          "base_version": int, "chunks": list, "stats": dict}, "manifest")
        if top["format"] != FORMAT or top["format_version"] != FORMAT_VERSION:
            raise ManifestError(f"manifest: format {top['format']!r} v{top['format_version']} not supported")
        chunks = []
        for i, c in enumerate(top["chunks"]):
            if not isinstance(c, dict):
                raise ManifestError(f"manifest: chunk {i} is not an object")
            chunks.append(ChunkRef(**_take(c, {"key": str, "nbytes": int, "digest": str, "rank": int,
                                               "tensors": int, "changed": int}, f"manifest chunk {i}")))
        stats = {}
        for k, v in top["stats"].items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ManifestError(f"manifest: stat {k!r} is not a number")
            stats[k] = v
        return cls(model_id=top["model_id"], version=top["version"], base_version=top["base_version"],
                   chunks=tuple(chunks), stats=stats)


@dataclass(frozen=True)
class Ack:
    """A receiver's answer for one version: ``ok`` (it now holds ``version``) or a refusal."""

    receiver: str
    version: int
    ok: bool
    held_version: int
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Ack":
        obj = _take(_load(data, "ack"), {"receiver": str, "version": int, "ok": bool, "held_version": int,
                                         "error": str, "stats": dict}, "ack")
        return cls(**obj)


@dataclass(frozen=True)
class Committed:
    version: int
    receivers: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, "receivers": list(self.receivers)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Committed":
        obj = _take(_load(data, "commit record"), {"version": int, "receivers": list}, "commit record")
        return cls(version=obj["version"], receivers=tuple(str(r) for r in obj["receivers"]))
