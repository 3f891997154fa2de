"""``refit.coding=auto`` in one sender process (no process group) with a receiver thread: the
choice is measured and carried to the next version, every version stays bit-exact whatever
coding it used, and a choice that fails keeps the coding in use without failing the version."""
import numpy as np
import torch
from protocol_helpers import Rx, _sender, _step, bits_of, key  # noqa: F401 - key is a fixture

from nemo_dcr.codec import Coding, read_chunk_index
from nemo_dcr.sender.coding_choice import CODINGS, CodingChooser
from nemo_dcr.protocol.manifest import Manifest, manifest_key
from nemo_dcr.protocol.signing import Sealer, load_key


def _codings_of(store, key, version):
    m = Manifest.from_json(store.get(manifest_key(version)), Sealer(load_key(key)))
    infos = [i for c in m.chunks for i in read_chunk_index(store.get(c.key)).records]
    return {i.coding for i in infos}, any(i.context for i in infos)


class Scripted(CodingChooser):
    """The real chooser (probe, observations, projections), its choices scripted."""

    script: list = []

    def choose(self, current):
        _, projections = super().choose(current)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step, projections


def test_auto_carries_each_choice_to_the_next_version_and_stays_bit_exact(tmp_path, key):
    rng = np.random.default_rng(0)
    w = torch.randn(256, 64).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=2048, coding="auto")
    chooser = Scripted(encode_parallel=1)
    chooser.script = ["fast", RuntimeError("injected: the choice broke"), "plain", "context"]
    sender.coding.chooser = chooser
    rx = Rx("r0", store, key, sender.run_id, w).start(until=5)
    used, walls = [], []
    for v in range(1, 6):
        _step(w, rng)
        stats = sender.refit(v)
        assert stats.committed, stats.reason  # the failed choice at v2 did not fail the version
        used.append((stats.coding, stats.next_coding))
        walls.append(sorted(stats.coding_walls))
    rx.join()
    # v1 starts at context; v2's choice failed, so v3 keeps v2's coding; the script runs out at v5
    assert used[:4] == [("context", "fast"), ("fast", "fast"), ("fast", "plain"), ("plain", "context")]
    assert used[4][0] == "context"
    assert walls[0] == sorted(CODINGS) and walls[1] == []  # projected from v1 on (the probe ran at v1)
    assert not chooser.needs_probe
    assert np.array_equal(rx.w, bits_of(w))  # every version applied bit for bit, integer views
    flipped = rx.w.copy()
    flipped[0] ^= 1
    assert not np.array_equal(flipped, bits_of(w))  # negative control
    assert _codings_of(store, key, 1)[1] and not _codings_of(store, key, 2)[1]  # context, then context-free
    assert _codings_of(store, key, 2)[0] <= {Coding.SPARSE_ZSTD, Coding.SPARSE_RAW, Coding.DENSE_RAW}
    assert Coding.SPARSE_ZSTD in _codings_of(store, key, 3)[0]


def test_a_fixed_coding_never_runs_the_chooser(tmp_path, key):
    rng = np.random.default_rng(1)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, coding="plain")
    rx = Rx("r0", store, key, sender.run_id, w).start(until=2)
    for v in (1, 2):
        _step(w, rng)
        stats = sender.refit(v)
        assert (stats.coding, stats.next_coding, stats.coding_walls) == ("plain", "plain", {})
    rx.join()
    assert sender.coding.chooser is None and sender.coding.probe_sample is None
    assert not _codings_of(store, key, 1)[1]  # control: plain is context-free
    assert np.array_equal(rx.w, bits_of(w))
