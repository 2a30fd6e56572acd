"""The decode-size GEMM against ``x.float() @ w.float().T`` (rounded once)."""

import pytest
import torch

from vllm.model_executor.kernels.common.skinny_gemm import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    default_skinny_config,
    skinny_gemm,
    skinny_gemm_reference,
)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 17, 80), (16, 33, 64)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_matches_reference(device, m, n, k, split_k):
    torch.manual_seed(m * 100 + n + split_k)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n + 5, k, device=device, dtype=torch.bfloat16)[:n]
    # K steps of 32 that do not divide K (80) and slices of unequal steps
    config = SkinnyConfig(block_n=16, block_k=32, split_k=split_k)
    out = skinny_gemm(x, weight, config)
    torch.testing.assert_close(
        out, skinny_gemm_reference(x, weight), atol=2e-2, rtol=2e-2
    )


def test_strided_rows_and_empty(device):
    x = torch.randn(4, 2, 64, device=device, dtype=torch.bfloat16)[
        :, 1
    ]  # row stride 128
    weight = torch.randn(24, 64, device=device, dtype=torch.bfloat16)
    config = SkinnyConfig(block_k=32)
    torch.testing.assert_close(
        skinny_gemm(x, weight, config),
        skinny_gemm_reference(x, weight),
        atol=2e-2,
        rtol=2e-2,
    )
    assert skinny_gemm(x[:0], weight).shape == (0, 24)


def test_default_config_fills_the_gpu():
    # qwen3-30b-a3b on 132 SMs: q/k/v (320 programs) unsplit, the router
    # (8 row blocks) split to one 256-wide K step per program
    assert default_skinny_config(5120, 2048, 132).split_k == 1
    assert default_skinny_config(128, 2048, 132).split_k == 8
    assert default_skinny_config(2048, 4096, 132).split_k == 4


def test_bad_arguments_are_named(device):
    w = torch.randn(8, 32, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected"):
        skinny_gemm(torch.randn(SKINNY_MAX_ROWS + 1, 32, device=device).bfloat16(), w)
    with pytest.raises(ValueError, match="x: expected"):
        skinny_gemm(torch.randn(2, 32, device=device), w.float())  # fp32
    with pytest.raises(ValueError, match="weight: expected"):
        skinny_gemm(torch.randn(2, 16, device=device).bfloat16(), w)
    with pytest.raises(ValueError, match="weight: expected"):
        skinny_gemm(torch.randn(2, 32, device=device).half(), w)
