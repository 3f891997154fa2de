"""``Runs.locate``: the one-run shortcut (a stacked expert slice) answers what the general
search does."""
import numpy as np

from nemo_dcr.receiver.traced import Runs


def _general(runs: Runs, pos: np.ndarray):
    r = np.searchsorted(runs.canon, pos, side="right") - 1
    return runs.owner[r], runs.dest[r] + (pos - runs.canon[r])


def test_one_run_shortcut_matches_the_search():
    one = Runs.compress("experts.gate_up_proj", np.arange(100, dtype=np.int64), np.arange(100, dtype=np.int64) + 4096)
    assert one.count == 1
    pos = np.array([0, 7, 99], dtype=np.int64)
    owner, dest = one.locate(pos)
    want_owner, want_dest = _general(one, pos)
    np.testing.assert_array_equal(owner, want_owner)
    np.testing.assert_array_equal(dest, want_dest)
    assert dest.tolist() == [4096, 4103, 4195]
    # control: two runs go through the search, and a shift of the first run's offset would be wrong there
    two = Runs.compress("w", np.arange(10, dtype=np.int64), np.concatenate([np.arange(5), np.arange(5) + 100]))
    assert two.count == 2
    owner2, dest2 = two.locate(np.array([3, 7], dtype=np.int64))
    assert dest2.tolist() == [3, 102] and dest2.tolist() != [3, 7]
