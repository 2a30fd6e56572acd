import json

import pytest
import torch
from safetensors.torch import save_file

from vllm.model_executor.model_loader.weight_utils import (
    INDEX_FILE,
    safetensors_files,
    safetensors_weights_iterator,
)


def test_index_or_every_file(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    assert dict(safetensors_weights_iterator(tmp_path)).keys() == {"a", "b"}
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({"weight_map": {"b": "two.safetensors"}})
    )
    assert safetensors_files(tmp_path) == [tmp_path / "two.safetensors"]
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({"weight_map": {"c": "gone.safetensors"}})
    )
    with pytest.raises(ValueError, match="names missing shards"):
        safetensors_files(tmp_path)


def test_no_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model: no \*\.safetensors files"):
        safetensors_files(tmp_path)
