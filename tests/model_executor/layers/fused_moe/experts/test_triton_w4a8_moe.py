"""TritonExpertsW4A8: the layer against the dense reference of its
dequantized weights (CPU: the GEMMs' references, and once each the
interpreted grouped and decode kernels; GPU: the kernels), one permute
scratch per slot, and its limits."""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    CUDA,
    check_backend,
    make_layer,
    moe_config,
    random_weights,
)
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
)
from vllm.model_executor.layers.fused_moe.config import QuantScheme
from vllm.model_executor.layers.fused_moe.experts import triton_w4a8_moe
from vllm.model_executor.layers.fused_moe.experts.triton_w4a8_moe import (
    TritonExpertsW4A8,
)

CPU_DIMS = {"intermediate_size": 128}  # whole weight groups


@pytest.mark.parametrize("tokens", [0, 1, 7, 64])
@pytest.mark.parametrize("topk", [1, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_layer_matches_the_dense_reference_cpu(workspace_init, tokens, topk, ep_size):
    if CUDA:
        pytest.skip("CPU path")
    torch.manual_seed(tokens + topk + ep_size)
    check_backend("triton_w4a8", tokens, topk, ep_size, "cpu", **CPU_DIMS)


@pytest.mark.parametrize("ep_size", [1, 4])
def test_kernels_in_the_pipeline_cpu(workspace_init, monkeypatch, ep_size):
    """CPU tensors normally take the references; here the Triton kernels
    (interpreted) run inside the experts pipeline."""
    if CUDA:
        pytest.skip("the GPU tests run the kernels")
    calls = []

    def interpreted(kernel):
        def run(*args):
            calls.append(kernel)
            return kernel(*args)

        return run

    for name, kernel in (
        ("grouped_gemm_w4a8_gated_reference", grouped_gemm_w4a8_gated),
        ("grouped_gemm_w4a8_reference", grouped_gemm_w4a8),
    ):
        monkeypatch.setattr(triton_w4a8_moe, name, interpreted(kernel))
    torch.manual_seed(ep_size)
    check_backend("triton_w4a8", 5, 2, ep_size, "cpu", **CPU_DIMS)
    assert calls == [grouped_gemm_w4a8_gated, grouped_gemm_w4a8]


def test_decode_kernels_in_the_pipeline_cpu(workspace_init, monkeypatch):
    """Up to DECODE_MAX_TOKENS tokens the GPU path streams the packed weights
    route by route (no sort, no fp8 activations): that path, interpreted."""
    if CUDA:
        pytest.skip("the GPU tests run it")
    monkeypatch.setattr(triton_w4a8_moe, "runs_gpu_kernels", lambda t: True)
    for name in ("grouped_gemm_w4a8_gated", "grouped_gemm_w4a8"):
        monkeypatch.setattr(triton_w4a8_moe, name, None)  # the decode path only
    torch.manual_seed(3)
    check_backend("triton_w4a8", 3, 2, 4, "cpu", **CPU_DIMS)


def test_past_top_64_takes_the_sorted_path_cpu(workspace_init, monkeypatch):
    """The decode kernels hold a token's routes in one GEMM2 program, top-64
    at most: top-65 takes the sorted path at one token (its GEMMs here
    through their references)."""
    if CUDA:
        pytest.skip("CPU path")
    monkeypatch.setattr(triton_w4a8_moe, "runs_gpu_kernels", lambda t: True)

    def refuse(*args):
        raise AssertionError("the decode kernels ran at top-65")

    monkeypatch.setattr(triton_w4a8_moe, "marlin_moe_decode", refuse)
    for name in ("grouped_gemm_w4a8_gated", "grouped_gemm_w4a8"):
        reference = getattr(triton_w4a8_moe, f"{name}_reference")
        monkeypatch.setattr(
            triton_w4a8_moe, name, lambda *a, scale_steps, ref=reference: ref(*a)
        )
    torch.manual_seed(4)
    check_backend("triton_w4a8", 1, 65, 1, "cpu", num_experts=80, **CPU_DIMS)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 1024])
@pytest.mark.parametrize("topk", [2, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_layer_matches_the_dense_reference_gpu(workspace_init, tokens, topk, ep_size):
    torch.manual_seed(tokens + topk + ep_size)
    check_backend("triton_w4a8", tokens, topk, ep_size, "cuda")


def test_two_layers_share_one_permute_scratch(workspace_init, device):
    moe = moe_config(device, scheme=QuantScheme.W4A8_UINT4, **CPU_DIMS)
    layers = [make_layer(moe, device, "triton_w4a8", seed=i) for i in range(2)]
    hidden = torch.randn(9, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(9, moe.num_experts, device=device)
    for layer in layers:
        hidden = layer(hidden, logits)
    assert not bool(hidden.isnan().any())
    report = workspace_init.memory_report()
    assert len(report.resources_of_type("MoEPermuteScratch")) == 1


def test_limits_are_named(device):
    odd = moe_config(device, scheme=QuantScheme.W4A8_UINT4, intermediate_size=64)
    assert "groups of 128, got" in str(TritonExpertsW4A8.unsupported(odd, device))
    fp8 = moe_config(device, scheme=QuantScheme.FP8_PER_TOKEN, **CPU_DIMS)
    assert "w4a8_uint4" in str(TritonExpertsW4A8.unsupported(fp8, device))
    moe = moe_config(device, scheme=QuantScheme.W4A8_UINT4, **CPU_DIMS)
    w = torch.zeros(moe.num_local_experts, 1, 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"w13: expected torch\.uint8"):
        TritonExpertsW4A8(moe, w, w.float(), w, w.float())


@pytest.mark.parametrize("capacity", [3, 80, 8192])
def test_workspaces_hold_the_grouped_rows_of_any_batch(device, capacity):
    """The workspaces are sized for a capacity of M tokens, and any batch up
    to it may come (under all2all a rank gets fewer than the capacity): the
    grouped kernels' 16-bit activation rows of every batch up to
    ``grouped_max_tokens`` fit workspace13, their output rows workspace2."""
    moe = moe_config(device, scheme=QuantScheme.W4A8_UINT4, **CPU_DIMS)
    experts = TritonExpertsW4A8.from_unquantized(moe, *random_weights(moe, device))
    k, i, topk = moe.hidden_size, moe.intermediate_size, moe.experts_per_token
    (ws13,), (ws2,), _ = experts.workspace_shapes(
        capacity, 2 * i, k, topk, moe.num_experts, moe.num_local_experts
    )
    batch = min(capacity, experts.grouped_max_tokens)
    assert ws13 >= batch * topk * i * moe.in_dtype.itemsize
    assert ws2 >= batch * topk * k * moe.in_dtype.itemsize
