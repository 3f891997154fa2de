"""Request accounting (``transport/store/meter.py``) and the requests a version costs.

A real RefitSender and a receiver (Receiver + Follower, streaming on) on a real
S3-compatible server (moto on loopback), each with its own client.  Proved by the counters
the sender's stats and the receiver's ack carry, every end state compared bit for bit:

* the receiver reads each chunk with one request: one bounded ``get`` (a ranged ``GET``,
  no ``HEAD``), its size taken from the listing (no ``stat`` per chunk);
* the sender puts each chunk once and writes one manifest, ``HEAD.json`` and decision.

Through a relay (whose listing passes S3's sizes on) the receiver's count is the same.
Control: the same receiver on a store whose listing carries no sizes (a wrapper without
``list_sizes``) asks a ``stat`` per chunk it prefetches, and the counters show it.
"""
import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.protocol.keys import key_kind
from nemo_dcr.transport.store import list_sizes, open_store
from nemo_dcr.transport.store.meter import RequestMeter, combined, diff


class NoSizes:
    """A store whose listing carries no sizes (``list_sizes`` is not forwarded)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "list_sizes":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _run(tmp_path, key, store_uri, *, wrap=None, versions=(1, 2), rx_uri=None):
    rng = np.random.default_rng(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, store=open_store(store_uri), chunk_bytes=128, upload_workers=1)
    rx_store = open_store(rx_uri or store_uri)
    rx = Rx("r0", wrap(rx_store) if wrap else rx_store, key, sender.run_id, w)
    out = []
    for version in versions:
        _step(w, rng)
        rx.start(until=version)
        stats = sender.refit(version)
        rx.join()
        assert stats.committed
        got, want = rx.w.view(np.int16), bits_of(w).view(np.int16)
        assert np.array_equal(got, want)
        perturbed = want.copy()
        perturbed[5] ^= 1
        assert not np.array_equal(got, perturbed)  # negative control: one flipped bit is seen
        ack = [e for e in rx.events if e.get("version") == version and "ok" in e][-1]
        out.append((stats, ack))
    return out


def test_a_version_costs_one_request_per_chunk_on_each_side(tmp_path, key, s3_bucket):
    for i, (stats, ack) in enumerate(_run(tmp_path, key, s3_bucket + "/run")):
        sent, got = stats.requests["calls"], ack["requests"]["calls"]
        assert stats.chunks > 2
        assert sent["put:chunk"]["n"] == stats.chunks and sent["put:chunk"]["bytes"] == stats.wire_bytes
        assert sent["put:chunk"]["attempts"] == stats.chunks  # nothing retried on loopback
        assert (sent["put:manifest"]["n"], sent["put:head"]["n"], sent["put:decision"]["n"]) == (1, 1, 1)
        assert "stat:chunk" not in sent and "get:chunk" not in sent
        # the receiver: each chunk read once, with one bounded get, sizes from the listing
        assert got["get:chunk"]["n"] == stats.chunks and got["get:chunk"]["bytes"] == stats.wire_bytes
        assert "stat:chunk" not in got
        assert got["get:manifest"]["n"] == 1
        # counted since the previous answer: that answer's ack is in, this one's is not yet
        assert got.get("put:ack", {"n": 0})["n"] == (1 if i else 0)


def test_control_a_listing_without_sizes_costs_a_stat_per_prefetched_chunk(tmp_path, key, s3_bucket):
    for stats, ack in _run(tmp_path, key, s3_bucket + "/run", wrap=NoSizes, versions=(1,)):
        got = ack["requests"]["calls"]
        assert got["get:chunk"]["n"] == stats.chunks
        prefetched = ack["prefetched_chunks"] + ack.get("prefetch_failed", 0)
        assert got.get("stat:chunk", {}).get("n", 0) == prefetched
        assert prefetched > 0  # the control means something only if chunks were prefetched
    store = open_store(str(tmp_path / "local"))
    store.put("v/00000001/chunks/r000-00000.dcr", b"x" * 7)
    assert list_sizes(NoSizes(store), "v/00000001/chunks/") == [("v/00000001/chunks/r000-00000.dcr", None)]
    assert list_sizes(store, "v/00000001/chunks/") == [("v/00000001/chunks/r000-00000.dcr", 7)]


def test_through_a_relay_a_chunk_costs_one_request_too(tmp_path, key, s3_bucket):
    """A relay's listing passes the sizes of S3's on: the receiver reads each chunk with one
    ``get`` through the relay, no ``stat``; the relay itself lists and reads S3 (each chunk
    once).  The control above is the same receiver on a listing without sizes."""
    from nemo_dcr.transport.relay import RelayThread

    with RelayThread(open_store(s3_bucket + "/run")) as relay:
        for stats, ack in _run(tmp_path, key, s3_bucket + "/run", rx_uri=relay.uri):
            got = ack["requests"]["calls"]
            assert got["get:chunk"]["n"] == stats.chunks and got["get:chunk"]["bytes"] == stats.wire_bytes
            assert "stat:chunk" not in got and ack["prefetched_chunks"] > 0
        s = relay.stats()
        assert s["upstreams"][0]["chunk_bytes_read"] > 0


def test_the_s3_listing_gives_sizes_and_tags_without_a_head(s3_bucket):
    store = open_store(s3_bucket + "/p")
    for i, n in enumerate((3, 0, 11)):
        store.put(f"v/00000002/chunks/r000-{i:05d}.dcr", b"z" * n)
    before = store.meter.snapshot()
    infos = store.list_info("v/00000002/chunks/")
    assert [(i.key.rsplit("/", 1)[1], i.size) for i in infos] == [("r000-00000.dcr", 3), ("r000-00001.dcr", 0),
                                                                  ("r000-00002.dcr", 11)]
    assert infos == [store.stat(i.key) for i in infos]  # the same identity a HEAD gives
    asked = diff(store.meter.snapshot(), before)["requests"]
    assert {k: v["n"] for k, v in asked.items()} == {"find": 1, "info": 3}  # one listing; the HEADs are the stats above
    assert store.list_info("v/00000002/chunks/", limit=2) == infos[:2]


@pytest.mark.parametrize("key_, kind", [
    ("v/00000003/chunks/r001-00000.dcr", "chunk"), ("v/00000003/chunks/", "chunk"),
    ("v/00000003/MANIFEST.json", "manifest"), ("v/00000003/DECISION.json", "decision"),
    ("v/00000003/dense.safetensors", "dense"), ("HEAD.json", "head"), ("COMMITTED.json", "committed"),
    ("acks/r0/00000003.json", "ack"), ("acks/join.d/r0.json", "join"), ("RUN.json", "run"),
    ("init/model.safetensors", "init"), ("snapshots/v00000040/SNAPSHOT.json", "snapshot"),
    ("v/00000003/", "other"), ("planted", "other"), ("planted/chunks/x", "chunk"),
])
def test_key_kinds(key_, kind):
    assert key_kind(key_) == kind


def test_meter_sums_and_differences():
    m = RequestMeter()
    m.call("get", "HEAD.json", attempts=1, seconds=0.5, nbytes=10)
    snap = m.snapshot()
    m.call("get", "HEAD.json", attempts=3, seconds=0.25, nbytes=4)
    m.call("list", "v/00000001/chunks/", attempts=1, seconds=0.1)
    d = diff(m.snapshot(), snap)
    assert d["calls"] == {"get:head": {"n": 1, "attempts": 3, "s": 0.25, "bytes": 4},
                          "list:chunk": {"n": 1, "attempts": 1, "s": 0.1, "bytes": 0}}
    both = combined([snap, m.snapshot()])
    assert both["calls"]["get:head"]["n"] == 3 and both["calls"]["get:head"]["bytes"] == 24
    assert m.snapshot()["calls"]["get:head"] == {"n": 2, "attempts": 4, "s": 0.75, "bytes": 14}

