"""One refit schema (``RefitOptions``): the callbacks' ``RefitSettings`` and the demo's
``refit`` section embed it, the sender's config is derived from it, and every one of its
settings reaches the sender on both paths (a NeMo / Bridge callback's attach, the demo's
trainer).  The README's keys are keys of these schemas."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from nemo_dcr.configs import ConfigError, check_override_keys
from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
from nemo_dcr.integrations.settings import RefitOptions, RefitSettings, RefitSetupError, load_refit_settings
from nemo_dcr_testbed import run_trainer
from nemo_dcr_testbed.config import DemoConfig, RefitConfig, load_demo_config

ROOT = Path(__file__).resolve().parents[2]

# a value for every schema field, none of them its default
NON_DEFAULT = {
    "model_id": "m-x", "receivers": ("ra", "rb"), "chunk_bytes": 12345, "upload_workers": 3,
    "coding": "fast", "ack_timeout_s": 7.5, "ack_poll_s": 0.25, "key_file": "/keys/k",
    "on_refusal": "fail", "max_consecutive_failures": 5, "pipeline": False, "pipeline_max_staged_bytes": 4096,
    "membership": "elastic", "min_receivers": 2, "evict_after": 1, "snapshot_every": 7,
}


def _override(name, value) -> str:
    text = {bool: lambda v: str(v).lower(), tuple: lambda v: f"[{','.join(v)}]"}.get(type(value), str)(value)
    return f"refit.{name}={text}"


OVERRIDES = [_override(k, v) for k, v in NON_DEFAULT.items()]


def _lost(cfg) -> list[str]:
    """The schema fields whose value did not arrive in ``cfg``."""
    return [f.name for f in fields(RefitOptions) if getattr(cfg, f.name) != NON_DEFAULT[f.name]]


def test_the_test_values_cover_the_schema():
    assert set(NON_DEFAULT) == {f.name for f in fields(RefitOptions)}
    for f in fields(RefitOptions):
        assert f.default is MISSING or NON_DEFAULT[f.name] != f.default, f.name


def test_one_definition_of_every_setting():
    schema = {f.name: (f.type, f.default) for f in fields(RefitOptions)}
    for cls in (RefitSettings, RefitConfig):
        assert issubclass(cls, RefitOptions)
        assert {f.name: (f.type, f.default) for f in fields(cls) if f.name in schema} == schema
    # a setting is declared once: no subclass restates a schema field
    for cls in (RefitSettings, RefitConfig):
        assert not set(cls.__annotations__) & set(schema), cls


@pytest.mark.parametrize("cls", [RefitOptions, RefitSettings, RefitConfig])
def test_one_docstring_per_field(cls):
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and nxt.value.value.strip(), \
                f"{cls.__name__}.{node.target.id} has no docstring"


class _Captured(Exception):
    pass


@pytest.fixture
def capture_sender(monkeypatch):
    """Stops ``MegatronRefitHook.from_model`` (where both paths hand the sender its config)
    and keeps the config it was given."""
    got = []

    def from_model(cls, model, *, sender_cfg, **kw):
        got.append(sender_cfg)
        raise _Captured

    monkeypatch.setattr(MegatronRefitHook, "from_model", classmethod(from_model))
    return got


def test_every_setting_reaches_the_sender_from_a_callback(tmp_path, capture_sender):
    from nemo_dcr.integrations.attach import RefitAttachment

    settings = load_refit_settings([f"refit.store_uri={tmp_path}/store", *OVERRIDES])
    with pytest.raises(_Captured):
        RefitAttachment(settings).attach(object())
    (cfg,) = capture_sender
    assert type(cfg) is RefitOptions and _lost(cfg) == []  # the schema itself, no larger object


def test_every_setting_reaches_the_sender_from_the_demo(tmp_path, capture_sender, monkeypatch):
    class NoTrainer:
        def __init__(self, *a, **kw):
            self.model = object()

    monkeypatch.setattr(run_trainer, "Trainer", NoTrainer)
    cfg = load_demo_config([f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store", *OVERRIDES])
    with pytest.raises(_Captured):
        run_trainer.build_trainer(DemoConfig.from_dict(cfg.to_dict()))  # as the trainer reads config.json
    (sent,) = capture_sender
    assert type(sent) is RefitOptions and _lost(sent) == []


def test_a_hand_mapping_that_forgets_a_field_is_caught():
    # negative control for the two tests above: the mapping the settings used to have
    s = load_refit_settings(["refit.store_uri=/x", *OVERRIDES])
    by_hand = RefitOptions(model_id=s.model_id, receivers=s.receivers, chunk_bytes=s.chunk_bytes,
                           upload_workers=s.upload_workers, ack_timeout_s=s.ack_timeout_s, coding=s.coding,
                           key_file=s.key_file, on_refusal=s.on_refusal,
                           max_consecutive_failures=s.max_consecutive_failures)
    assert sorted(_lost(by_hand)) == sorted(["ack_poll_s", "pipeline", "pipeline_max_staged_bytes", "membership",
                                             "min_receivers", "evict_after", "snapshot_every"])  # never named
    assert _lost(s.refit_options()) == []


def test_same_key_same_type_on_both_paths():
    assert load_demo_config(["refit.receivers=[r0,r1]"]).refit.receivers == ("r0", "r1")
    assert load_refit_settings(["refit.receivers=[r0,r1]"]).receivers == ("r0", "r1")
    errors = []
    for load, error in ((load_demo_config, ConfigError), (load_refit_settings, RefitSetupError)):
        with pytest.raises(error) as e:
            load(["refit.receivers=2.5"])
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "refit.receivers" in errors[0] and "\n" not in errors[0]
    # and the schema's checks are the same: the demo refuses what a callback refuses
    for bad in ("refit.on_refusal=sometimes", "refit.ack_poll_s=0", "refit.receivers=[]", "refit.membership=open",
                "refit.evict_after=0", "refit.min_receivers=2",
                "refit.membership=elastic refit.evict_after=4"):
        msgs = []
        for load, error in ((load_demo_config, ConfigError), (load_refit_settings, RefitSetupError)):
            with pytest.raises(error) as e:
                load(bad.split())
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1], bad


def test_the_packaged_yaml_files_restate_no_default():
    from importlib import resources

    import yaml

    refit = yaml.safe_load((resources.files("nemo_dcr.configs") / "refit.yaml").read_text())["refit"]
    required = {f.name for f in fields(RefitSettings) if f.default is MISSING and f.default_factory is MISSING}
    assert set(refit) == required  # only the values the schema cannot default


def _readme_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    # config keys, not file or module names (init/model.safetensors, nemo_dcr.receiver.cli)
    found = re.findall(r"(?<![\w/.-])((?:refit|model|parallel|train|store|receiver)\.[a-z_]+)(?![\w./(-])", text)
    return {k for k in found if k.split(".")[1] not in ("py", "yaml", "json", "log", "safetensors")}


def test_every_readme_key_is_a_schema_key():
    from nemo_dcr.integrations.settings import RefitFile

    keys = _readme_keys()
    assert {"refit.key_file", "refit.receivers", "refit.store_uri", "model.vocab_size"} <= keys  # control
    own = {f"refit.{f.name}" for f in fields(RefitSettings)} - {f"refit.{f.name}" for f in fields(RefitOptions)}
    for key in sorted(keys):  # a callback's own keys (the store, the cadence, ...) or a demo key
        check_override_keys([f"{key}=1"], RefitFile if key in own else DemoConfig)
    # every setting of the schema is a key of both
    for f in fields(RefitOptions):
        check_override_keys([f"refit.{f.name}=x"], DemoConfig)
        check_override_keys([f"refit.{f.name}=x"], RefitFile)
    with pytest.raises(ConfigError, match="unknown config key 'refit.store_uri'"):
        check_override_keys(["refit.store_uri=x"], DemoConfig)  # control: a callback's own key is not one


def _table_rows(text: str) -> set[str]:
    """The keys of the README's "Configuration of the refit" table (its first column)."""
    section = text.split("## Configuration of the refit", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(refit\.[a-z_]+)` \|", section, flags=re.M))


def test_the_readme_table_has_a_row_per_schema_key():
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    schema = {f"refit.{f.name}" for f in fields(RefitOptions)}
    assert schema - _table_rows(text) == set(), "README.md's refit table lacks these keys"
    assert _table_rows(text) - schema == set(), "README.md's refit table names keys the schema does not have"
    # control: the table without one row is caught
    cut = "\n".join(ln for ln in text.splitlines() if not ln.startswith("| `refit.snapshot_every`"))
    assert schema - _table_rows(cut) == {"refit.snapshot_every"}


@pytest.mark.parametrize("kw,needle", [
    ({"chunk_bytes": "abc"}, "refit.chunk_bytes must be an int, got 'abc'"),
    ({"coding": 1}, "refit.coding must be a string, got 1"),
    ({"coding": "zip"}, "refit.coding must be one of ('auto', 'context', 'plain', 'fast'"),  # then the value
    ({"receivers": ["a", 1]}, "refit.receivers must be a list of strings"),
    ({"ack_timeout_s": True}, "refit.ack_timeout_s must be a number, got True"),
    ({"upload_workers": 0}, "refit.upload_workers must be positive"),
])
def test_the_schema_checks_settings_built_in_python(kw, needle):
    base = {"store_uri": "x", "model_id": "m", "receivers": ("r0",)}
    for cls in (RefitSettings, RefitOptions):
        args = {k: v for k, v in {**base, **kw}.items() if k in {f.name for f in fields(cls)}}
        with pytest.raises(RefitSetupError, match=re.escape(needle)):
            cls(**args)
    # control: the same settings with good values, lists and ints where tuples and floats are due
    s = RefitSettings(**{**base, "receivers": ["a", "b"], "ack_timeout_s": 3})
    assert s.receivers == ("a", "b") and s.ack_timeout_s == 3.0 and isinstance(s.ack_timeout_s, float)
