"""The protocol's documents: run record, version-0 record, manifests, acks, decisions.

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

A manifest says: applying these chunks to base version ``base_version`` gives version
``version``.  Every chunk is listed with its size and sha256; a receiver downloads and
checks all of them before it writes anything.  Every document carries the run id and is
sealed (``protocol/signing.py``: HMAC-SHA256 with the run's key, ``"none"`` without one);
``from_json`` opens it with a ``Sealer`` and parses strictly: wrong types, unknown fields
and oversize documents are ``ManifestError``, bad signatures ``SignatureError``.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from nemo_dcr.errors import FormatError, ValidationError
from nemo_dcr.protocol.signing import Sealer

FORMAT = "nemo-dcr-manifest"
FORMAT_VERSION = 3
"""3: ``base_digest`` chains each manifest to its base's decision (2 had run identity and
signatures but no chain; 1 had neither; both refused)."""
MAX_JSON_BYTES = 64 << 20
DOC_LIMITS = {"run": 64 << 10, "init": 64 << 10, "head": 64 << 10, "ack": 1 << 20, "decision": 1 << 20,
              "committed": 1 << 20, "join": 64 << 10, "snapshot": 64 << 10, "manifest": MAX_JSON_BYTES}
"""Byte cap per document kind, known before an object is read (``get(max_bytes=...)``) and
checked again by the parser: what a key-less writer plants under a document's key can
cost a reader at most this much memory."""
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK_KEY = re.compile(r"^v/([0-9]{8})/chunks/r[0-9]{3,6}-[0-9]{5,9}\.dcr$")
_RECEIVER = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_RECEIVERS = 1024
"""Most members a decision names (elastic membership admits no more)."""
_UNSIGNED = Sealer(None)


class ManifestError(FormatError):
    pass


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
    if not _RECEIVER.match(rid):
        raise ValidationError(f"invalid receiver id {rid!r} (letters, digits, _ and -, at most 64)")
    return rid


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ManifestError(f"invalid run id {run_id!r} (32 lowercase hex digits)")
    return run_id


def doc_digest(data: bytes) -> str:
    """``sha256:<hex>`` of a document's bytes as stored (an ack names the manifest it applied)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str, what: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ManifestError(f"{what}: bad digest {digest!r} (sha256:<64 hex>)")
    return digest


def _load(data: bytes, what: str, kind: str, sealer: Sealer | None) -> dict:
    """Open a sealed document (signature checked when ``sealer`` has a key), parsed by the
    bounded parser under ``DOC_LIMITS[kind]``."""
    try:
        return (sealer or _UNSIGNED).open(kind, data, what, max_bytes=DOC_LIMITS[kind])
    except FormatError as e:
        raise ManifestError(str(e)) from None


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
        # the exact shape chunk_key() writes: no '..', no absolute path, nothing a store
        # back end could resolve outside the version's chunks/ prefix
        if not _CHUNK_KEY.match(self.key):
            raise ManifestError(f"chunk key {self.key[:120]!r} is not v/<version>/chunks/r<rank>-<seq>.dcr")
        if not _DIGEST.match(self.digest):
            raise ManifestError(f"chunk {self.key}: bad digest {self.digest!r}")
        if min(self.nbytes, self.rank, self.tensors, self.changed) < 0:
            raise ManifestError(f"chunk {self.key}: negative count")


@dataclass(frozen=True)
class Manifest:
    """Version ``version`` = these chunks applied to ``base_version``.  ``base_digest`` names
    the base: the digest of the base's commit ``DECISION.json`` (of ``init/INIT.json`` for
    version 0).  Each commit decision names its manifest's digest in turn, so the signed
    documents form one chain back to version 0, and a receiver applies a manifest only on
    top of the exact decision it settled on -- a replayed or deleted pointer file
    (``HEAD.json``, ``COMMITTED.json``) cannot move it to another branch."""

    KIND: ClassVar[str] = "manifest"

    run_id: str
    model_id: str
    version: int
    base_version: int
    base_digest: str
    chunks: tuple[ChunkRef, ...]
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_digest(self.base_digest, f"manifest v{self.version} base_digest")
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

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        d = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        d["chunks"] = [asdict(c) for c in self.chunks]
        return (sealer or _UNSIGNED).seal("manifest", d)

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "Manifest":
        obj = _load(data, "manifest", "manifest", sealer)
        if obj.get("format") == FORMAT and obj.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"manifest: format version {obj.get('format_version')!r} not supported "
                                f"(this nemo_dcr reads v{FORMAT_VERSION}; a run is written and read by one release)")
        top = _take(obj, {"format": str, "format_version": int, "run_id": str, "model_id": str, "version": int,
                          "base_version": int, "base_digest": str, "chunks": list, "stats": dict}, "manifest")
        if top["format"] != FORMAT or top["format_version"] != FORMAT_VERSION:
            raise ManifestError(f"manifest: format {top['format']!r} v{top['format_version']} not supported "
                                f"(this nemo_dcr reads v{FORMAT_VERSION})")
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
        return cls(run_id=top["run_id"], model_id=top["model_id"], version=top["version"],
                   base_version=top["base_version"], base_digest=top["base_digest"], chunks=tuple(chunks),
                   stats=stats)


@dataclass(frozen=True)
class Ack:
    """A receiver's answer for one version.  ``ok``: the receiver applied ``version`` (the
    manifest whose bytes hash to ``manifest_digest``) and, when it verifies against a dense
    reference, found it bit-exact; it now holds it tentatively until the trainer's decision.
    Otherwise a refusal whose ``error`` says why; ``held_version`` is what it holds."""

    KIND: ClassVar[str] = "ack"

    run_id: str
    receiver: str
    version: int
    ok: bool
    held_version: int
    manifest_digest: str = ""
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_receiver_id(self.receiver)

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("ack", asdict(self))

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "Ack":
        obj = _take(_load(data, "ack", "ack", sealer),
                    {"run_id": str, "receiver": str, "version": int, "ok": bool, "held_version": int,
                     "manifest_digest": str, "error": str, "stats": dict}, "ack")
        try:
            return cls(**obj)
        except ValueError as e:
            raise ManifestError(f"ack: {e}") from None


@dataclass(frozen=True)
class Decision:
    """The trainer's decision on ``version`` (delta from ``base_version``): ``commit`` (every
    receiver acknowledged it; the trainer's baseline advanced) or abort (``reason``).  A
    receiver that applied an aborted version rolls it back to ``base_version``."""

    KIND: ClassVar[str] = "decision"

    run_id: str
    version: int
    base_version: int
    commit: bool
    receivers: tuple[str, ...]
    reason: str = ""
    manifest_digest: str = ""
    """Digest of the manifest decided on ('' when none was published): a receiver that
    applied other bytes under this version number (a restarted trainer reusing a step
    number) treats the decision as an abort of what it applied."""
    joined: tuple[str, ...] = ()
    """Receivers admitted at this version (elastic membership): in ``receivers``, their ack
    of this version was required."""
    evicted: tuple[str, ...] = ()
    """Members evicted at this version (elastic membership): no longer in ``receivers``."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not 0 <= self.base_version < self.version:
            raise ManifestError(f"decision: base_version {self.base_version} must be in [0, {self.version})")
        if self.manifest_digest or self.commit:  # a commit always names what it committed
            check_digest(self.manifest_digest, f"decision v{self.version} manifest_digest")
        if len(self.receivers) > MAX_RECEIVERS:
            raise ManifestError(f"decision: {len(self.receivers)} receivers, more than {MAX_RECEIVERS}")
        for rid in (*self.receivers, *self.joined, *self.evicted):
            if not isinstance(rid, str) or not _RECEIVER.match(rid):
                raise ManifestError(f"decision: invalid receiver id {str(rid)[:80]!r}")
        members = set(self.receivers)
        # a receiver admitted and evicted at the same version (evict_after=1) is in both lists
        if (len(members) != len(self.receivers) or not set(self.joined) <= members | set(self.evicted)
                or members & set(self.evicted)):
            raise ManifestError("decision: receivers repeat, or joined/evicted disagree with receivers")

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("decision", {**asdict(self), "receivers": list(self.receivers),
                                                       "joined": list(self.joined), "evicted": list(self.evicted)})

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "Decision":
        # joined/evicted are optional: decisions written before elastic membership still open
        obj = _take(_load(data, "decision", "decision", sealer),
                    {"run_id": str, "version": int, "base_version": int, "commit": bool, "receivers": list,
                     "reason": str, "manifest_digest": str, "joined": list, "evicted": list}, "decision",
                    optional=frozenset({"joined", "evicted"}))
        for name in ("receivers", "joined", "evicted"):
            if not all(isinstance(r, str) for r in obj.get(name, ())):
                raise ManifestError(f"decision: {name} must be strings")
        return cls(**{**obj, **{n: tuple(obj[n]) for n in ("receivers", "joined", "evicted") if n in obj}})


@dataclass(frozen=True)
class JoinRequest:
    """A receiver's request to join the run's members (elastic membership), at
    ``join_key(receiver)``: it holds committed version ``held_version``, whose commit
    decision (``init/INIT.json`` for version 0) hashes to ``held_digest``.  The trainer
    admits a signed request of this run whose held version and digest are a commit it
    knows (docs/protocol.md, "Elastic membership"); from the version it is admitted at,
    the receiver's ack is required."""

    KIND: ClassVar[str] = "join"

    run_id: str
    receiver: str
    held_version: int
    held_digest: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not isinstance(self.receiver, str) or not _RECEIVER.match(self.receiver):
            raise ManifestError(f"join request: invalid receiver id {str(self.receiver)[:80]!r}")
        if self.held_version < 0:
            raise ManifestError(f"join request: held_version {self.held_version} < 0")
        check_digest(self.held_digest, "join request held_digest")

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("join", {"format": "nemo-dcr-join", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "JoinRequest":
        obj = _take(_load(data, "join request", "join", sealer),
                    {"format": str, "run_id": str, "receiver": str, "held_version": int, "held_digest": str},
                    "join request")
        if obj.pop("format") != "nemo-dcr-join":
            raise ManifestError("join request: wrong format tag")
        return cls(**obj)


@dataclass(frozen=True)
class Head:
    """Pointer to the latest published version (``HEAD.json``, rewritten per version):
    how a receiver finds the next manifest without listing the store (versions are step
    numbers, not necessarily consecutive)."""

    KIND: ClassVar[str] = "head"

    run_id: str
    version: int
    base_version: int

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("head", asdict(self))

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "Head":
        obj = _take(_load(data, "head", "head", sealer), {"run_id": str, "version": int, "base_version": int},
                    "head")
        check_run_id(obj["run_id"])
        return cls(**obj)


@dataclass(frozen=True)
class Committed:
    """``COMMITTED.json``: the latest committed version (its ``DECISION.json`` chain leads
    back to version 0 through each decision's ``base_version``)."""

    KIND: ClassVar[str] = "committed"

    run_id: str
    version: int
    receivers: tuple[str, ...]

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("committed", {"run_id": self.run_id, "version": self.version,
                                                        "receivers": list(self.receivers)})

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "Committed":
        obj = _take(_load(data, "commit record", "committed", sealer),
                    {"run_id": str, "version": int, "receivers": list}, "commit record")
        check_run_id(obj["run_id"])
        return cls(run_id=obj["run_id"], version=obj["version"], receivers=tuple(str(r) for r in obj["receivers"]))


@dataclass(frozen=True)
class RunRecord:
    """``RUN.json``: the run that owns this store prefix.  Written first, before version 0;
    a trainer finding another run's record (or objects without one) refuses the prefix."""

    KIND: ClassVar[str] = "run"

    run_id: str
    model_id: str
    created_unix: float

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        return (sealer or _UNSIGNED).seal("run", {"format": "nemo-dcr-run", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "RunRecord":
        obj = _take(_load(data, "run record", "run", sealer),
                    {"format": str, "run_id": str, "model_id": str, "created_unix": (int, float)}, "run record")
        if obj.pop("format") != "nemo-dcr-run":
            raise ManifestError("run record: wrong format tag")
        check_run_id(obj["run_id"])
        return cls(**obj)


@dataclass(frozen=True)
class InitRecord:
    """``init/INIT.json``: sha256 of each version-0 file, so a receiver proves the
    checkpoint it loaded (from the store or a local copy) is this run's version 0, and
    (``sizes``, since format 1.1 of the record; absent in older ones) each file's byte size,
    so a download is bounded by what the run wrote, not by what an upstream claims."""

    KIND: ClassVar[str] = "init"

    run_id: str
    files: dict[str, str]
    sizes: dict[str, int] = field(default_factory=dict)

    def to_json(self, sealer: Sealer | None = None) -> bytes:
        d = asdict(self)
        if not self.sizes:
            d.pop("sizes")
        return (sealer or _UNSIGNED).seal("init", d)

    @classmethod
    def from_json(cls, data: bytes, sealer: Sealer | None = None) -> "InitRecord":
        obj = _take(_load(data, "init record", "init", sealer), {"run_id": str, "files": dict, "sizes": dict},
                    "init record", optional=frozenset({"sizes"}))
        check_run_id(obj["run_id"])
        for name, d in obj["files"].items():
            if not (isinstance(d, str) and _DIGEST.match(d)) or "/" in name:
                raise ManifestError(f"init record: bad entry {name!r}")
        for name, n in obj.get("sizes", {}).items():
            if name not in obj["files"] or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ManifestError(f"init record: bad size entry {name!r}")
        return cls(**obj)
