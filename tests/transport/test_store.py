"""The store protocol against the embedded default (a directory) and fsspec's memory://."""
import itertools
import os

import pytest

from nemo_dcr.transport.store import (
    FsspecStore,
    LocalDirStore,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StorePolicy,
    SymlinkRefused,
    open_store,
)

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


def test_list_with_a_limit_returns_the_first_keys(store):
    """``list(prefix, limit=n)``: the first n keys in sorted order (a join scan or a snapshot
    search reads one bounded page, however many keys a store writer planted)."""
    keys = [f"acks/join.d/r{i:03d}.json" for i in (7, 3, 11, 0, 5)] + ["acks/join.d/sub/x.json", "acks/other"]
    for k in keys:
        store.put(k, b"{}")
    every = store.list("acks/join.d/")
    assert every == sorted(k for k in keys if k.startswith("acks/join.d/"))
    for n in (1, 2, 5, 6, 100):
        assert store.list("acks/join.d/", limit=n) == every[:n], n
    assert store.list("nothing/", limit=3) == []
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="list limit"):
            store.list("acks/join.d/", limit=bad)


def test_s3_list_with_a_limit_reads_one_bounded_page(s3_bucket, monkeypatch):
    """On S3 a bounded list asks for at most 2 x limit keys per page and stops after the
    limit (control: without a limit, every page of 1000 keys is read)."""
    from s3fs import S3FileSystem

    store = open_store(s3_bucket + "/run")
    for i in range(30):
        store.put(f"acks/join.d/junk{i:04d}.json", b"x")
    asked: list[dict] = []
    real = S3FileSystem._call_s3

    async def spy(self, method, *args, **kwargs):
        if method == "list_objects_v2":
            asked.append(kwargs)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", spy)
    assert store.list("acks/join.d/", limit=4) == [f"acks/join.d/junk{i:04d}.json" for i in range(4)]
    assert len(asked) == 1 and asked[0]["MaxKeys"] == 8
    asked.clear()
    assert len(store.list("acks/join.d/")) == 30
    assert asked and all("MaxKeys" not in a for a in asked)


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "", "a b", "a/../../etc"])
def test_keys_cannot_escape_the_store(store, key):
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_local_put_leaves_no_partial_object(tmp_path, monkeypatch):
    """A failing write leaves neither the object nor a visible temporary file."""
    s = LocalDirStore(str(tmp_path))
    calls = []

    def failing_replace(a, b, **kw):
        calls.append(a)
        raise OSError(28, "disk full")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", failing_replace)
        with pytest.raises(StoreError, match=r"put 'v/00000001/MANIFEST.json' failed .*OSError: \[Errno 28\] disk full"):
            s.put("v/00000001/MANIFEST.json", b"{}")
    assert calls and calls[0].startswith(".tmp-")  # the rename was reached, and failed
    assert not s.exists("v/00000001/MANIFEST.json")
    assert s.list("v") == []
    assert [p.name for p in (tmp_path / "v" / "00000001").iterdir()] == []


# --- symbolic links below a local store's root ------------------------------------------

@pytest.fixture
def planted(tmp_path):
    """A store whose ``v`` is a link to a directory outside the root, and whose
    ``a/f`` is a link to a file outside it; ``w/secret`` is the same layout without links."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"outside")
    s = LocalDirStore(str(tmp_path / "s"))
    os.symlink(outside, tmp_path / "s" / "v")
    (tmp_path / "s" / "a").mkdir()
    os.symlink(outside / "secret", tmp_path / "s" / "a" / "f")
    s.put("w/secret", b"inside")  # control layout
    return s, outside


@pytest.mark.parametrize("op,key,call", [
    ("put", "v/x", lambda s: s.put("v/x", b"planted")),
    ("get", "v/secret", lambda s: s.get("v/secret")),
    ("exists", "v/secret", lambda s: s.exists("v/secret")),
    ("list", "v", lambda s: s.list("v")),
    ("list", "", lambda s: s.list("")),
    ("get", "a/f", lambda s: s.get("a/f")),
    ("exists", "a/f", lambda s: s.exists("a/f")),
    ("stat", "v/secret", lambda s: s.stat("v/secret")),
    ("stat", "a/f", lambda s: s.stat("a/f")),
    ("get", "a/f", lambda s: s.get("a/f", max_bytes=100)),
    ("get", "v/secret", lambda s: s.get_with_info("v/secret")),
])
def test_local_store_refuses_paths_through_symlinks(planted, op, key, call):
    s, outside = planted
    with pytest.raises(SymlinkRefused) as e:
        call(s)
    msg = str(e.value)
    assert msg.startswith(f"{s.uri}: {op} {key!r} refused: ") and "is a symbolic link" in msg and "\n" not in msg
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]  # nothing written outside
    assert (outside / "secret").read_bytes() == b"outside"


def test_local_store_without_links_answers_the_same_calls(planted):
    s, _ = planted  # control for the refusals above: the same operations on a real directory
    s.put("w/x", b"1")
    assert s.get("w/secret") == b"inside" and s.exists("w/secret") and s.list("w") == ["w/secret", "w/x"]
    assert s.stat("w/secret").size == 6 and s.get_with_info("w/secret", max_bytes=6)[0] == b"inside"


def test_unusable_store_uris_are_one_line_store_errors(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for uri in (str(blocker / "store"), "nosuchproto://bucket/x"):
        with pytest.raises(StoreError, match=r"cannot open store: ") as e:
            open_store(uri)
        assert str(e.value).startswith(f"{uri}: ") and "\n" not in str(e.value)
    assert isinstance(open_store(str(tmp_path / "store")), LocalDirStore)  # control


def test_store_policy_is_validated_and_set_per_store(tmp_path):
    with pytest.raises(ValueError, match="timeout_s"):
        StorePolicy(timeout_s=0)
    with pytest.raises(TypeError, match="retries must be an int"):
        StorePolicy(retries=1.5)
    with pytest.raises(ValueError, match="not both"):
        open_store(str(tmp_path), policy=StorePolicy(), retries=2)
    with pytest.raises(ValueError, match="apply to fsspec URIs only"):
        open_store(str(tmp_path), endpoint_url="http://x")
    a = open_store(str(tmp_path / "a"), timeout_s=5, retries=1)
    b = open_store("memory://policy-b")
    assert (a.policy.timeout_s, a.policy.retries) == (5, 1)
    assert b.policy == StorePolicy() and (b.policy.timeout_s, b.policy.retries) == (30.0, 4)
