"""The one document codec (``protocol/doc.py``): every signed document writes the bytes the
hand-written ``to_json`` of each class wrote before it (golden, signed and unsigned, read
back to the same value), and reads strictly by its fields' annotations: each kind of bad
field is refused in one ``ManifestError`` line, with the good document as control."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from nemo_dcr.protocol.doc import SignedDoc, from_plain
from nemo_dcr.protocol.manifest import (
    Ack,
    ChunkRef,
    Committed,
    Decision,
    Head,
    InitRecord,
    JoinRequest,
    Manifest,
    ManifestError,
    RunRecord,
)
from nemo_dcr.protocol.signing import Sealer
from nemo_dcr.protocol.snapshot import SnapshotRecord

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "documents_v3.json").read_text())
RID = "ab" * 16
D = "sha256:" + "0" * 64
DOCS = {
    "Manifest": Manifest(run_id=RID, model_id="m", version=3, base_version=2, base_digest=D,
                         chunks=(ChunkRef(key="v/00000003/chunks/r001-00000.dcr", nbytes=10, digest=D, rank=1,
                                          tensors=2, changed=3),), stats={"changed": 3.0}),
    "Ack": Ack(run_id=RID, receiver="r0", version=3, ok=False, held_version=2, manifest_digest=D, error="refused: x",
               stats={"download_s": 0.5, "fetch_threads": 2}),
    "Decision": Decision(run_id=RID, version=3, base_version=2, commit=True, receivers=("r0", "r1"),
                         manifest_digest=D, joined=("r1",)),
    "JoinRequest": JoinRequest(run_id=RID, receiver="r2", held_version=3, held_digest=D),
    "Head": Head(run_id=RID, version=3, base_version=2),
    "Committed": Committed(run_id=RID, version=3, receivers=("r0", "r1")),
    "RunRecord": RunRecord(run_id=RID, model_id="m", created_unix=1764800000.25),
    "InitRecord": InitRecord(run_id=RID, files={"config.json": D, "model.safetensors": D}),
    "SnapshotRecord": SnapshotRecord(run_id=RID, version=4, decision_digest=D, files={"model.safetensors": D},
                                     sizes={"model.safetensors": 5}),
}
SEALER = Sealer(bytes.fromhex(GOLDEN["key_hex"]))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_document_is_covered():
    assert {c.__name__ for c in _subclasses(SignedDoc)} == set(DOCS) == set(GOLDEN["docs"])


@pytest.mark.parametrize("name", sorted(DOCS))
def test_the_bytes_are_the_ones_written_before_and_read_back(name):
    doc, golden = DOCS[name], GOLDEN["docs"][name]
    assert doc.to_json().decode() == golden["unsigned"]
    assert doc.to_json(SEALER).decode() == golden["signed"]
    assert type(doc).from_json(golden["signed"].encode(), SEALER) == doc
    assert type(doc).from_json(golden["unsigned"].encode()) == doc


def _reseal(name: str, **change) -> bytes:
    obj = json.loads(GOLDEN["docs"][name]["unsigned"])
    obj.pop("signature")
    for k, v in change.items():
        if v is _DROP:
            obj.pop(k)
        else:
            obj[k] = v
    return Sealer(None).seal(type(DOCS[name]).KIND, obj)


_DROP = object()


@pytest.mark.parametrize("name, change, needle", [
    ("Head", {"version": True}, "head: field 'version' must be int, got bool"),
    ("Head", {"version": "3"}, "head: field 'version' must be int, got str"),
    ("Head", {"extra": 1}, "head: unknown fields ['extra']"),
    ("Head", {"version": _DROP}, "head: missing field 'version'"),
    ("Head", {"run_id": "x"}, "invalid run id 'x'"),
    ("Committed", {"receivers": ["r0", 7]}, "commit record: field 'receivers'[1] must be str, got int"),
    ("Committed", {"receivers": "r0"}, "commit record: field 'receivers' must be a list, got str"),
    ("Manifest", {"chunks": [{"key": "v/00000003/chunks/r001-00000.dcr", "nbytes": "10"}]},
     "manifest: field 'chunks'[0]: field 'nbytes' must be int, got str"),
    ("Manifest", {"stats": {"changed": True}}, "manifest: field 'stats'['changed'] must be a number, got bool"),
    ("Manifest", {"format_version": 2}, "manifest: format_version '2' not supported"),
    ("RunRecord", {"format": "nemo-dcr-runx"}, "run record: format 'nemo-dcr-runx' not supported"),
    ("RunRecord", {"created_unix": "now"}, "run record: field 'created_unix' must be a number, got str"),
    ("Ack", {"receiver": "../x"}, "ack: invalid receiver id '../x'"),
    ("InitRecord", {"files": {"a/b": D}}, "init record: bad entry 'a/b'"),
])
def test_a_bad_field_is_one_line(name, change, needle):
    cls = type(DOCS[name])
    with pytest.raises(ManifestError) as e:
        cls.from_json(_reseal(name, **change))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert cls.from_json(_reseal(name)) == DOCS[name]  # control: the same document unchanged


def test_optional_fields_of_older_writers():
    old = Decision.from_json(_reseal("Decision", joined=_DROP, evicted=_DROP))  # before elastic membership
    assert (old.joined, old.evicted) == ((), ())
    with pytest.raises(ManifestError, match="missing field 'receivers'"):  # control: a required one
        Decision.from_json(_reseal("Decision", receivers=_DROP))
    assert "sizes" not in json.loads(DOCS["InitRecord"].to_json())  # written as before format 1.1


def test_an_unsupported_annotation_is_a_bug_not_a_refusal():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        run_id: str
        when: complex

    with pytest.raises(TypeError, match="no JSON rule"):
        from_plain(Odd, {"run_id": RID, "when": 1}, "odd")
