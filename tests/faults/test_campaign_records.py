"""The campaign's typed records (``nemo_dcr_testbed.campaign.records``): their JSON is what the
results files hold, byte for byte (the committed per-trial lines read back and written again),
and a field that is not declared is refused."""
import glob
import json
import os

import pytest

from nemo_dcr_testbed.campaign import report
from nemo_dcr_testbed.campaign.records import ClassSummary, TrialRecord

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_committed_results_round_trip_byte_for_byte():
    paths = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "fault_campaign*.jsonl")))
    assert paths
    n = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    assert json.dumps(TrialRecord.from_json(d).to_json()) == json.dumps(d)
                    n += 1
    assert n == sum(len(report.load_records(p)) for p in paths)


def test_fields_keep_the_order_they_were_set_and_unset_ones_stay_out():
    rec = TrialRecord.new(trial=3, cls="none", violations=[])
    rec.committed = True
    rec["hang"] = False
    rec.violations.append("x")
    assert list(rec.to_json()) == ["trial", "cls", "violations", "committed", "hang"]
    assert "detected" not in rec and rec.get("detected") is None
    assert rec.pop("committed") is True and "committed" not in rec.to_json()
    rec.committed = False  # set again: last, as in a dict
    assert list(rec.to_json())[-1] == "committed"
    row = ClassSummary.new(trials=1)
    row["struck"] = 0
    assert row.to_json() == {"trials": 1, "struck": 0}


def test_an_undeclared_field_is_refused():
    rec = TrialRecord.new(trial=0)
    with pytest.raises(AttributeError):
        rec.detcted = True  # a typo
    with pytest.raises(AttributeError):
        TrialRecord.from_json({"trial": 0, "no_such_field": 1})
    with pytest.raises(KeyError):
        rec["detected"]
