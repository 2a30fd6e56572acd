import json

import pytest

from vllm.transformers_utils.config import load_hf_config


def write(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_both_spellings_give_one(tmp_path):
    v5 = {
        "num_local_experts": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "dtype": "bfloat16",
    }
    config = load_hf_config(write(tmp_path, v5))
    assert (config["num_experts"], config["rope_theta"], config["torch_dtype"]) == (
        8,
        5e5,
        "bfloat16",
    )
    hub = {"num_experts": 8, "rope_theta": 1e6, "torch_dtype": "float16"}
    config = load_hf_config(write(tmp_path, hub))
    assert (config["num_experts"], config["rope_theta"], config["torch_dtype"]) == (
        8,
        1e6,
        "float16",
    )


def test_refused_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="model: expected a checkpoint directory"):
        load_hf_config(tmp_path / "absent")
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    with pytest.raises(ValueError, match="rope_parameters: only the default RoPE"):
        load_hf_config(write(tmp_path, yarn))
