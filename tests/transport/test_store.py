"""The store protocol against the embedded default (a directory) and fsspec's memory://."""
import itertools

import pytest

from nemo_dcr.transport.store import FsspecStore, LocalDirStore, ObjectNotFound, ObjectStore, open_store

_counter = itertools.count()


@pytest.fixture(params=["dir", "memory", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "dir":
        return open_store(str(tmp_path / "s"))
    if request.param == "s3":  # a real S3-compatible server (moto) on loopback
        return open_store(request.getfixturevalue("s3_bucket") + "/prefix")
    return open_store(f"memory://dcr-test-{next(_counter)}")


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalDirStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalDirStore)
    assert isinstance(open_store("memory://x"), FsspecStore)


def test_put_get_list_delete(store):
    store.put("v/00000001/chunks/r000-00000.dcr", b"abc")
    store.put("v/00000001/MANIFEST.json", b"{}")
    store.put("acks/r0/00000001.json", b"1")
    assert store.get("v/00000001/chunks/r000-00000.dcr") == b"abc"
    assert store.exists("v/00000001/MANIFEST.json") and not store.exists("v/00000002/MANIFEST.json")
    assert store.list("v/00000001") == ["v/00000001/MANIFEST.json", "v/00000001/chunks/r000-00000.dcr"]
    assert store.list("nothing") == []
    store.put("acks/r0/00000001.json", b"2")  # replace
    assert store.get("acks/r0/00000001.json") == b"2"
    store.delete("acks/r0/00000001.json")
    store.delete("acks/r0/00000001.json")  # idempotent
    with pytest.raises(ObjectNotFound):
        store.get("acks/r0/00000001.json")


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "", "a b", "a/../../etc"])
def test_keys_cannot_escape_the_store(store, key):
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_local_put_leaves_no_partial_object(tmp_path, monkeypatch):
    """A failing write leaves neither the object nor a visible temporary file."""
    import os

    s = LocalDirStore(str(tmp_path))

    def failing_replace(a, b):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", failing_replace)
        with pytest.raises(OSError):
            s.put("v/00000001/MANIFEST.json", b"{}")
    assert not s.exists("v/00000001/MANIFEST.json")
    assert s.list("v") == []
    assert [p.name for p in (tmp_path / "v" / "00000001").iterdir()] == []
