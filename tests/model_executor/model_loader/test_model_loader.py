import pytest
import torch

from vllm.model_executor.model_loader import resolve_dtype


def test_auto_serves_16_bit():
    assert resolve_dtype("auto", "float16") == torch.float16
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "float32") == torch.bfloat16
    assert resolve_dtype("auto", None) == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16") == torch.float32
    assert resolve_dtype(torch.float16, None) == torch.float16
    with pytest.raises(ValueError, match="dtype: expected 'auto' or one of"):
        resolve_dtype("int8", None)
