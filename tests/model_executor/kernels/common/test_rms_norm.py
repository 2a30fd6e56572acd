"""The fused residual-add RMSNorm kernel against its reference. 16-bit
results may differ by an ulp or two (the fp32 sum order; the interpreter
rounds to bf16 by truncation)."""

import pytest
import torch

from vllm.model_executor.kernels.common.rms_norm import rms_norm, rms_norm_reference

BF16 = (1e-2, 2 * 2**-6)  # atol, rtol: two bf16 ulps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (7, 96), (0, 32)])
def test_matches_reference_with_and_without_residual(device, dtype, rows, cols):
    torch.manual_seed(rows + cols)
    x = torch.randn(rows, cols, device=device, dtype=dtype) * 3
    weight = torch.randn(cols, device=device, dtype=dtype)
    atol, rtol = (1e-6, 1e-5) if dtype == torch.float32 else BF16
    out, none = rms_norm(x, weight, 1e-6)
    ref, _ = rms_norm_reference(x, weight, 1e-6)
    assert none is None
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    residual = torch.randn(rows, cols, device=device, dtype=dtype)
    ref, ref_sum = rms_norm_reference(x, weight, 1e-6, residual)
    out, total = rms_norm(x, weight, 1e-6, residual)
    assert total is not None and ref_sum is not None
    torch.testing.assert_close(total, ref_sum, atol=atol, rtol=rtol)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_strided_rows_and_the_residual_left_as_it_was(device):
    torch.manual_seed(0)
    x = torch.randn(5, 80, device=device)[:, :48]  # rows 80 apart
    weight = torch.randn(48, device=device)
    residual = torch.randn(5, 56, device=device)[:, 8:]  # rows 56 apart
    before = residual.clone()
    out, total = rms_norm(x, weight, 1e-5, residual)
    assert total is not None and total.data_ptr() != residual.data_ptr()
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5, residual)[0])
    assert torch.equal(residual, before)


def test_bad_shapes_are_named(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="x/weight: expected"):
        rms_norm(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="x/weight: expected"):
        rms_norm(x, torch.ones(32, device=device)[::2], 1e-6)  # strided weight
    with pytest.raises(ValueError, match="residual: expected"):
        rms_norm(
            x, torch.ones(16, device=device), 1e-6, torch.randn(4, 8, device=device)
        )
