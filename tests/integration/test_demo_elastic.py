"""The demo with elastic membership (``refit.membership=elastic refit.late_receivers=1``):
a receiver started after version 2's decision boots from that version's committed-version
snapshot (``refit.snapshot_every=2``), catches up, asks to join and is admitted at a
later version; every version commits with every member's ack, each receiver bit-exact
(the receivers compare integer views against the dense reference), and the final JSON
names who joined.  The settings' refusals are one line each, nothing written."""
import json

import pytest

from nemo_dcr_testbed import demo
from nemo_dcr_testbed.config import load_demo_config
from nemo_dcr_testbed.demo import main

from .test_demo_relay import SMALL


@pytest.mark.parametrize("override,needle", [
    ("refit.late_receivers=1", "refit.late_receivers needs refit.membership=elastic"),
    ("refit.membership=elastic refit.late_receivers=1 refit.transport=relay",
     "refit.late_receivers reads the store directly"),
    ("refit.membership=elastic refit.late_receivers=1 steps=3", "steps >= 4"),
    ("refit.membership=elastic refit.late_receivers=-1", "refit.late_receivers must be >= 0"),
    ("refit.membership=elastic refit.late_after=0", "refit.late_after must be >= 1"),
])
def test_bad_elastic_settings_are_one_line(override, needle, capsys, tmp_path):
    args = [*override.split(), f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_elastic_settings_load():  # control for the refusals above
    cfg = load_demo_config(["refit.membership=elastic", "refit.late_receivers=1", "steps=6", "refit.receivers=2"])
    assert (cfg.refit.membership, cfg.refit.late_receivers, cfg.refit.late_after) == ("elastic", 1, 2)


@pytest.mark.slow
def test_a_late_receiver_joins_the_running_demo(tmp_path):
    summary = demo.run(load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store",
                                         *[o for o in SMALL if not o.startswith("steps=")], "steps=6",
                                         "refit.receivers=2", "refit.membership=elastic",
                                         "refit.late_receivers=1", "refit.snapshot_every=2"]))
    print(json.dumps({k: summary[k] for k in ("membership", "joined", "evicted", "committed", "bit_exact")}))
    assert summary["membership"] == "elastic" and summary["joined"] == ["late0"] and summary["evicted"] == []
    assert (summary["refits"], summary["committed"], summary["bit_exact"]) == (6, 6, 6)
    rows = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    admitted = next(r["step"] for r in rows if r["joined"])
    assert admitted >= 4  # started after version 2's decision, admitted at a later version
    for r in rows:
        acked = sorted(a["receiver"] for a in r["acks"])
        assert acked == sorted(r["members"]), r["step"]  # a commit needs every member's ack
        assert ("late0" in r["members"]) == (r["step"] >= admitted)
    # the joiner's own log: it asked, was admitted, and verified every version it applied
    events = [json.loads(x) for x in (tmp_path / "run" / "receiver-late0.log").read_text().splitlines()
              if x.startswith("{")]
    # it started from the store, not version 0: the committed-version snapshot of v2 (the demo
    # starts it once v2 is decided and that snapshot is complete), then caught up and joined
    boot = [e["bootstrap"] for e in events if "bootstrap" in e]
    assert boot == [{"from": "snapshot", "version": 2}], boot
    assert any(e.get("event") == "join requested" for e in events)
    assert any(e.get("event") == "joined" and e.get("version") == admitted for e in events)
