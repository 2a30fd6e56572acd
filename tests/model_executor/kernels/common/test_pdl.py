"""Programmatic dependent launch: when it is on, and a CUDA graph of
dependent PDL kernels equal to the same kernels launched without it."""

import pytest
import torch

from vllm.model_executor.kernels.common.device_info import capability
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.rms_norm import rms_norm
from vllm.model_executor.kernels.common.skinny_gemm import (
    rms_norm_skinny_gemm,
    skinny_gemm,
)


def test_off_the_gpu():
    assert not pdl(torch.device("cpu"))


@pytest.mark.gpu
def test_on_from_hopper_unless_disabled(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("VLLM_DISABLE_PDL", raising=False)
    assert pdl(cuda) == ((capability(cuda) or (0, 0)) >= (9, 0))
    monkeypatch.setenv("VLLM_DISABLE_PDL", "1")
    assert not pdl(cuda)
    monkeypatch.delenv("VLLM_DISABLE_PDL")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no griddepcontrol there
    assert not pdl(cuda)


def _layers(x, residual, norm_weight, weights):
    """Each kernel reads the one before's output: a kernel that read it
    before its wait would see the previous replay's values. Every other
    layer's norm runs in its GEMM's prologue (reading a residual written
    two launches back)."""
    for i, w in enumerate(weights):
        if i % 2:
            x, residual = rms_norm_skinny_gemm(x, residual, norm_weight, 1e-6, w)
        else:
            h, residual = rms_norm(x, norm_weight, 1e-6, residual)
            x = skinny_gemm(h, w)
    return x, residual


@pytest.mark.gpu
def test_a_graph_of_dependent_kernels_equals_one_without(monkeypatch):
    torch.manual_seed(0)
    dim, cuda = 1024, torch.device("cuda")
    weights = [torch.randn(dim, dim, device=cuda).bfloat16() / 32 for _ in range(6)]
    norm_weight = torch.rand(dim, device=cuda).bfloat16() + 0.5
    x = torch.randn(2, dim, device=cuda).bfloat16()
    residual = torch.randn(2, dim, device=cuda).bfloat16()
    inputs = [(torch.randn_like(x), torch.randn_like(residual)) for _ in range(3)]

    monkeypatch.delenv("VLLM_DISABLE_PDL", raising=False)
    _layers(x, residual.clone(), norm_weight, weights)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_residual = _layers(x, residual, norm_weight, weights)
    monkeypatch.setenv("VLLM_DISABLE_PDL", "1")
    for new_x, new_residual in inputs:
        x.copy_(new_x)
        residual.copy_(new_residual)
        graph.replay()
        expected, expected_residual = _layers(
            new_x, new_residual.clone(), norm_weight, weights
        )
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        torch.testing.assert_close(out_residual, expected_residual, atol=0, rtol=0)
