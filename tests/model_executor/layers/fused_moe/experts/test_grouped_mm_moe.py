"""GroupedMMExperts: what torch._grouped_mm refuses, and its CPU loop."""

import torch

from tests.model_executor.layers.fused_moe.utils import moe_config
from vllm.model_executor.layers.fused_moe.config import QuantScheme
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
    grouped_mm,
    grouped_mm_ends,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.layer import choose_experts_backend


def test_unsupported_names_what_it_cannot_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert GroupedMMExperts.unsupported(moe_config("cpu"), cuda) is None
    odd = moe_config("cpu", hidden_size=132)  # not a multiple of 8
    assert "torch._grouped_mm needs multiples of 8" in str(
        GroupedMMExperts.unsupported(odd, cuda)
    )
    assert GroupedMMExperts.unsupported(odd, cpu) is None  # the CPU loop takes it
    fp8 = moe_config("cpu", scheme=QuantScheme.FP8_PER_TOKEN)
    assert "moe.quant_config.scheme" in str(GroupedMMExperts.unsupported(fp8, cpu))


def test_cpu_loop_matches_per_expert_matmuls():
    torch.manual_seed(0)
    a = torch.randn(7, 16)
    w = torch.randn(3, 8, 16)
    offsets = torch.tensor([0, 2, 2, 6])  # expert 1 empty; row 6 past the end
    out = grouped_mm(a, w, grouped_mm_ends(offsets), out_dtype=torch.float32)
    for e, (lo, hi) in enumerate([(0, 2), (2, 2), (2, 6)]):
        torch.testing.assert_close(out[lo:hi], a[lo:hi] @ w[e].t())


def test_float32_layers_run_the_cpu_loop_only():
    """fp32 layers (CPU parity checks against transformers) take grouped_mm on
    the CPU; on CUDA every backend refuses them by name."""
    moe = moe_config("cpu", in_dtype=torch.float32)
    assert choose_experts_backend(moe, torch.device("cpu")) == "grouped_mm"
    assert "got fp32" in str(GroupedMMExperts.unsupported(moe, torch.device("cuda")))
    reason = TritonExperts.unsupported(moe, torch.device("cpu"))
    assert reason is not None and reason.startswith("moe.in_dtype: TritonExperts")
