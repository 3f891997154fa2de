"""The protocol's documents: run record, version-0 record, manifests, acks, decisions.

The store's key layout is ``protocol/keys.py``'s (re-exported here for the documents' readers).

A manifest says: applying these chunks to base version ``base_version`` gives version
``version``.  Every chunk is listed with its size and sha256; a receiver downloads and
checks all of them before it writes anything.  Every document carries the run id and is
sealed (``protocol/signing.py``: HMAC-SHA256 with the run's key, ``"none"`` without one);
``from_json`` opens it with a ``Sealer`` and parses strictly: wrong types, unknown fields
and oversize documents are ``ManifestError``, bad signatures ``SignatureError``.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar


from nemo_dcr.protocol.keys import (  # noqa: F401 - the layout, re-exported for the documents' readers
    CHUNK_KEY,
    COMMITTED_KEY,
    HEAD_KEY,
    INIT_PREFIX,
    INIT_RECORD_KEY,
    JOIN_PREFIX,
    MAX_VERSION,
    RUN_KEY,
    SNAPSHOT_PREFIX,
    SNAPSHOT_RECORD,
    VERSION_DIGITS,
    ack_key,
    check_receiver_id,
    check_version,
    chunk_key,
    decision_key,
    dense_key,
    is_receiver_id,
    join_key,
    join_key_receiver,
    manifest_key,
    snapshot_key,
    version_prefix,
)
from nemo_dcr.protocol.doc import DOC_LIMITS, MAX_JSON_BYTES, ManifestError, SignedDoc, check_run_id  # noqa: F401

FORMAT = "nemo-dcr-manifest"
FORMAT_VERSION = 3
"""3: ``base_digest`` chains each manifest to its base's decision (2 had run identity and
signatures but no chain; 1 had neither; both refused)."""
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_RECEIVERS = 1024
"""Most members a decision names (elastic membership admits no more)."""


def doc_digest(data: bytes) -> str:
    """``sha256:<hex>`` of a document's bytes as stored (an ack names the manifest it applied)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str, what: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ManifestError(f"{what}: bad digest {digest!r} (sha256:<64 hex>)")
    return digest


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
        if not CHUNK_KEY.match(self.key):
            raise ManifestError(f"chunk key {self.key[:120]!r} is not v/<version>/chunks/r<rank>-<seq>.dcr")
        if not _DIGEST.match(self.digest):
            raise ManifestError(f"chunk {self.key}: bad digest {self.digest!r}")
        if min(self.nbytes, self.rank, self.tensors, self.changed) < 0:
            raise ManifestError(f"chunk {self.key}: negative count")


@dataclass(frozen=True)
class Manifest(SignedDoc):
    """Version ``version`` = these chunks applied to ``base_version``.  ``base_digest`` names
    the base: the digest of the base's commit ``DECISION.json`` (of ``init/INIT.json`` for
    version 0).  Each commit decision names its manifest's digest in turn, so the signed
    documents form one chain back to version 0, and a receiver applies a manifest only on
    top of the exact decision it settled on -- a replayed or deleted pointer file
    (``HEAD.json``, ``COMMITTED.json``) cannot move it to another branch."""

    KIND: ClassVar[str] = "manifest"
    WHAT: ClassVar[str] = "manifest"
    TAGS: ClassVar[dict] = {"format": FORMAT, "format_version": FORMAT_VERSION}

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


@dataclass(frozen=True)
class Ack(SignedDoc):
    """A receiver's answer for one version.  ``ok``: the receiver applied ``version`` (the
    manifest whose bytes hash to ``manifest_digest``) and, when it verifies against a dense
    reference, found it bit-exact; it now holds it tentatively until the trainer's decision.
    Otherwise a refusal whose ``error`` says why; ``held_version`` is what it holds."""

    KIND: ClassVar[str] = "ack"
    WHAT: ClassVar[str] = "ack"

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



@dataclass(frozen=True)
class Decision(SignedDoc):
    """The trainer's decision on ``version`` (delta from ``base_version``): ``commit`` (every
    receiver acknowledged it; the trainer's baseline advanced) or abort (``reason``).  A
    receiver that applied an aborted version rolls it back to ``base_version``."""

    KIND: ClassVar[str] = "decision"
    WHAT: ClassVar[str] = "decision"
    OPTIONAL: ClassVar[frozenset] = frozenset({"joined", "evicted"})
    """Decisions written before elastic membership have neither."""

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
            if not is_receiver_id(rid):
                raise ManifestError(f"decision: invalid receiver id {str(rid)[:80]!r}")
        members = set(self.receivers)
        # a receiver admitted and evicted at the same version (evict_after=1) is in both lists
        if (len(members) != len(self.receivers) or not set(self.joined) <= members | set(self.evicted)
                or members & set(self.evicted)):
            raise ManifestError("decision: receivers repeat, or joined/evicted disagree with receivers")



@dataclass(frozen=True)
class JoinRequest(SignedDoc):
    """A receiver's request to join the run's members (elastic membership), at
    ``join_key(receiver)``: it holds committed version ``held_version``, whose commit
    decision (``init/INIT.json`` for version 0) hashes to ``held_digest``.  The trainer
    admits a signed request of this run whose held version and digest are a commit it
    knows (docs/protocol.md, "Elastic membership"); from the version it is admitted at,
    the receiver's ack is required."""

    KIND: ClassVar[str] = "join"
    WHAT: ClassVar[str] = "join request"
    TAGS: ClassVar[dict] = {"format": "nemo-dcr-join"}

    run_id: str
    receiver: str
    held_version: int
    held_digest: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not is_receiver_id(self.receiver):
            raise ManifestError(f"join request: invalid receiver id {str(self.receiver)[:80]!r}")
        if self.held_version < 0:
            raise ManifestError(f"join request: held_version {self.held_version} < 0")
        check_digest(self.held_digest, "join request held_digest")



@dataclass(frozen=True)
class Head(SignedDoc):
    """Pointer to the latest published version (``HEAD.json``, rewritten per version):
    how a receiver finds the next manifest without listing the store (versions are step
    numbers, not necessarily consecutive)."""

    KIND: ClassVar[str] = "head"
    WHAT: ClassVar[str] = "head"

    run_id: str
    version: int
    base_version: int



@dataclass(frozen=True)
class Committed(SignedDoc):
    """``COMMITTED.json``: the latest committed version (its ``DECISION.json`` chain leads
    back to version 0 through each decision's ``base_version``)."""

    KIND: ClassVar[str] = "committed"
    WHAT: ClassVar[str] = "commit record"

    run_id: str
    version: int
    receivers: tuple[str, ...]



@dataclass(frozen=True)
class RunRecord(SignedDoc):
    """``RUN.json``: the run that owns this store prefix.  Written first, before version 0;
    a trainer finding another run's record (or objects without one) refuses the prefix."""

    KIND: ClassVar[str] = "run"
    WHAT: ClassVar[str] = "run record"
    TAGS: ClassVar[dict] = {"format": "nemo-dcr-run"}

    run_id: str
    model_id: str
    created_unix: float



@dataclass(frozen=True)
class InitRecord(SignedDoc):
    """``init/INIT.json``: sha256 of each version-0 file, so a receiver proves the
    checkpoint it loaded (from the store or a local copy) is this run's version 0, and
    (``sizes``, since format 1.1 of the record; absent in older ones) each file's byte size,
    so a download is bounded by what the run wrote, not by what an upstream claims."""

    KIND: ClassVar[str] = "init"
    WHAT: ClassVar[str] = "init record"
    OPTIONAL: ClassVar[frozenset] = frozenset({"sizes"})
    OMIT_EMPTY: ClassVar[frozenset] = frozenset({"sizes"})
    """Records before format 1.1 have no sizes; one without sizes is written as they were."""

    run_id: str
    files: dict[str, str]
    sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        for name, d in self.files.items():
            if not (isinstance(d, str) and _DIGEST.match(d)) or "/" in name:
                raise ManifestError(f"init record: bad entry {str(name)[:80]!r}")
        for name, n in self.sizes.items():
            if name not in self.files or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ManifestError(f"init record: bad size entry {str(name)[:80]!r}")
