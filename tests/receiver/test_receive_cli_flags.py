"""The receiver CLI's flags for ``ReceiverConfig`` and ``RuntimeOptions`` come from the
dataclass fields (``configs/flags.py``): every flagged field is in ``parser()`` with the
field's default, type and help, and the parsed arguments build the same config."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import pytest

from nemo_dcr.configs.flags import FieldFlags, field_values, flag, flag_dest, flagged_fields
from nemo_dcr.receiver.cli import parser
from nemo_dcr.receiver.engine import ReceiverConfig
from nemo_dcr.receiver.registry import RuntimeOptions

MINIMAL = ["--store", "s", "--receiver-id", "r0", "--model-id", "m"]


def flag_problems(ap: argparse.ArgumentParser, cls) -> list[str]:
    """Each flagged field of ``cls`` that ``ap`` lacks, or has with another default, dest or help."""
    by_flag = {s: a for a in ap._actions for s in a.option_strings}
    problems = []
    for name, f in flagged_fields(cls).items():
        a = by_flag.get(f.metadata["flag"])
        if a is None:
            problems.append(f"{cls.__name__}.{name}: no {f.metadata['flag']}")
            continue
        required = not a.option_strings or a.required
        if not required and a.default != f.default:
            problems.append(f"{cls.__name__}.{name}: default {a.default!r}, the field's is {f.default!r}")
        if a.dest != flag_dest(f) or a.help != f.metadata["help"]:
            problems.append(f"{cls.__name__}.{name}: dest or help differs")
    return problems


def test_every_flagged_field_is_in_the_parser_with_its_default():
    ap = parser()
    assert flag_problems(ap, ReceiverConfig) == [] and flag_problems(ap, RuntimeOptions) == []
    assert set(flagged_fields(ReceiverConfig)) == {f.name for f in fields(ReceiverConfig)}  # all of them
    assert set(flagged_fields(RuntimeOptions)) == {f.name for f in fields(RuntimeOptions)} - {"reference"}


def test_defaults_parse_to_the_dataclasses_defaults():
    args = parser().parse_args(MINIMAL)
    assert ReceiverConfig(**field_values(args, ReceiverConfig)) == ReceiverConfig(receiver_id="r0", model_id="m")
    assert RuntimeOptions(**field_values(args, RuntimeOptions)) == RuntimeOptions()
    args = parser().parse_args([*MINIMAL, "--no-stream", "--verify-dense", "--poll-s", "0.5", "--fetch-threads",
                                "3", "--persistent-weights", "--max-model-len", "64", "--sample-tokens", "2"])
    assert ReceiverConfig(**field_values(args, ReceiverConfig)) == ReceiverConfig(
        receiver_id="r0", model_id="m", stream=False, verify_dense=True, poll_s=0.5, fetch_threads=3)
    assert RuntimeOptions(**field_values(args, RuntimeOptions)) == RuntimeOptions(
        persistent=True, max_model_len=64, sample_tokens=2)
    assert args.persistent_weights and not args.stream  # the namespace keeps the flags' names


@dataclass(kw_only=True, frozen=True)
class _Planted(ReceiverConfig):
    extra: int = field(default=3, metadata=flag("--extra", "a field the parser does not know"))
    poll_s: float = field(default=0.25, metadata=flag("--poll-s", "interval between checks for the next manifest"))


def test_a_planted_field_the_parser_lacks_is_reported():
    problems = flag_problems(parser(), _Planted)
    assert problems == ["_Planted.poll_s: default 0.05, the field's is 0.25", "_Planted.extra: no --extra"]
    ap = argparse.ArgumentParser()
    FieldFlags(ap).add_rest(_Planted)  # a flagged field nobody placed is still added
    assert flag_problems(ap, _Planted) == []
    assert ap.parse_args(["--receiver-id", "r", "--model-id", "m"]).extra == 3


def test_a_bool_flag_that_cannot_set_its_field_is_a_class_bug():
    @dataclass(kw_only=True, frozen=True)
    class Bad:
        on: bool = field(default=True, metadata=flag("--on", "store_true cannot turn it off"))

    with pytest.raises(AssertionError, match="needs the default False"):
        FieldFlags(argparse.ArgumentParser()).add_rest(Bad)
