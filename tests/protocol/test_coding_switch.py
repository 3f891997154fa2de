"""``refit.coding`` switched between versions (``RefitSender.set_coding`` ->
``CodingFeedback.switch``): a fixed coding codes the next version, ``auto`` resumes with its
last choice, a bad name is refused and nothing changes.  Benchmarks compare fixed codings with
``auto`` in one run this way (scripts/bench_coding_auto.py); after a refactor the test bed's
change of ``sender.cfg`` alone no longer reached the coder, and every case ran auto's choice."""
from __future__ import annotations

import pytest

from nemo_dcr.errors import ValidationError
from nemo_dcr.sender.coding_choice import AUTO_START
from nemo_dcr.sender.feedback import CodingFeedback


def test_fixed_codings_code_the_next_version_and_auto_resumes():
    fb = CodingFeedback("auto", upload_workers=2)
    assert fb.current == AUTO_START
    fb.current = "plain"  # auto's choice after a version (what the engine stores)
    fb.switch("context")
    assert (fb.setting, fb.current) == ("context", "context")
    fb.switch("fast")
    assert (fb.setting, fb.current) == ("fast", "fast")
    fb.switch("auto")
    assert (fb.setting, fb.current) == ("auto", "plain")  # its own last choice, not the fixed ones
    fb.switch("auto")  # no change
    assert (fb.setting, fb.current) == ("auto", "plain")


def test_a_fixed_start_switched_to_auto_starts_where_auto_starts():
    fb = CodingFeedback("fast", upload_workers=1)
    assert fb.current == "fast"
    fb.switch("auto")
    assert (fb.setting, fb.current) == ("auto", AUTO_START)


def test_an_unknown_coding_is_refused_and_changes_nothing():
    fb = CodingFeedback("plain", upload_workers=1)
    with pytest.raises(ValidationError, match="refit.coding must be one of"):
        fb.switch("zstd")
    assert (fb.setting, fb.current) == ("plain", "plain")
