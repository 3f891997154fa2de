"""The run claim is atomic: of N trainers started on one fresh prefix at once, exactly
one owns it.

Twenty claimants (threads, each calling the product's ``claim_store``) are held at a
barrier after the last pre-check (every one saw an empty prefix), then create
``RUN.json`` one after another, each reading back before the next goes on: the worst
interleaving for a claim that writes and reads back.  On a directory store and on a
real S3-compatible server (moto on loopback) one claimant wins and ``RUN.json`` names it.
Negative control: the same lockstep with a plain ``put`` in place of the conditional
create (the claim as it was) lets every claimant "win".
"""
from __future__ import annotations

import os
import threading

import pytest

from nemo_dcr.protocol.manifest import RUN_KEY, RunRecord
from nemo_dcr.protocol.run import ForeignRunError, claim_store
from nemo_dcr.protocol.signing import Sealer, load_key, new_key_file
from nemo_dcr.transport.store import LocalDirStore, open_store

N = 20


class Lockstep:
    """``inner`` with every claimant held after its pre-checks (the ``snapshots/`` listing
    is the last) and the create + read-back of ``RUN.json`` run one claimant at a time.
    ``atomic=False``: the create is a plain ``put`` (the control)."""

    def __init__(self, inner, n: int, *, atomic: bool = True):
        self.inner, self.uri, self.atomic = inner, inner.uri, atomic
        self.barrier = threading.Barrier(n, timeout=60)
        self.turn = threading.Lock()
        self.mine = threading.local()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, prefix, *, limit=None):
        out = self.inner.list(prefix, limit=limit)
        if prefix == "snapshots/":
            self.barrier.wait()
        return out

    def put_if_absent(self, key, data):
        self.turn.acquire()
        self.mine.held = True
        if self.atomic:
            return self.inner.put_if_absent(key, data)
        self.inner.put(key, data)
        return True

    def get(self, key, *, max_bytes=None):
        try:
            return self.inner.get(key, max_bytes=max_bytes)
        finally:
            if key == RUN_KEY and getattr(self.mine, "held", False):
                self.mine.held = False
                self.turn.release()


def _race(store, sealer) -> tuple[list[str], list[str]]:
    won, lost = [], []

    def claimant():
        try:
            won.append(claim_store(store, sealer, "m").run_id)
        except ForeignRunError as e:
            lost.append(str(e))

    threads = [threading.Thread(target=claimant) for _ in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(won) + len(lost) == N
    return won, lost


@pytest.fixture
def sealer(tmp_path):
    return Sealer(load_key(new_key_file(str(tmp_path / "key"))))


def _one_winner(inner, sealer):
    won, lost = _race(Lockstep(inner, N), sealer)
    assert len(won) == 1, won
    assert RunRecord.from_json(inner.get(RUN_KEY), sealer).run_id == won[0]
    assert all("another run claimed the prefix at the same time" in e and won[0] in e for e in lost), lost[:2]
    # the winner resumes its claim; a loser's next try is refused as a foreign run
    assert claim_store(inner, sealer, "m", resume_run_id=won[0]).run_id == won[0]
    with pytest.raises(ForeignRunError, match=f"belongs to run {won[0]}"):
        claim_store(inner, sealer, "m")


def test_twenty_concurrent_claims_one_winner_on_a_directory(tmp_path, sealer):
    _one_winner(LocalDirStore(str(tmp_path / "store")), sealer)


def test_twenty_concurrent_claims_one_winner_on_s3(s3_bucket, sealer):
    _one_winner(open_store(s3_bucket + "/run", timeout_s=10, retries=1), sealer)


def test_control_a_plain_put_lets_every_claimant_win(tmp_path, sealer):
    inner = LocalDirStore(str(tmp_path / "store"))
    won, lost = _race(Lockstep(inner, N, atomic=False), sealer)
    assert len(won) == N and not lost  # the claim as it was: written, read back, "ours"
    assert RunRecord.from_json(inner.get(RUN_KEY), sealer).run_id == won[-1]


def test_put_if_absent_on_each_backend(tmp_path, s3_bucket):
    """The primitive: created once, refused (False, bytes unchanged) after."""
    for store in (LocalDirStore(str(tmp_path / "d")), open_store(s3_bucket + "/p", timeout_s=10, retries=1),
                  open_store(f"memory://dcr-{tmp_path.name}")):
        assert store.put_if_absent("a/RUN.json", b"one") is True
        assert store.put_if_absent("a/RUN.json", b"two") is False
        assert store.get("a/RUN.json") == b"one"
        assert store.list("a/") == ["a/RUN.json"]
    assert os.listdir(tmp_path / "d" / "a") == ["RUN.json"]  # the temporary file is gone
