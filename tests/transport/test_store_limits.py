"""Bounded reads (``get(max_bytes=)``) and version identity (``stat``, ``get_with_info``)
on a directory, fsspec memory:// and a real S3-compatible server (moto)."""
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from nemo_dcr.errors import FormatError, TransportError
from nemo_dcr.transport.store import (
    FsspecStore,
    LocalDirStore,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    StoreError,
    StorePolicy,
    open_store,
)

_counter = itertools.count()
KEY = "acks/r0/00000001.json"


@pytest.fixture(params=["dir", "memory", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "dir":
        return open_store(str(tmp_path / "s"), retries=0)
    if request.param == "s3":
        return open_store(request.getfixturevalue("s3_bucket") + "/prefix", retries=0)
    return open_store(f"memory://dcr-limits-{next(_counter)}", retries=0)


@pytest.fixture(params=["memory", "s3"])
def remote(request) -> ObjectStore:
    if request.param == "s3":
        return open_store(request.getfixturevalue("s3_bucket") + "/prefix", retries=0)
    return open_store(f"memory://dcr-limits-{next(_counter)}", retries=0)


def _body_reads(store, monkeypatch) -> list:
    """Records every body read (``cat_file``) of an fsspec store."""
    calls = []
    name = "_cat_file" if store._async else "cat_file"
    real = getattr(store.fs, name)

    def spy(path, *args, **kwargs):
        calls.append(kwargs)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, name, spy)
    return calls


def test_an_object_at_the_cap_is_read_and_one_over_it_is_refused(store):
    data = bytes(range(256)) * 4
    store.put(KEY, data)
    assert store.get(KEY, max_bytes=len(data)) == data  # control: exactly at the cap
    assert store.get(KEY) == data  # no cap, as before
    got, info = store.get_with_info(KEY, max_bytes=len(data))
    assert got == data and info == store.stat(KEY) and info.size == len(data) and info.key == KEY
    for read in (lambda: store.get(KEY, max_bytes=len(data) - 1),
                 lambda: store.get_with_info(KEY, max_bytes=len(data) - 1)):
        with pytest.raises(ObjectTooLarge) as e:
            read()
        err = e.value
        assert (err.key, err.size, err.limit) == (KEY, 1024, 1023)
        # a remote get is one ranged read (no HEAD first): it knows the size is at least what came back
        what = "is at least" if isinstance(store, FsspecStore) and str(err) != _exact(store, err) else "is"
        assert str(err) == f"{store.uri}: {KEY!r} {what} 1024 bytes, over the limit of 1023"
        assert isinstance(err, FormatError) and not isinstance(err, TransportError)


def _exact(store, err) -> str:
    return f"{store.uri}: {err.key!r} is {err.size} bytes, over the limit of {err.limit}"


def test_empty_objects_and_a_zero_cap(store):
    store.put(KEY, b"")
    assert store.get(KEY, max_bytes=0) == b""
    assert store.get_with_info(KEY, max_bytes=0) == (b"", store.stat(KEY))
    store.put(KEY, b"x")
    with pytest.raises(ObjectTooLarge, match=r"is (at least )?1 bytes, over the limit of 0$"):
        store.get(KEY, max_bytes=0)
    with pytest.raises(ObjectTooLarge, match=r"is 1 bytes, over the limit of 0$"):
        store.get_with_info(KEY, max_bytes=0)


def test_a_capped_read_of_a_missing_object_is_object_not_found(store):
    for read in (lambda: store.get(KEY, max_bytes=10), lambda: store.get_with_info(KEY, max_bytes=10)):
        with pytest.raises(ObjectNotFound, match=rf": get {KEY!r}: no such object$"):
            read()
    store.put(KEY, b"x")  # control
    assert store.get(KEY, max_bytes=10) == b"x"


def test_a_capped_remote_get_is_one_ranged_read_and_reads_no_more_than_the_cap(remote, monkeypatch):
    """``get(max_bytes=N)`` on an fsspec store: one ranged read of N + 1 bytes (S3: one GET, no
    HEAD first), refused when more than N came back; ``get_with_info`` asks the size first
    and never reads the body of an object over its cap."""
    reads = _body_reads(remote, monkeypatch)
    remote.put(KEY, b"x" * 1000)
    before = remote.meter.snapshot()["requests"]
    with pytest.raises(ObjectTooLarge, match=r"is at least 1000 bytes, over the limit of 999$"):
        remote.get(KEY, max_bytes=999)
    assert reads == [{"start": 0, "end": 1000}]
    assert remote.get(KEY, max_bytes=1000) == b"x" * 1000  # control: within the cap the body is read, ranged
    assert reads[1:] == [{"start": 0, "end": 1001}]
    after = remote.meter.snapshot()["requests"]
    assert "info" not in after or after["info"] == before.get("info")  # no HEAD for either
    with pytest.raises(ObjectTooLarge, match=r"is 1000 bytes, over the limit of 999$"):
        remote.get_with_info(KEY, max_bytes=999)
    assert len(reads) == 2  # its body was never read


def test_an_object_that_grows_between_info_and_read_is_refused(remote, monkeypatch):
    remote.put(KEY, b"x" * 1000)
    name = "_info" if remote._async else "info"
    real = getattr(remote.fs, name)

    def stale(path, **kwargs):  # info says 10 bytes (an earlier version); the read finds 1000
        return {**real(path, **kwargs), "size": 10}

    async def stale_async(path, **kwargs):
        return {**(await real(path, **kwargs)), "size": 10}

    monkeypatch.setattr(remote.fs, name, stale_async if remote._async else stale)
    with pytest.raises(ObjectTooLarge, match=r"'acks/r0/00000001.json' grew to at least 51 bytes while read, "
                                             r"over the limit of 50$") as e:
        remote.get_with_info(KEY, max_bytes=50)
    assert (e.value.size, e.value.limit) == (51, 50)
    assert remote.get_with_info(KEY, max_bytes=2000)[0] == b"x" * 1000  # control: a cap above the real size


def test_object_too_large_is_neither_retried_nor_wrapped(monkeypatch):
    store = open_store(f"memory://dcr-limits-{next(_counter)}", retries=4, backoff_s=0)
    store.put(KEY, b"x" * 10)
    calls = []
    real = store.fs.cat_file
    monkeypatch.setattr(store.fs, "cat_file", lambda path, **kw: calls.append(path) or real(path, **kw))
    with pytest.raises(ObjectTooLarge) as e:
        store.get(KEY, max_bytes=9)
    assert type(e.value) is ObjectTooLarge and not isinstance(e.value, StoreError) and len(calls) == 1


# --- version identity ------------------------------------------------------------------

def test_stat_is_none_when_absent(store):
    assert store.stat(KEY) is None
    store.put("acks/r0/other.json", b"1")
    assert store.stat(KEY) is None and store.stat("acks/r0") is None  # a "directory" is no object
    store.put(KEY, b"abc")  # control
    info = store.stat(KEY)
    assert isinstance(info, ObjectInfo) and (info.key, info.size) == (KEY, 3) and info.tag
    store.delete(KEY)
    assert store.stat(KEY) is None


def test_the_tag_changes_when_the_object_is_rewritten(store):
    store.put(KEY, b"version-1")
    first = store.stat(KEY)
    assert store.stat(KEY) == first  # control: nothing changed, same tag
    store.get(KEY)
    assert store.stat(KEY) == first  # reading changes nothing
    time.sleep(0.01)
    store.put(KEY, b"version-2")  # same size, other bytes
    second = store.stat(KEY)
    assert second.size == first.size and second.tag != first.tag
    assert store.get_with_info(KEY, max_bytes=100) == (b"version-2", second)


@pytest.mark.parametrize("backend", ["dir", "memory"])
def test_rewriting_the_same_bytes_is_a_new_version_where_the_back_end_can_tell(backend, tmp_path):
    store = open_store(str(tmp_path / "s") if backend == "dir" else f"memory://dcr-limits-{next(_counter)}")
    store.put(KEY, b"same")
    first = store.stat(KEY)
    time.sleep(0.01)
    store.put(KEY, b"same")
    assert store.stat(KEY).tag != first.tag


def test_a_local_rewrite_in_place_that_restores_mtime_still_changes_the_tag(tmp_path):
    store = LocalDirStore(str(tmp_path / "s"))
    store.put(KEY, b"version-1")
    path = tmp_path / "s" / KEY
    before, st = store.stat(KEY), os.stat(path)
    time.sleep(0.05)  # past the file system's ctime tick
    with open(path, "r+b") as f:  # same inode, same size, other bytes
        f.write(b"version-2")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a writer hiding its tracks
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_ino == st.st_ino
    after = store.stat(KEY)
    assert after.size == before.size and after.tag != before.tag
    assert store.get_with_info(KEY) == (b"version-2", after)


def test_a_local_object_changed_while_read_is_read_again(tmp_path, monkeypatch):
    """get_with_info compares fstat before and after its read; a change fails the attempt
    transiently, and the next attempt reads one consistent version."""
    store = LocalDirStore(str(tmp_path / "s"))
    store.put(KEY, b"abc")
    real_fstat, calls = os.fstat, []

    def fstat_changing_once(fd):
        calls.append(fd)
        st = real_fstat(fd)
        if len(calls) == 2:  # the check after the first read sees a new ctime
            st = os.stat_result(st[:10], {"st_ctime_ns": st.st_ctime_ns + 1, "st_mtime_ns": st.st_mtime_ns})
        return st

    monkeypatch.setattr(os, "fstat", fstat_changing_once)
    store.policy = StorePolicy(retries=1, backoff_s=0)
    assert store.get_with_info(KEY)[0] == b"abc" and len(calls) == 4
    calls.clear()
    store.policy = StorePolicy(retries=0)
    with pytest.raises(StoreError, match=r"get '.*' failed after 1 attempt .*changed while it was read"):
        store.get(KEY)


# --- a 2 GiB object is refused by its size -----------------------------------------------

_PROBE = textwrap.dedent("""
    import json, os, sys, time
    from nemo_dcr.transport.store import ObjectTooLarge, open_store

    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    root, size, cap = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    store = open_store(root)
    with open(os.path.join(root, "big"), "wb") as f:
        os.truncate(f.fileno(), size)  # sparse: no disk, no page cache
    base = hwm_kb()
    t0 = time.perf_counter()
    try:
        n = len(store.get("big", max_bytes=cap))
    except ObjectTooLarge as e:
        n = str(e)
    print(json.dumps({"s": time.perf_counter() - t0, "rss_mb": (hwm_kb() - base) / 1024, "got": n}))
""")


def _probe(tmp_path, size: int, cap: int | None) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), str(size), json.dumps(cap)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_a_2gib_local_object_is_refused_without_reading_it(tmp_path):
    r = _probe(tmp_path / "big", 2 << 30, 64 << 20)
    print(f"\n2 GiB sparse object, cap 64 MiB: refused in {r['s'] * 1e3:.2f} ms, peak RSS +{r['rss_mb']:.1f} MB")
    assert r["got"] == f"{tmp_path / 'big'}: 'big' is {2 << 30} bytes, over the limit of {64 << 20}"
    assert r["rss_mb"] < 50 and r["s"] < 1.0
    # control: the probe does see a read -- 64 MiB read unbounded raises the peak by about that
    r = _probe(tmp_path / "read", 64 << 20, None)
    print(f"64 MiB sparse object, no cap: read in {r['s'] * 1e3:.0f} ms, peak RSS +{r['rss_mb']:.1f} MB")
    assert r["got"] == 64 << 20 and r["rss_mb"] > 60
