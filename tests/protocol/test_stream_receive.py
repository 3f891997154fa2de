"""Streaming receive (receiver/stream.py): a receiver fetches and decodes the chunks of the
next version as they land, before the signed manifest, and uses them only where the
manifest lists the same bytes.

The trainer is a real RefitSender (one upload thread, so chunks land one by one and the
manifest last); its store is wrapped so that after every chunk put the receiver's
follower takes its steps on that thread (the receiver runs nowhere else then), and what
it had prefetched is recorded together with whether the manifest existed.  Just before
the manifest is written (``before_manifest``) the receiver's own thread starts and runs
the protocol as usual.  What happened is proved by those records and the ack's counters,
not by timing; every end state is compared with the trainer's bits as integer views,
with a perturbed negative control.
"""
import dataclasses
import threading

import numpy as np
import pytest
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.codec import DeltaOp, TensorDelta, encode_chunk
from nemo_dcr.protocol.manifest import Ack, chunk_key, manifest_key
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver.fetch import admission_cap
from nemo_dcr.receiver.stream import MAX_STRIDE, candidates
from nemo_dcr.transport.store import LocalDirStore


class SteppingStore:
    """The trainer's store.  After each chunk put, ``follower`` steps until it has nothing
    to do; ``puts`` records, per chunk, whether the manifest existed and whether the
    receiver then held the chunk prefetched.  ``after_chunk(n)`` runs after the n-th."""

    def __init__(self, inner: LocalDirStore):
        self.inner = inner
        self.follower = None
        self.after_chunk = None
        self.puts: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        if self.follower is None or "/chunks/" not in key:
            return
        _idle(self.follower)
        version = int(key.split("/")[1])
        state = self.follower.rx._stream
        self.puts.append({"key": key, "manifest": self.inner.exists(manifest_key(version)),
                          "prefetched": state is not None and key in state.ready,
                          "ready": 0 if state is None else len(state.ready)})
        if self.after_chunk is not None:
            self.after_chunk(len(self.puts))


def _idle(follower) -> int:
    """Step ``follower`` until it has nothing to do, waiting for the prefetch's downloads
    (they run on the stream state's own threads); returns the chunks decoded meanwhile.  A
    chunk whose decode ended before the follower's own poll collected it counts in
    ``follower.prefetched``, not in ``drain``'s result (a race a loaded machine lost)."""
    decoded, before = 0, follower.prefetched
    while True:
        while follower.step():
            decoded += 1
        state = follower.rx._stream
        if state is None or not state.in_flight:
            return decoded + follower.prefetched - before
        decoded += state.drain()


def _setup(tmp_path, key, *, seed=0):
    rng = np.random.default_rng(seed)
    w = torch.randn(64, 32).to(torch.bfloat16)
    inner = LocalDirStore(str(tmp_path / "store"))
    writer = SteppingStore(inner)
    sender, _ = _sender(tmp_path, {"w": w}, key, store=writer, chunk_bytes=128, upload_workers=1)
    rx = Rx("r0", inner, key, sender.run_id, w)
    writer.follower = rx.follower
    return rng, w, inner, writer, sender, rx


def _refit(sender, rx, version):
    stats = sender.refit(version, before_manifest=lambda m: rx.start(until=version))
    rx.join()
    return stats


def _ack(store, key, version) -> Ack:
    return Ack.from_json(store.get(f"acks/r0/{version:08d}.json"), Sealer(load_key(key)))


def _assert_bit_exact(rx, w):
    got, want = rx.w.view(np.int16), bits_of(w).view(np.int16)
    assert got.dtype == want.dtype
    assert np.array_equal(got, want)
    perturbed = want.copy()
    perturbed[7] ^= 1
    assert not np.array_equal(got, perturbed)  # negative control: one flipped bit is seen


def _plant(store, version, rank, seq, run_id, held, *, base_version="0", flip=(3, 9, 11)):
    """A well-formed chunk under ``version``'s chunks/ that flips ``flip`` of ``canon.w``,
    as a key-less store writer could put it there (returns its key)."""
    pos = np.asarray(flip, dtype=np.int64)
    d = TensorDelta(name="canon.w", dtype="bfloat16", shape=(64, 32), op=DeltaOp.XOR, positions=pos,
                    values=np.full(pos.size, 0x0101, dtype=np.uint16))
    meta = {"run_id": run_id, "model_id": "m", "version": str(version), "base_version": base_version, "rank": "0"}
    k = chunk_key(version, rank, seq)
    store.put(k, encode_chunk([d], meta=meta, base={"canon.w": held.copy()}))
    return k


def test_chunks_are_decoded_before_the_manifest_and_used_after_it(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    for version in (1, 2):  # the second on top of the first: a fresh prefetch state per held version
        writer.puts.clear()
        before = rx.w.copy()
        _step(w, rng)
        stats = _refit(sender, rx, version)
        assert stats.committed and stats.chunks > 2
        # every chunk was fetched and decoded while the manifest did not exist yet
        assert len(writer.puts) == stats.chunks
        assert all(p["prefetched"] and not p["manifest"] for p in writer.puts)
        ack = _ack(inner, key, version)
        assert ack.ok and ack.stats["stream"] is True
        assert ack.stats["prefetch_used_chunks"] == stats.chunks == ack.stats["prefetched_chunks"]
        assert ack.stats["prefetch_used_bytes"] == stats.wire_bytes
        assert ack.stats["prefetch_unlisted"] == ack.stats["prefetch_mismatched"] == 0
        assert rx.rx._stream is None  # dropped with the apply
        _assert_bit_exact(rx, w)
        assert not np.array_equal(before.view(np.int16), rx.w.view(np.int16))  # the version changed bits


def test_without_streaming_nothing_is_fetched_before_the_manifest(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    rx.rx.cfg = dataclasses.replace(rx.rx.cfg, stream=False)
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    assert stats.committed and writer.puts and not any(p["prefetched"] for p in writer.puts)
    ack = _ack(inner, key, 1)
    assert ack.stats["stream"] is False and ack.stats["prefetch_used_chunks"] == 0
    assert "prefetched_chunks" not in ack.stats
    _assert_bit_exact(rx, w)


def test_a_planted_chunk_the_manifest_does_not_list_is_dropped(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    v0 = bits_of(w)
    planted = _plant(inner, 1, 7, 0, sender.run_id, v0)
    assert _idle(rx.follower)  # prefetched (header fine: right run, model, version and base)
    assert planted in rx.rx._stream.ready
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    ack = _ack(inner, key, 1)
    assert stats.committed and ack.stats["prefetch_unlisted"] == 1
    assert ack.stats["prefetch_used_chunks"] == stats.chunks
    _assert_bit_exact(rx, w)
    # control: the planted chunk would have changed the result had it been applied
    flipped = bits_of(w).copy()
    flipped[[3, 9, 11]] ^= 0x0101
    assert not np.array_equal(flipped.view(np.int16), rx.w.view(np.int16))


def test_a_prefetched_chunk_with_other_bytes_than_the_manifest_is_fetched_again(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    # planted under the key the trainer's first chunk will take: prefetched, then replaced
    planted = _plant(inner, 1, 0, 0, sender.run_id, bits_of(w))
    assert _idle(rx.follower) and planted in rx.rx._stream.ready
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    assert writer.puts[0]["key"] == planted  # the trainer's put replaced it; already seen, not prefetched again
    ack = _ack(inner, key, 1)
    assert stats.committed and ack.stats["prefetch_mismatched"] == 1
    assert ack.stats["prefetch_used_chunks"] == stats.chunks - 1  # the rest came from the prefetch
    _assert_bit_exact(rx, w)


def test_a_chunk_claiming_another_base_is_dropped_at_prefetch(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    planted = _plant(inner, 1, 0, 0, sender.run_id, bits_of(w), base_version="5")
    assert not _idle(rx.follower)  # listed and fetched, refused by its header: nothing decoded
    state = rx.rx._stream
    assert planted in state.seen and planted not in state.ready and state.rejected == 1
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    ack = _ack(inner, key, 1)
    assert stats.committed and ack.stats["prefetch_rejected"] == 1
    assert ack.stats["prefetch_used_chunks"] == stats.chunks - 1  # its key: fetched after the manifest
    _assert_bit_exact(rx, w)


def test_prefetch_over_the_byte_cap_stops_and_the_version_still_applies(tmp_path, key):
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    cap = admission_cap(rx.runtime.tensor_specs())
    big = chunk_key(1, 999, 99999)  # sorts after the trainer's keys
    writer.after_chunk = lambda n: inner.put(big, b"\0" * (cap + 1)) if n == 1 else None
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    assert stats.committed and stats.chunks > 3
    assert writer.puts[0]["prefetched"]  # before the big object appeared
    ready = [p["ready"] for p in writer.puts]
    assert ready[2:] == [ready[1]] * (len(ready) - 2)  # stopped: nothing prefetched after the cap
    ack = _ack(inner, key, 1)
    assert "exceed" in ack.stats["prefetch_stopped"]
    assert 1 <= ack.stats["prefetch_used_chunks"] < stats.chunks
    _assert_bit_exact(rx, w)


def test_the_prefetch_state_goes_when_the_held_bits_change(tmp_path, key):
    """A rollback (abort) writes the runtime: what was decoded before it is never used."""
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    planted = _plant(inner, 1, 5, 0, sender.run_id, bits_of(w))
    assert _idle(rx.follower)
    state = rx.rx._stream
    assert planted in state.ready
    rx.rx._writes += 1  # as apply and undo do before writing
    _idle(rx.follower)
    fresh = rx.rx._stream
    assert fresh is not state and fresh.generation == state.generation + 1
    assert fresh.ready[planted] is not state.ready[planted]  # decoded again, against the bits held now


@pytest.mark.parametrize("handled,stride,top,want", [
    (0, 1, 0, [1]),
    (4, 3, 4, [5, 6, 7]),
    (4, 1, 5, [5, 6]),  # v5's chunks seen but no manifest yet: v6 is looked at too
    (10, 20, 10, [*range(11, 11 + MAX_STRIDE), 30]),
])
def test_candidates(handled, stride, top, want):
    assert candidates(handled, stride, top) == want


def test_receive_cli_no_stream(tmp_path, key):
    from nemo_dcr.receiver.cli import check_input, parser

    base = ["--store", str(tmp_path / "s"), "--receiver-id", "r0", "--model-id", "m", "--key-file", key]
    assert check_input(parser().parse_args(base))[2].stream is True
    assert check_input(parser().parse_args([*base, "--no-stream"]))[2].stream is False


class LyingSizes:
    """The receiver's store, with a listing that lies about every chunk's size by ``shift``
    bytes (as a relay or a planted listing could)."""

    def __init__(self, inner, shift):
        self.inner, self.shift, self.lied = inner, shift, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list_sizes(self, prefix, *, limit=None):
        out = []
        for k, size in self.inner.list_sizes(prefix, limit=limit):
            self.lied += "/chunks/" in k
            out.append((k, max(0, size + self.shift) if "/chunks/" in k else size))
        return out


@pytest.mark.parametrize("shift", [-1, 1000])
def test_a_listing_that_lies_about_sizes_costs_a_fetch_again_never_an_apply(tmp_path, key, shift):
    """A listed size bounds the prefetch's read and nothing else.  Under the real size the
    read is refused (the chunk is fetched after the manifest against its signed size and
    digest); over it, the real bytes are read and checked against the signed digest before
    use.  Either way the version applies bit for bit.  Control: the lie was told, and the
    undersized reads did fail at prefetch (nothing of them was used)."""
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    rx.rx.store = liar = LyingSizes(inner, shift)
    _step(w, rng)
    stats = _refit(sender, rx, 1)
    assert stats.committed and liar.lied >= stats.chunks
    ack = _ack(inner, key, 1)
    assert ack.ok
    if shift < 0:
        assert ack.stats["prefetch_failed"] == stats.chunks and ack.stats["prefetch_used_chunks"] == 0
    else:
        assert ack.stats["prefetch_used_chunks"] == stats.chunks and ack.stats["prefetch_mismatched"] == 0
    _assert_bit_exact(rx, w)


class HeldGets:
    """The receiver's store, with the ``get`` of any key in ``hold`` blocked until
    ``release`` is set (a slow download, made deterministic)."""

    def __init__(self, inner):
        self.inner, self.hold, self.release = inner, set(), threading.Event()
        self.started: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, **kw):
        if key in self.hold:
            self.started.append(key)
            assert self.release.wait(timeout=20)
        return self.inner.get(key, **kw)


def test_downloads_run_ahead_of_the_follower_and_the_manifest_waits_only_for_started_ones(tmp_path, key):
    """The follower's step only starts downloads: it returns while one is still running (its
    ``get`` is blocked).  At the manifest, a listed chunk whose download started is waited
    for and used; those queued behind it (one fetch thread) are cancelled and fetched by
    the normal path.  Control: the blocked chunk really was in flight when the step returned."""
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    writer.follower = None  # this test steps the receiver itself
    rx.rx.cfg = dataclasses.replace(rx.rx.cfg, fetch_threads=1)
    rx.rx.store = slow = HeldGets(inner)
    rx.rx.before_fetch = lambda manifest: slow.release.set()  # the manifest is read: let the download finish
    seen = {}

    def before_manifest(manifest):
        slow.hold.add(manifest.chunks[0].key)
        assert not rx.follower.step()  # listed every chunk, started one download, decoded nothing
        state = rx.rx._stream
        seen.update(in_flight=state.in_flight, started=list(slow.started), ready=len(state.ready),
                    released=slow.release.is_set())
        rx.start(until=manifest.version)

    _step(w, rng)
    stats = sender.refit(1, before_manifest=before_manifest)
    rx.join()
    assert stats.committed and stats.chunks > 2
    assert seen["in_flight"] == stats.chunks and seen["ready"] == 0 and not seen["released"]
    ack = _ack(inner, key, 1)
    assert ack.stats["prefetch_awaited"] == 1 and ack.stats["prefetch_used_chunks"] == 1
    assert ack.stats["prefetch_not_started"] == stats.chunks - 1
    _assert_bit_exact(rx, w)


def test_a_download_running_when_the_held_bits_change_is_never_decoded(tmp_path, key):
    """A write closes the prefetch state while one of its downloads is running; that chunk
    is never decoded into it, and the next state fetches and decodes it again against the
    bits held now.  Control: the old state did start the download, and it ended."""
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    rx.rx.store = slow = HeldGets(inner)
    planted = _plant(inner, 1, 5, 0, sender.run_id, bits_of(w))
    slow.hold.add(planted)
    assert not rx.follower.step()
    old = rx.rx._stream
    assert old.in_flight == 1 and slow.started == [planted]
    running = old._inflight[planted]
    rx.rx._writes += 1  # as apply and undo do before writing
    rx.follower.step()
    assert old.in_flight == 0 and rx.rx._stream is not old  # closed with the write
    slow.release.set()
    assert running.result(timeout=20) is False and not old.ready  # downloaded, then dropped undecoded
    assert rx.rx._stream.drain() == 1
    assert planted in rx.rx._stream.ready
    assert slow.started == [planted, planted]


def test_close_waits_for_a_decode_that_reads_the_held_bits(tmp_path, key):
    """Decodes run on the state's threads and read the held bits; ``close`` (called before
    every write) returns only once the decode running has ended.  Control: while the decode
    is held inside its read of the held bits, ``close`` has not returned."""
    rng, w, inner, writer, sender, rx = _setup(tmp_path, key)
    planted = _plant(inner, 1, 5, 0, sender.run_id, bits_of(w))
    served, entered, release = rx.rx.served, threading.Event(), threading.Event()
    real = served.canonical_bits

    def held_back(name):
        entered.set()
        assert release.wait(20)
        return real(name)

    served.canonical_bits = held_back
    rx.follower.step()
    assert entered.wait(20)  # a decode is reading the held bits
    state = rx.rx._stream
    closer = threading.Thread(target=state.close, daemon=True)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # waiting for the decode
    release.set()
    closer.join(20)
    assert not closer.is_alive() and planted in state.ready
