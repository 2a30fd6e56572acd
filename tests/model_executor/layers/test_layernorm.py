import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from vllm.model_executor.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_bit_for_bit(dtype):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, 1e-6, dtype=dtype), Qwen3MoeRMSNorm(64, eps=1e-6)
    weight = torch.randn(64).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data = weight.clone()
    x = torch.randn(5, 3, 64).to(dtype) * 10
    assert torch.equal(ours(x), theirs(x))
