import pytest

from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.model_executor.models.registry import (
    resolve_model_cls,
    supported_architectures,
)


def test_resolves_the_first_supported_architecture():
    assert resolve_model_cls(["Foo", "Qwen3MoeForCausalLM"]) is Qwen3MoeForCausalLM
    with pytest.raises(
        ValueError, match=r"none of \['LlamaForCausalLM'\] is supported"
    ):
        resolve_model_cls(["LlamaForCausalLM"])
    assert "Qwen3MoeForCausalLM" in supported_architectures()
