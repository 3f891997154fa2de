"""A malformed demo configuration is one clear line on stderr and exit status 2, before
any process starts or anything is written."""
import pytest

from nemo_dcr.testbed.config import load_demo_config
from nemo_dcr.testbed.demo import main


@pytest.mark.parametrize("override,needle", [
    ("model.famly=qwen3", "unknown config key 'model.famly' (ModelConfig has no field 'famly'; did you mean "
                          "'model.family'?)"),
    ("model.family=mixtral", "ModelConfig.family must be one of"),
    ("model.family=qwen3_moe", "num_moe_experts must be > 0"),
    ("parallel.expert_model_parallel_size=2", "must divide data_parallel_size"),
    ("model.num_moe_experts=abc", "model.num_moe_experts"),
    ("receiver.runtime=sglang", "receiver.runtime must be one of"),
    ("receiver.tensor_parallel_size=2", "applies to receiver.runtime=vllm only"),
    ("receiver.runtime=vllm model.hidden_size=96", "head_dim in"),
    ("+model.famly=qwen3", "unknown config key 'model.famly' (ModelConfig has no field 'famly'"),
    ("++colour=red", "unknown config key 'colour' (DemoConfig has no field 'colour')"),
    ("+refit.colour=red", "unknown config key 'refit.colour' (RefitConfig has no field 'colour')"),
    ("~model.famly", "unknown config key 'model.famly'"),
    ("steps.x=1", "override 'steps.x=1': 'steps' is a value, it has no key 'x'"),
    ("steps=abc", "Error merging override steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("steps=[1", "override 'steps=[1' does not parse: no viable alternative at input '[1'"),
])
def test_bad_config_is_one_line(override, needle, capsys, tmp_path):
    assert main([*override.split(), f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_good_overrides_load(tmp_path):
    """Control for the refusals above: the same keys, spelled right, load."""
    cfg = load_demo_config(["model.family=qwen3", "refit.context=false", "steps=2", f"run_dir={tmp_path}/run"])
    assert (cfg.model.family, cfg.refit.context, cfg.steps) == ("qwen3", False, 2)
    assert cfg.store.uri == f"{tmp_path}/run/store"  # the store follows run_dir (configs/demo.yaml)


def test_each_run_gets_a_new_run_dir_by_default():
    cfg = load_demo_config([])
    assert cfg.run_dir.startswith("runs/demo/") and cfg.run_dir != "runs/demo/"
    assert cfg.store.uri == f"{cfg.run_dir}/store" and not cfg.force and not cfg.store.reset
