"""Bounded store calls: timeouts, retries on transient failures only, one-line errors.

The stall tests run against a REAL S3-compatible server (moto) that this module starts
and stops with SIGSTOP (so the TCP port still accepts connections but nothing answers,
like a hung server), resuming it with SIGCONT.  Elapsed times are printed; the only
timing assertion is a generous sanity bound (5x the configured worst case).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
import uuid

import pytest

from nemo_dcr.transport.store import (
    LocalDirStore,
    ObjectNotFound,
    StoreError,
    StorePolicy,
    is_transient,
    open_store,
)

KEY = "v/00000003/MANIFEST.json"


# --- a moto server of our own, so stopping it disturbs no other test --------------------

@pytest.fixture(scope="module")
def moto():
    from moto_helpers import start_moto_server

    proc, endpoint = start_moto_server()
    yield proc, endpoint
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def stalled_s3(moto, monkeypatch):
    """(server pid, bucket URI); the server is resumed after the test whatever happens."""
    import s3fs

    proc, endpoint = moto
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    bucket = f"dcr-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    try:
        yield proc.pid, f"s3://{bucket}/run"
    finally:
        os.kill(proc.pid, signal.SIGCONT)


OPS = {
    "get": lambda s: s.get(KEY),
    "exists": lambda s: s.exists("v/00000004/MANIFEST.json"),
    "list": lambda s: s.list("v"),
    "put": lambda s: s.put("v/00000004/MANIFEST.json", b"{}"),
    "delete": lambda s: s.delete("v/00000009/MANIFEST.json"),
}
OP_KEY = {"get": KEY, "exists": "v/00000004/MANIFEST.json", "list": "v",
          "put": "v/00000004/MANIFEST.json", "delete": "v/00000009/MANIFEST.json"}


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_stalled_s3_server_fails_the_call_with_the_key_and_operation(stalled_s3, op):
    pid, uri = stalled_s3
    policy = StorePolicy(timeout_s=1.0, retries=1, backoff_s=0.1)
    open_store(uri).put(KEY, b'{"v": 3}')  # setup under the default policy
    store = open_store(uri, policy=policy)
    OPS[op](store)  # control: the same call answers while the server runs
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        OPS[op](store)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    print(f"\n{op}: stalled server detected in {elapsed:.2f} s: {msg}")
    assert msg.startswith(f"{uri}: {op} {OP_KEY[op]!r} failed after 2 attempts in "), msg
    assert "\n" not in msg and "Timeout" in msg, msg
    assert not isinstance(e.value, ObjectNotFound)
    assert (e.value.op, e.value.key, e.value.attempts) == (op, OP_KEY[op], 2)
    # sanity only: 2 attempts of ~1 s (+ the put's byte allowance) and <= 0.1 s backoff
    assert elapsed < 5 * (2 * policy.budget_s(2) + policy.backoff_s)


class _ResumeOnRetry(logging.Handler):
    """Sends SIGCONT to the server when the store logs its first retry, i.e. while the
    store sleeps in its backoff."""

    def __init__(self, pid: int):
        super().__init__(logging.WARNING)
        self.pid = pid
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def resume_on_retry(stalled_s3):
    handler = _ResumeOnRetry(stalled_s3[0])
    log = logging.getLogger("nemo_dcr.transport.store")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


@pytest.mark.parametrize("retries", [3, 0])
def test_a_retry_succeeds_when_the_server_resumes_during_the_backoff(stalled_s3, resume_on_retry, retries):
    """retries=3: the first attempt times out, the server resumes during the backoff and
    the retry returns the object.  retries=0 is the control: no retry, so the call fails."""
    pid, uri = stalled_s3
    open_store(uri).put(KEY, b'{"v": 3}')  # setup under the default policy
    store = open_store(uri, timeout_s=1.0, retries=retries, backoff_s=1.0)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    if retries:
        assert store.get(KEY) == b'{"v": 3}'
        print(f"\nget succeeded after a resume during backoff in {time.monotonic() - t0:.2f} s")
        assert resume_on_retry.messages and f"get {KEY!r} attempt 1/4 failed" in resume_on_retry.messages[0]
    else:
        with pytest.raises(StoreError, match=r"get 'v/00000003/MANIFEST.json' failed after 1 attempt in"):
            store.get(KEY)
        assert resume_on_retry.messages == []


def test_s3_stores_get_socket_timeouts_and_no_inner_retries():
    store = open_store("s3://some-bucket/p", timeout_s=7, config_kwargs={"read_timeout": 99})
    cfg = store.fs.config_kwargs
    assert (cfg["connect_timeout"], cfg["read_timeout"], cfg["retries"]) == (7, 99, {"total_max_attempts": 1})
    assert store.fs.retries == 1 and store.policy.timeout_s == 7


# --- what is retried: a back end that fails on cue --------------------------------------

def _client_error(status: int, code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def _read_timeout():
    from botocore.exceptions import ReadTimeoutError

    return ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/k")


TRANSIENT = {
    "connection-reset": lambda: ConnectionResetError(errno.ECONNRESET, "reset"),
    "timeout": lambda: TimeoutError("slow"),
    "botocore-read-timeout": _read_timeout,
    "http-503-slowdown": lambda: _client_error(503, "SlowDown"),
    "s3fs-500-as-oserror": lambda: _caused(OSError(errno.EIO, "internal"), _client_error(500, "InternalError")),
    "throttling-400": lambda: _client_error(400, "ThrottlingException"),
}
PERMANENT = {
    "permission": lambda: PermissionError("denied"),
    "http-403": lambda: _client_error(403, "AccessDenied"),
    "s3fs-403-as-permission": lambda: _caused(PermissionError("denied"), _client_error(403, "AccessDenied")),
    "validation": lambda: ValueError("bad"),
    "unknown-oserror": lambda: OSError(errno.ENOSPC, "disk full"),
}


class _Flaky:
    """Stands in for ``fs.cat_file``: raises ``fails`` errors, then answers."""

    def __init__(self, make_error, fails: int):
        self.make_error, self.fails, self.calls = make_error, fails, 0

    def __call__(self, path):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.make_error()
        return b"data"


def _memory_store(retries: int):
    return open_store(f"memory://dcr-bounded-{uuid.uuid4().hex}", timeout_s=5, retries=retries, backoff_s=0)


@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_transient_failures_are_retried_up_to_the_bound(name, monkeypatch):
    assert is_transient(TRANSIENT[name]())
    ok = _memory_store(retries=2)
    flaky = _Flaky(TRANSIENT[name], fails=2)
    monkeypatch.setattr(ok.fs, "cat_file", flaky)
    assert ok.get("k") == b"data" and flaky.calls == 3
    short = _memory_store(retries=1)  # control: one retry is not enough for two failures
    flaky = _Flaky(TRANSIENT[name], fails=2)
    monkeypatch.setattr(short.fs, "cat_file", flaky)
    with pytest.raises(StoreError, match=r": get 'k' failed after 2 attempts in [0-9.]+ s: ") as e:
        short.get("k")
    assert flaky.calls == 2 and "\n" not in str(e.value) and "not retried" not in str(e.value)


@pytest.mark.parametrize("name", sorted(PERMANENT))
def test_permanent_failures_are_not_retried(name, monkeypatch):
    assert not is_transient(PERMANENT[name]())
    store = _memory_store(retries=4)
    flaky = _Flaky(PERMANENT[name], fails=1)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with pytest.raises(StoreError, match=r": get 'k' failed after 1 attempt in [0-9.]+ s \(not retried\): ") as e:
        store.get("k")
    assert flaky.calls == 1 and "\n" not in str(e.value)
    assert store.get("k") == b"data"  # control: the back end answers on the next call


def test_not_found_is_object_not_found_after_one_attempt(monkeypatch):
    store = _memory_store(retries=4)
    flaky = _Flaky(lambda: FileNotFoundError("k"), fails=1)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with pytest.raises(ObjectNotFound, match=r": get 'k': no such object$"):
        store.get("k")
    assert flaky.calls == 1
    store.put("k", b"x")  # control: a real object is found
    monkeypatch.undo()
    assert store.get("k") == b"x"


# --- the watchdog: a call that never returns --------------------------------------------

def test_a_hung_fsspec_call_is_cut_by_the_watchdog(monkeypatch):
    store = open_store(f"memory://dcr-hang-{uuid.uuid4().hex}", timeout_s=0.3, retries=1, backoff_s=0)
    store.put("k", b"x")
    assert store.get("k") == b"x"  # control
    release = threading.Event()
    monkeypatch.setattr(store.fs, "cat_file", lambda path: release.wait(60) and b"late")
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreError, match=r"get 'k' failed after 2 attempts .*no answer within 0.3 s \(watchdog\)"):
            store.get("k")
    finally:
        release.set()
    print(f"\nhung call cut after {time.monotonic() - t0:.2f} s")


def test_an_abandoned_local_put_publishes_nothing(tmp_path, monkeypatch):
    store = LocalDirStore(str(tmp_path / "s"), policy=StorePolicy(timeout_s=0.3, retries=0))
    store.put("v/00000001/MANIFEST.json", b"{}")  # control: a put that finishes is published
    assert store.get("v/00000001/MANIFEST.json") == b"{}"
    release = threading.Event()
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: release.wait(60) and real_write(fd, b))
    with pytest.raises(StoreError, match=r"put 'v/00000002/MANIFEST.json' failed after 1 attempt .*watchdog"):
        store.put("v/00000002/MANIFEST.json", b"{}")
    release.set()  # the abandoned attempt now finishes its write, and must not rename
    d = tmp_path / "s" / "v" / "00000002"
    deadline = time.monotonic() + 30
    while any(p.name.startswith(".tmp-") for p in d.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.undo()
    assert not store.exists("v/00000002/MANIFEST.json")
    assert list(d.iterdir()) == []


def test_store_calls_work_where_no_thread_can_start(tmp_path, monkeypatch):
    """Python >= 3.12 refuses new threads at interpreter shutdown ("can't create new thread
    at interpreter shutdown"), where the refit's exit settle still reads acks and writes the
    decision.  Simulated here by a Thread.start that raises as 3.12's does: the calls run on
    the calling thread and succeed.  Control: the same start raising without the fallback
    (calling the watchdog's thread directly) is the RuntimeError the exit settle hit."""
    store = LocalDirStore(str(tmp_path / "s"), policy=StorePolicy(timeout_s=5, retries=0))

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):  # control: a thread really cannot start
        threading.Thread(target=print).start()
    store.put("v/00000001/DECISION.json", b"{}")
    assert store.get("v/00000001/DECISION.json") == b"{}"
    assert store.stat("v/00000001/DECISION.json").size == 2
    with pytest.raises(ObjectNotFound):
        store.get("v/00000002/DECISION.json")
