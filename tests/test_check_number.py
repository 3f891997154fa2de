"""``configs/check.py``'s ``check_number``: the one validator of number settings."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

import nemo_dcr
from nemo_dcr.configs import ConfigError, ConfigTypeError, check_number


def test_accepts_and_returns_numbers_that_fit():
    assert check_number("n", 3) == 3
    assert check_number("x", 2, kind=float, positive=True) == 2
    assert check_number("x", 0.5, kind=float, min=0, max=1) == 0.5
    assert check_number("n", None, allow_none=True) is None


@pytest.mark.parametrize("value, kwargs, exc, message", [
    ("3", {}, ConfigTypeError, "n must be an int, got '3'"),
    (2.0, {}, ConfigTypeError, "n must be an int, got 2.0"),
    (True, {}, ConfigTypeError, "n must be an int, got True"),
    (True, {"kind": float}, ConfigTypeError, "n must be a number, got True"),
    (None, {}, ConfigTypeError, "n must be an int, got None"),
    (0, {"positive": True}, ConfigError, "n must be positive, got 0"),
    (-1, {"min": 0}, ConfigError, "n must be >= 0, got -1"),
    (5, {"max": 4}, ConfigError, "n must be <= 4, got 5"),
    (math.nan, {"kind": float, "positive": True}, ConfigError, "n must be positive, got nan"),
    (math.nan, {"kind": float, "min": 0}, ConfigError, "n must be >= 0, got nan"),
])
def test_refuses_with_one_line_naming_the_setting(value, kwargs, exc, message):
    with pytest.raises(exc) as e:
        check_number("n", value, **kwargs)
    assert str(e.value) == message and type(e.value) is exc


def test_type_refusals_are_type_errors_and_range_refusals_value_errors():
    with pytest.raises(TypeError):
        check_number("n", "x")
    with pytest.raises(ValueError):
        check_number("n", -1, min=0)
    with pytest.raises(TypeError):
        check_number("n", 1, kind=str)  # a caller's bug


ROOT = Path(nemo_dcr.__file__).resolve().parent


@pytest.mark.parametrize("rel", ["configs/__init__.py", "transport/store/policy.py", "transport/relay/config.py",
                                 "receiver/engine.py", "receiver/registry.py", "receiver/cli.py",
                                 "sender/options.py"])
def test_number_settings_are_checked_by_check_number(rel):
    assert "check_number(" in (ROOT / rel).read_text(), rel
