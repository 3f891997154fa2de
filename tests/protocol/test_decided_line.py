"""The trainer's one line per decided version (rank 0, on stderr, ``sender/stats.decided_line``):
``nemo_dcr: v1 committed by r0 in 0.1 s, 1.2 kB``, or ``nemo_dcr: v2 aborted: r0 refused
(why) in 0.1 s, 1.2 kB``: the receivers that acked, the time from the manifest's publication
to the decision, and the version's chunk bytes on the wire (the manifest's).  The receiver's
decision event (its JSON log, ``protocol/follower.py``) carries the same as ``"line"``:
``v1 committed by r0 in 0.1 s, 1.2 kB`` (the seconds from its start on the manifest)."""
import re

import numpy as np
import torch
from protocol_helpers import Rx, _sender, _step, key  # noqa: F401 - key is a fixture

from nemo_dcr.events import size_text
from nemo_dcr.protocol.manifest import Manifest, manifest_key
from nemo_dcr.sender.stats import PublishStats, decided_line

RX_LINE = re.compile(r"^v(\d+) (committed by \S+|aborted \(.+\)) in (\d+\.\d) s, (\S+ \S+)$")
LINE = re.compile(r"^nemo_dcr: v(\d+) (committed by \S+|aborted: .+) in (\d+\.\d) s, (\S+ \S+)$")


def _decided_lines(err: str) -> dict[int, re.Match]:
    found = {}
    for line in err.splitlines():
        m = LINE.match(line)
        if m:
            assert int(m[1]) not in found, f"two lines for v{m[1]}"
            found[int(m[1])] = m
    return found


def test_one_line_per_decided_version_names_who_acked_or_refused(tmp_path, key, capfd):
    rng = np.random.default_rng(7)
    w = torch.randn(64, 32).to(torch.bfloat16)
    sender, store = _sender(tmp_path, {"w": w}, key, chunk_bytes=512, pipeline=True)
    rx = Rx("r0", store, key, sender.run_id, w, refuse={2}).start(until=3)
    for v in (1, 2, 3):
        _step(w, rng)
        sender.submit(v)
    assert sender.finish().committed
    rx.join()
    lines = _decided_lines(capfd.readouterr().err)
    assert sorted(lines) == [1, 2, 3], lines
    assert lines[1][2] == "committed by r0" and lines[3][2] == "committed by r0"
    assert lines[2][2].startswith("aborted: r0 refused (") and "refusing apply call 2" in lines[2][2]
    for v, m in lines.items():  # the bytes are the version's manifest's (every chunk on the wire)
        wire = Manifest.from_json(store.get(manifest_key(v))).wire_bytes
        assert m[4] == size_text(wire), (v, m[4], wire)
        assert 0.0 <= float(m[3]) < 20
    # the receiver's decision events carry the same summary (its JSON log: "line", "by")
    seen = {e["version"]: e for e in rx.events if "decision" in e}
    assert sorted(seen) == [1, 2, 3], seen
    for v, e in seen.items():
        rline = RX_LINE.match(e["line"])
        assert rline, e["line"]
        assert rline[4] == lines[v][4]  # the same chunk bytes as the trainer's line
    assert seen[1]["line"].startswith("v1 committed by r0 in ") and seen[1]["by"] == ["r0"]
    assert seen[2]["line"].startswith("v2 aborted (") and "refusing apply call 2" in seen[2]["line"]


def test_the_line_without_a_receiver_ack_keeps_the_coordinators_reason():
    st = PublishStats(version=4, base_version=3, wire_bytes=5_100_000, members=("r0", "r1"),
                      acks=[{"receiver": "r1", "ok": False, "error": "wrong model id"}])
    line = decided_line(st, False, "r1: wrong model id; r0: no acknowledgement within 2.0s", 1.25)
    assert line == ("nemo_dcr: v4 aborted: r1 refused (wrong model id); r0: no acknowledgement within 2.0s "
                    "in 1.2 s, 5.1 MB")
    st.acks = [{"receiver": "r0", "ok": True}, {"receiver": "r1", "ok": True}]
    assert decided_line(st, True, "", 0.5) == "nemo_dcr: v4 committed by r0,r1 in 0.5 s, 5.1 MB"
    assert (decided_line(st, False, "rank 1: StoreError: down", None)
            == "nemo_dcr: v4 aborted: rank 1: StoreError: down, 5.1 MB")
    assert [size_text(n) for n in (0, 999, 1000, 33_696, 12_600_000_000)] == ["0 B", "999 B", "1.0 kB", "33.7 kB",
                                                                             "12.6 GB"]
