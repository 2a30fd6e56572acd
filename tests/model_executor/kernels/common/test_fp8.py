import pytest
import torch

from vllm.model_executor.kernels.common.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    per_channel_quant_fp8,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)


def assert_within_fp8_rounding(deq: torch.Tensor, x: torch.Tensor, scale) -> None:
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16); values below its
    # smallest normal (2^-6 of the scale) round to steps of 2^-9 of it.
    bound = x.abs() / 16 + torch.as_tensor(scale) * 2**-9
    assert ((deq - x).abs() <= bound).all()


def test_per_token_scales_each_row_to_the_fp8_range():
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.0])[:, None]
    q, scale = per_token_quant_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    torch.testing.assert_close(scale[:4, 0], x[:4].abs().amax(1) / FP8_MAX)
    assert scale[4, 0] == MIN_SCALE / FP8_MAX  # an all-zero row stays finite
    assert q.float().abs().amax(1)[:4].eq(FP8_MAX).all()
    assert_within_fp8_rounding(q.float() * scale, x, scale)


def test_per_token_group_has_one_scale_per_group():
    torch.manual_seed(1)
    x = torch.randn(3, 256)
    x[1, 128:] *= 100  # the second group of row 1 alone gets a large scale
    q, scale = per_token_group_quant_fp8(x, 128)
    assert scale.shape == (3, 2)
    torch.testing.assert_close(scale, x.view(3, 2, 128).abs().amax(-1) / FP8_MAX)
    deq = q.float().view(3, 2, 128) * scale[..., None]
    assert_within_fp8_rounding(deq, x.view(3, 2, 128), scale[..., None])
    with pytest.raises(ValueError, match="x: hidden size 200 is not a multiple"):
        per_token_group_quant_fp8(torch.randn(2, 200), 128)


def test_per_channel_keeps_the_leading_dims():
    torch.manual_seed(2)
    w = torch.randn(4, 8, 32)
    q, scale = per_channel_quant_fp8(w)
    assert q.shape == w.shape and scale.shape == (4, 8)
    assert_within_fp8_rounding(q.float() * scale[..., None], w, scale[..., None])
