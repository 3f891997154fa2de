"""A malformed demo configuration is one clear line on stderr and exit status 2, before
any process starts or anything is written."""
import pytest

from nemo_dcr_testbed.config import ConfigError, load_demo_config
from nemo_dcr_testbed.demo import main


@pytest.mark.parametrize("override,needle", [
    ("model.famly=qwen3", "unknown config key 'model.famly' (ModelConfig has no field 'famly'; did you mean "
                          "'model.family'?)"),
    ("model.family=mixtral", "ModelConfig.family must be one of"),
    ("model.family=qwen3_moe", "num_moe_experts must be > 0"),
    ("parallel.expert_model_parallel_size=2", "must divide data_parallel_size"),
    ("model.num_moe_experts=abc", "model.num_moe_experts"),
    ("receiver.runtime=sglang", "receiver.runtime must be one of"),
    ("receiver.tensor_parallel_size=2", "applies to receiver.runtime=vllm|vllm_serve only"),
    ("receiver.runtime=vllm model.hidden_size=96", "head_dim in"),
    ("receiver.runtime=vllm_serve model.hidden_size=96", "receiver.runtime=vllm_serve: vLLM's CPU attention takes"),
    ("receiver.runtime=vllm_serve receiver.tensor_parallel_size=3", "must divide the model's query heads"),
    ("receiver.runtime=vllm_serve refit.transport=relay", "refit.membership=static and refit.transport=store only"),
    ("receiver.runtime=vllm_serve refit.membership=elastic", "refit.membership=static and refit.transport=store"),
    ("+model.famly=qwen3", "unknown config key 'model.famly' (ModelConfig has no field 'famly'"),
    ("++colour=red", "unknown config key 'colour' (DemoConfig has no field 'colour')"),
    ("+refit.colour=red", "unknown config key 'refit.colour' (RefitConfig has no field 'colour')"),
    ("~model.famly", "unknown config key 'model.famly'"),
    ("steps.x=1", "override 'steps.x=1': 'steps' is a value, it has no key 'x'"),
    ("steps=abc", "Error merging override steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("steps=[1", "override 'steps=[1' does not parse: no viable alternative at input '[1'"),
    # the refit section is the refit schema: the keys, types and checks of a callback's refit.*
    ("refit.receivers=2.5", "Error merging override refit.receivers=2.5: Invalid value assigned: float is not a "
                            "ListConfig"),
    ("refit.receivers=[]", "refit.receivers is empty"),
    ("refit.receivers=0", "refit.receivers is empty"),
    ("refit.receivers=5000", "at most 1024 receivers"),
    ("refit.on_refusal=sometimes", "refit.on_refusal must be one of ('retry', 'fail')"),
    ("refit.ack_poll_s=0", "refit.ack_poll_s must be positive"),
    ("refit.store_uri=x", "unknown config key 'refit.store_uri' (RefitConfig has no field 'store_uri'"),
    ("model_id=x", "unknown config key 'model_id' (DemoConfig has no field 'model_id'; did you mean "
                   "'refit.model_id'?)"),
])
def test_bad_config_is_one_line(override, needle, capsys, tmp_path):
    assert main([*override.split(), f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_a_receiver_count_names_the_receivers(tmp_path):
    """``refit.receivers=N`` is N receivers r0..r<N-1> (the issue's demo commands); a list
    stays a list (control: its own ids are kept)."""
    cfg = load_demo_config(["refit.receivers=4", f"run_dir={tmp_path}/run"])
    assert cfg.refit.receivers == ("r0", "r1", "r2", "r3")
    assert load_demo_config(["refit.receivers=[a,b]", f"run_dir={tmp_path}/run"]).refit.receivers == ("a", "b")


def test_good_overrides_load(tmp_path):
    """Control for the refusals above: the same keys, spelled right, load."""
    cfg = load_demo_config(["model.family=qwen3", "refit.coding=plain", "steps=2", f"run_dir={tmp_path}/run",
                            "refit.receivers=[r0,r1]", "refit.on_refusal=fail", "refit.ack_poll_s=0.5",
                            "refit.model_id=x", f"refit.key_file={tmp_path}/k"])
    assert (cfg.model.family, cfg.refit.coding, cfg.steps) == ("qwen3", "plain", 2)
    assert (cfg.refit.receivers, cfg.refit.on_refusal, cfg.refit.ack_poll_s, cfg.refit.model_id,
            cfg.refit.key_file) == (("r0", "r1"), "fail", 0.5, "x", f"{tmp_path}/k")
    assert cfg.store.uri == f"{tmp_path}/run/store"  # the store follows run_dir (testbed/nemo_dcr_testbed/configs/demo.yaml)
    serve = load_demo_config(["receiver.runtime=vllm_serve", "receiver.tensor_parallel_size=2", f"run_dir={tmp_path}/r"])
    assert (serve.receiver.runtime, serve.receiver.tensor_parallel_size) == ("vllm_serve", 2)


def test_receiver_runtime_is_any_registered_name(monkeypatch):
    from nemo_dcr.receiver import registry

    with pytest.raises(ConfigError, match=r"receiver.runtime must be one of \('hf', 'vllm', 'vllm_serve'\), got 'sglang'"):
        load_demo_config(["receiver.runtime=sglang"])
    monkeypatch.setattr(registry, "runtime_names", lambda: ("hf", "vllm", "sglang"))
    assert load_demo_config(["receiver.runtime=sglang"]).receiver.runtime == "sglang"  # control


def test_a_yaml_key_the_schema_lacks_names_the_file(tmp_path):
    from importlib import resources

    text = (resources.files("nemo_dcr_testbed") / "configs" / "demo.yaml").read_text()
    (tmp_path / "demo.yaml").write_text(text.replace("refit:\n", "refit:\n  chunk_byte: 5\n"))
    with pytest.raises(ConfigError) as e:
        load_demo_config([], config_dir=str(tmp_path))
    msg = str(e.value)  # Hydra's composition refuses it against the typed schema
    assert "In 'demo'" in msg and "Key 'chunk_byte' not in 'RefitConfig' (key refit.chunk_byte)" in msg, msg
    assert "\n" not in msg
    (tmp_path / "demo.yaml").write_text(text)  # control: the packaged file itself loads from there
    assert load_demo_config([], config_dir=str(tmp_path)).refit.chunk_bytes == 1 << 20


def test_each_run_gets_a_new_run_dir_by_default():
    cfg = load_demo_config([])
    assert cfg.run_dir.startswith("runs/demo/") and cfg.run_dir != "runs/demo/"
    assert cfg.store.uri == f"{cfg.run_dir}/store" and not cfg.force and not cfg.store.reset
