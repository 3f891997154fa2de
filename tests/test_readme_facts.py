"""README.md's numbers and names that the code knows: the C extensions setup.py builds, the
demo overrides of its `make demo ARGS="..."` examples (keys of the demo's schema), the docs it
names, and the fault campaign's trial counts (benchmarks/results/fault_campaign*.jsonl).  A
README that drifts from them fails here.  Every other config key the README names is checked
against the schemas by tests/integration/test_refit_settings.py
(``test_every_readme_key_is_a_schema_key``, ``test_the_readme_table_has_a_row_per_schema_key``)."""
from __future__ import annotations

import ast
import collections
import dataclasses
import json
import re
import typing
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def setup_extensions() -> list[str]:
    """The module names of setup.py's ``Extension(...)`` calls."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"]


def test_c_extension_count():
    exts = setup_extensions()
    assert sorted(exts) == ["nemo_dcr.codec._cans", "nemo_dcr.codec._crans", "nemo_dcr.kernels._cxor"]
    said = re.findall(r"\b(\w+) small C extensions", README)
    assert said, "the README no longer says how many C extensions there are: adjust this test"
    assert [NUMBERS.get(w, w) for w in said] == [len(exts)] * len(said), said
    for name in exts:  # named where setup is described
        assert f"`{name}`" in README, name


def _keys(cls, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        out |= _keys(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else {prefix + f.name}
    return out


def demo_keys() -> set[str]:
    """Every key of the demo's demo.yaml (``DemoConfig``)."""
    from nemo_dcr_testbed.config import DemoConfig

    return _keys(DemoConfig)


def test_demo_overrides_in_the_readme_are_demo_keys():
    overrides = [m.group(1) for m in re.finditer(r'make demo ARGS="([^"]*)"', README.replace("\\\n", " "))]
    assert len(overrides) >= 8, overrides
    keys = {w.split("=", 1)[0] for o in overrides for w in o.split() if "=" in w}
    assert keys and sorted(keys - demo_keys()) == []


def campaign() -> dict[str, collections.Counter]:
    out = {}
    for f in sorted((ROOT / "benchmarks" / "results").glob("fault_campaign*.jsonl")):
        out[f.name] = collections.Counter(json.loads(ln)["cls"] for ln in f.read_text().splitlines() if ln.strip())
    return out


def test_fault_campaign_counts():
    c = campaign()
    store, relay, pipe = c["fault_campaign.jsonl"], c["fault_campaign.relay.jsonl"], c["fault_campaign.pipeline.jsonl"]

    def n(counter):
        return sum(counter.values())

    text = " ".join(README.split())
    assert (f"({len(store) - 1} store classes, store attacks by a key-less writer included, and a clean control: "
            f"{n(store)} trials, {store['none']} of them controls;") in text
    assert f"{len(relay) - 1} relay classes: {n(relay) - relay['none']} trials, plus {relay['none']} controls;" in text
    assert (f"{len(pipe) - 1} classes of the pipelined refit and elastic membership: {n(pipe) - pipe['none']} trials, "
            f"plus {pipe['none']} controls;") in text
    assert f"{n(store) + n(relay) + n(pipe)} trials in these three runs, {sum(map(n, c.values()))} with" in text
    summary = json.loads((ROOT / "benchmarks" / "results" / "fault_campaign.json").read_text())
    assert summary["trials"] == sum(map(n, c.values())) and summary["silent_corruptions"] == 0
    # docs/benchmarks.md's breakdown of the same numbers
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for name, counter in c.items():
        row = f"| `{name}` | {n(counter)} | {counter['none']} | {n(counter) - counter['none']} | {len(counter) - 1} "
        assert row in bench, row
    controls = relay["none"] + pipe["none"]
    assert (f"**{n(store) + n(relay) + n(pipe)} trials = {n(store)} + {n(relay) - relay['none']} + "
            f"{n(pipe) - pipe['none']} + {controls}\n  controls**") in bench


def test_docs_the_readme_names_exist():
    docs = set(re.findall(r"docs/[\w-]+\.md", README))
    assert {"docs/install.md", "docs/benchmarks.md", "docs/testing.md", "docs/protocol.md"} <= docs
    assert sorted(d for d in docs if not (ROOT / d).exists()) == []
