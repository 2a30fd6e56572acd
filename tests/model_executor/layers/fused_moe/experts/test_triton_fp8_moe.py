"""TritonExpertsFp8: its kernels inside the pipeline and the group path."""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    CUDA,
    HOPPER,
    check_backend,
)
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_reference,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import Kernel, MoEGemmKernels
from vllm.model_executor.layers.fused_moe.experts import triton_fp8_moe


@pytest.mark.parametrize("ep_size", [1, 4])
def test_triton_fp8_kernel_in_the_pipeline_cpu(workspace_init, monkeypatch, ep_size):
    """CPU tensors normally take the GEMM's reference; here the Triton kernel
    itself (interpreted) runs inside the experts pipeline."""
    if CUDA:
        pytest.skip("the GPU tests run the kernel")
    calls = []

    def interpreted(kernel):
        def run(*args):
            calls.append(kernel)
            return kernel(*args)

        return run

    for name, kernel in (
        ("grouped_gemm_fp8_gated_reference", grouped_gemm_fp8_gated),
        ("grouped_gemm_fp8_reference", grouped_gemm_fp8),
    ):
        monkeypatch.setattr(triton_fp8_moe, name, interpreted(kernel))
    torch.manual_seed(ep_size)
    check_backend("triton_fp8", 7, 2, ep_size, "cpu")
    assert calls == [grouped_gemm_fp8_gated, grouped_gemm_fp8]


@pytest.mark.parametrize("ep_size", [1, 4])
@pytest.mark.parametrize("topk", [1, 8])
def test_triton_fp8_group_quantized_path_cpu(
    workspace_init, monkeypatch, ep_size, topk
):
    """Where both GEMMs take the Hopper kernels, GEMM1 writes its activation
    in fp8 with per-group scales and GEMM2 takes them (no pass between):
    that pipeline on the references (intermediate 208: a full and a partial
    group), against the dense reference."""
    if CUDA:
        pytest.skip("the GPU tests run it where the Hopper kernels apply")
    scales = []

    def gemm2(a, a_scale, *args):
        scales.append(a_scale.shape)
        return grouped_gemm_fp8_reference(a, a_scale, *args)

    hopper = MoEGemmKernels(Kernel.HOPPER, Kernel.HOPPER)
    monkeypatch.setattr(triton_fp8_moe, "moe_gemm_kernels", lambda *args: hopper)
    monkeypatch.setattr(triton_fp8_moe, "grouped_gemm_fp8_reference", gemm2)
    torch.manual_seed(ep_size + topk)
    check_backend("triton_fp8", 64, topk, ep_size, "cpu", intermediate_size=208)
    assert scales == [(64 * topk, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs sm90")
@pytest.mark.parametrize("ep_size", [1, 4])
def test_triton_fp8_takes_the_group_path_on_hopper(
    workspace_init, monkeypatch, ep_size
):
    """At 1024 tokens (top-8, 32 experts: 256 routes per expert) the layer's
    GEMM2 gets group scales from GEMM1; the layer matches the reference."""
    scales = []

    def gemm2(a, a_scale, *args, **kwargs):
        scales.append(a_scale.shape)
        return grouped_gemm_fp8(a, a_scale, *args, **kwargs)

    monkeypatch.setattr(triton_fp8_moe, "grouped_gemm_fp8", gemm2)
    torch.manual_seed(ep_size)
    check_backend("triton_fp8", 1024, 8, ep_size, "cuda")
    assert scales == [(1024 * 8, 768 // 128)]
