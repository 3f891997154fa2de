"""A malformed demo configuration is one clear line on stderr and exit status 2, before
any process starts or anything is written."""
import pytest

from nemo_dcr.testbed.demo import main


@pytest.mark.parametrize("override,needle", [
    ("model.famly=qwen3", "Could not override 'model.famly'"),
    ("model.family=mixtral", "ModelConfig.family must be one of"),
    ("model.family=qwen3_moe", "num_moe_experts must be > 0"),
    ("parallel.expert_model_parallel_size=2", "must divide data_parallel_size"),
    ("model.num_moe_experts=abc", "model.num_moe_experts"),
    ("receiver.runtime=sglang", "receiver.runtime must be one of"),
    ("receiver.tensor_parallel_size=2", "applies to receiver.runtime=vllm only"),
    ("receiver.runtime=vllm model.hidden_size=96", "head_dim in"),
])
def test_bad_config_is_one_line(override, needle, capsys, tmp_path):
    assert main([*override.split(), f"run_dir={tmp_path}/run", f"store.uri={tmp_path}/store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()
