"""FailoverStore: an ordered upstream list behind one ObjectStore (re-parenting).

Upstreams are real directory stores; a "down" upstream is a directory store whose every
call raises (a wrapper, since a dead directory cannot be made to time out on demand; the
relay tests kill and stop real relay processes)."""
from __future__ import annotations

import hashlib

import pytest

from nemo_dcr.errors import ValidationError
from nemo_dcr.transport.failover import FailoverStore, VerificationFailed, fetch_verified
from nemo_dcr.transport.store import LocalDirStore, ObjectNotFound, StoreError, open_store

KEY = "v/00000001/chunks/r000-00000.dcr"


class Down:
    """An upstream that fails every call as a dead relay does (a StoreError)."""

    is_relay = True

    def __init__(self, uri: str):
        self.uri = uri
        self.calls = 0

    def _fail(self, *a, **k):
        self.calls += 1
        raise StoreError(f"{self.uri}: connection refused", uri=self.uri, op="get")

    get = get_with_info = stat = exists = list = put = delete = _fail


def _digest_check(want: bytes):
    good = hashlib.sha256(want).hexdigest()
    return lambda blob: None if hashlib.sha256(blob).hexdigest() == good else "digest mismatch"


@pytest.fixture
def origin(tmp_path):
    s = LocalDirStore(str(tmp_path / "origin"))
    s.put(KEY, b"good bytes" * 100)
    s.put("HEAD.json", b"{}")
    return s


def test_reads_fail_over_to_the_next_upstream_and_count_bytes(origin):
    dead = Down("relay://127.0.0.1:1")
    fs = FailoverStore([dead, origin])
    assert fs.get(KEY) == b"good bytes" * 100
    assert dead.calls == 1
    stats = {s["uri"]: s for s in fs.upstream_stats()}
    assert stats[dead.uri]["failures"] == 1 and stats[dead.uri]["bytes_read"] == 0
    assert stats[origin.uri]["chunk_bytes_read"] == 1000 and stats[origin.uri]["current"]
    assert fs.origin_chunk_bytes() == 1000
    # the failed upstream rests: the next call goes straight to the origin
    fs.get("HEAD.json")
    assert dead.calls == 1
    assert fs.origin_chunk_bytes() == 1000  # HEAD.json is not a chunk


def test_a_bounded_list_fails_over_with_its_limit(origin):
    origin.put("acks/join.d/a.json", b"{}")
    origin.put("acks/join.d/b.json", b"{}")
    dead = Down("relay://127.0.0.1:1")
    fs = FailoverStore([dead, origin])
    assert fs.list("acks/join.d/", limit=1) == ["acks/join.d/a.json"] and dead.calls == 1
    assert fs.list("acks/join.d/") == ["acks/join.d/a.json", "acks/join.d/b.json"]  # control: no limit


def test_a_rested_upstream_is_preferred_again(origin, tmp_path):
    now = [0.0]
    first = LocalDirStore(str(tmp_path / "first"))
    first.put(KEY, b"good bytes" * 100)
    flaky = Down("relay://a:1")
    fs = FailoverStore([flaky, first, origin], retry_after_s=10.0, clock=lambda: now[0])
    fs.get(KEY)
    assert fs.current is first
    now[0] = 11.0
    assert fs.current is flaky  # the list's order is the tree's shape: heal back


def test_a_repeat_liar_rests_twice_as_long_each_time(origin, tmp_path):
    """Each lie within STRIKE_MEMORY rests of the last rest doubles the rest (10, 20, 40 s
    ... up to MAX_REST_S); a lie long after is a first one again (10 s).  Control: a
    failure (not a lie) always rests retry_after_s."""
    from nemo_dcr.transport.failover import MAX_REST_S, STRIKE_MEMORY

    now = [0.0]
    liar = LocalDirStore(str(tmp_path / "liar"))
    fs = FailoverStore([liar, origin], retry_after_s=10.0, clock=lambda: now[0])
    rests = []
    for _ in range(10):
        fs.demote(liar.uri, "an ack it did not forward")
        fs.demote(liar.uri, "the same lie seen again while it rests")  # not a new strike
        rests.append(fs._stats[0].down_until - now[0])
        now[0] = fs._stats[0].down_until + 1.0  # preferred again, lies again at once
    assert rests == [10, 20, 40, 80, 160, 320, 640, 1280, 2560, MAX_REST_S]
    now[0] += STRIKE_MEMORY * MAX_REST_S + 1  # a long honest spell: forgiven
    fs.demote(liar.uri, "a lie much later")
    assert fs._stats[0].down_until - now[0] == 10
    now[0] = fs._stats[0].down_until + 1.0
    flaky = Down("relay://a:1")
    fs2 = FailoverStore([flaky, origin], retry_after_s=10.0, clock=lambda: now[0])
    origin.put("k", b"x")
    for _ in range(3):  # control: failures do not escalate
        fs2.get("k")
        assert fs2._stats[0].down_until - now[0] == 10
        now[0] += 11


def test_answers_are_not_failures(origin, tmp_path):
    other = LocalDirStore(str(tmp_path / "other"))
    fs = FailoverStore([other, origin])
    with pytest.raises(ObjectNotFound):
        fs.get(KEY)  # absent on the first upstream is the answer for plain reads
    assert fs.upstream_stats()[0]["failures"] == 0
    assert fs.stat("nothing") is None


def test_bad_bytes_demote_the_upstream_and_the_next_serves(origin, tmp_path):
    liar = LocalDirStore(str(tmp_path / "liar"))
    liar.put(KEY, b"GOOD bytes" * 100)  # same size, one byte flipped per repeat
    fs = FailoverStore([liar, origin])
    check = _digest_check(b"good bytes" * 100)
    assert fetch_verified(fs, KEY, max_bytes=1000, check=check) == b"good bytes" * 100
    stats = fs.upstream_stats()
    assert stats[0]["bad_bytes"] == 1 and stats[1]["current"]
    # negative control: the liar alone cannot make a caller accept its bytes
    with pytest.raises(VerificationFailed, match="digest mismatch"):
        fetch_verified(liar, KEY, max_bytes=1000, check=check)
    with pytest.raises(VerificationFailed, match="no upstream served good bytes"):
        fetch_verified(FailoverStore([liar]), KEY, max_bytes=1000, check=check)


def test_a_relay_that_lost_the_object_is_left_for_the_next(origin, tmp_path):
    empty = LocalDirStore(str(tmp_path / "empty"))  # e.g. a relay restarted with an empty spool
    fs = FailoverStore([empty, origin])
    assert fetch_verified(fs, KEY, max_bytes=1000, check=_digest_check(b"good bytes" * 100)) == b"good bytes" * 100


def test_every_upstream_down_is_one_store_error(tmp_path):
    fs = FailoverStore([Down("relay://a:1"), Down("relay://b:1")])
    with pytest.raises(StoreError, match="failed on every upstream"):
        fs.get(KEY)


def test_open_store_parses_upstream_lists(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fs = open_store(f"{a},{b}", timeout_s=2.0, retries=0)
    assert isinstance(fs, FailoverStore) and [s.uri for s in fs.stores] == [a, b]
    assert all(s.policy.timeout_s == 2.0 and s.policy.retries == 0 for s in fs.stores)
    fs = open_store(f"{a},{b}")  # no policy given: the parent gets the hop policy, the last the default
    assert fs.stores[0].policy.timeout_s == 5.0 and fs.stores[0].policy.retries == 1
    assert fs.stores[1].policy.timeout_s == 30.0 and fs.stores[1].policy.retries == 4
    for bad in (f"{a},,{b}", f"{a},{a}", f"{a},"):
        with pytest.raises(ValidationError):
            open_store(bad)
