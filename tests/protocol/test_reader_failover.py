"""A relay that forges or alters a signed document: the reader asks the next upstream.

Two real directory stores stand for a lying relay and the origin behind it (an upstream
list, ``transport/failover.py``); the documents are sealed with a real key."""
from protocol_helpers import key  # noqa: F401 - key is a fixture

from nemo_dcr.protocol.manifest import HEAD_KEY, Head
from nemo_dcr.protocol.reader import DocReader
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.transport.failover import FailoverStore
from nemo_dcr.transport.store import LocalDirStore

RUN = "3f" * 16


def _stores(tmp_path, key):
    sealer = Sealer(load_key(key))
    origin, liar = LocalDirStore(str(tmp_path / "origin")), LocalDirStore(str(tmp_path / "liar"))
    origin.put(HEAD_KEY, Head(RUN, 7, 6).to_json(sealer))
    forged = Head(RUN, 9, 6).to_json(sealer).replace(b'"version": 9', b'"version": 8')  # altered after sealing
    assert forged != Head(RUN, 9, 6).to_json(sealer)
    liar.put(HEAD_KEY, forged)
    return sealer, origin, liar


def test_a_document_that_does_not_open_is_read_from_the_next_upstream(tmp_path, key):
    sealer, origin, liar = _stores(tmp_path, key)
    events = []
    fs = FailoverStore([liar, origin])
    reader = DocReader(fs, sealer, RUN, log=events.append)
    got = reader.read(HEAD_KEY, Head)
    assert got is not None and (got.doc.version, got.doc.base_version) == (7, 6)
    assert [e for e in events if e.get("ignored") == HEAD_KEY]  # the forgery was seen and logged
    stats = fs.upstream_stats()
    assert stats[0]["bad_bytes"] == 1 and stats[1]["current"]  # the liar was left
    # later polls stay on the genuine document, read once more from the origin, then cached
    for _ in range(5):
        assert reader.read(HEAD_KEY, Head).doc.version == 7
    assert fs.upstream_stats()[1]["bytes_read"] == 2 * len(origin.get(HEAD_KEY))


def test_negative_controls_the_liar_alone_and_a_forgery_everywhere(tmp_path, key):
    sealer, origin, liar = _stores(tmp_path, key)
    assert DocReader(liar, sealer, RUN, log=lambda e: None).read(HEAD_KEY, Head) is None
    origin.put(HEAD_KEY, liar.get(HEAD_KEY))  # forged at the origin: every upstream passes it on
    events = []
    reader = DocReader(FailoverStore([liar, origin]), sealer, RUN, log=events.append)
    for _ in range(5):
        assert reader.read(HEAD_KEY, Head) is None
    assert len([e for e in events if e.get("ignored") == HEAD_KEY]) == 1  # logged once, as before
