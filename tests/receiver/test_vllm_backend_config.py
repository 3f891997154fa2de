"""The vLLM backend's JSON inputs and its registration, without starting an engine.

Init and update info arrive from HTTP bodies: every malformed one is one ``ConfigError``
line naming the key (never pickle, never a TypeError from ``cls(**dict)``).  Registration:
the package's ``vllm.general_plugins`` entry point, loaded the way vLLM loads it, puts
``nemo_dcr`` in vLLM's engine registry, and loading it again is harmless (vLLM's plugin
contract); control: an emptied registry does not have the name until the plugin runs.
"""
import importlib.metadata

import pytest

from nemo_dcr.configs.check import ConfigError
from nemo_dcr.runtimes.vllm.backend_config import BACKEND, BackendInitInfo, UpdateInfo

GOOD = {"store": "/tmp/store", "receiver_id": "e0", "model_id": "m"}


def test_init_info_from_json():
    info = BackendInitInfo.from_json({**GOOD, "poll_s": 1, "key_file": None, "join": True})
    assert (info.poll_s, info.key_file, info.join, info.stream) == (1.0, None, True, True)


@pytest.mark.parametrize("raw, line", [
    ({"store": "/x", "receiver_id": "e0"}, "init_info: 'model_id' is required"),
    ({**GOOD, "pickle": "gASV"}, "init_info: unknown key 'pickle'"),
    ({**GOOD, "stream": 1}, "init_info.stream must be true or false, got 1"),
    ({**GOOD, "fetch_threads": 2.5}, "init_info.fetch_threads must be an integer, got 2.5"),
    ({**GOOD, "poll_s": -1}, "init_info.poll_s must be positive"),
    ({**GOOD, "receiver_id": "a/b"}, "invalid receiver id 'a/b'"),
    ({**GOOD, "store": ""}, "'store' and 'model_id' must not be empty"),
    ({**GOOD, "key_file": 3}, "init_info.key_file must be a string, got 3"),
    ([GOOD], "init_info must be a JSON object, got list"),
])
def test_init_info_refusals_are_one_line_naming_the_key(raw, line):
    with pytest.raises(ConfigError) as e:
        BackendInitInfo.from_json(raw)
    assert line in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("raw, want", [({"version": 3}, 3), ({"version": "latest"}, "latest"),
                                       ({"version": 0, "timeout_s": 5}, 0)])
def test_update_info(raw, want):
    assert UpdateInfo.from_json(raw).version == want


@pytest.mark.parametrize("raw, line", [
    ({}, "update_info: 'version' is required"),
    ({"version": "3"}, "update_info.version must be an integer or 'latest', got '3'"),
    ({"version": True}, "update_info.version must be an integer or 'latest', got True"),
    ({"version": -1}, "update_info.version must be >= 0"),
    ({"version": 1, "timeout_s": 0}, "update_info.timeout_s must be positive"),
    ({"version": 1, "weights": []}, "update_info: unknown key 'weights'"),
])
def test_update_info_refusals(raw, line):
    with pytest.raises(ConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
        UpdateInfo.from_json(raw)


def test_the_entry_point_registers_the_backend_once(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (ep,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == BACKEND]
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", {})
    assert BACKEND not in WeightTransferEngineFactory._registry  # control: not there before the plugin runs
    register = ep.load()
    register()
    register()  # vLLM may load a plugin more than once per process
    engine_cls = WeightTransferEngineFactory._registry[BACKEND]()
    assert engine_cls.__name__ == "DCRWeightTransferEngine"
    assert engine_cls.init_info_cls is BackendInitInfo and engine_cls.update_info_cls is UpdateInfo
