"""TritonExperts: what its kernels refuse."""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    moe_config,
    random_weights,
)
from vllm.model_executor.layers.fused_moe.experts import triton_moe
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts


def test_triton_refuses_what_its_kernels_cannot_run(monkeypatch):
    moe = moe_config("cpu")
    assert TritonExperts.unsupported(moe, torch.device("cpu")) is None
    bad = moe_config("cpu", hidden_size=136)
    with pytest.raises(ValueError, match="hidden_size/intermediate_size: expected"):
        TritonExperts(bad, *random_weights(bad, "cpu"))
    monkeypatch.setattr(triton_moe, "is_hopper", lambda device: False)
    monkeypatch.setattr(triton_moe, "capability", lambda device: (8, 0))
    reason = TritonExperts.unsupported(moe, torch.device("cuda"))
    assert reason is not None and "Hopper GPU (sm90)" in reason and "(8, 0)" in reason
