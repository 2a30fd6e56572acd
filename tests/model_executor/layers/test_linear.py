"""``UnquantizedLinear``: ``nn.Linear``'s results at every row count, with
``skinny_gemm`` where it was measured to win."""

import pytest
import torch

from vllm.model_executor.kernels.common.rms_norm import rms_norm_reference
from vllm.model_executor.layers import linear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinear


@pytest.fixture
def skinny_calls(monkeypatch):
    """The layer's GPU dispatch on any device (on CPU the Triton kernel runs
    under the interpreter); counts the ``skinny_gemm`` calls."""
    calls: list[int] = []
    real = linear.skinny_gemm

    def counted(x, weight):
        calls.append(x.shape[0])
        return real(x, weight)

    monkeypatch.setattr(linear, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(linear, "skinny_gemm", counted)
    return calls


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 64])
# skinny at 1-2 rows; past 2048 rows skinny at 1 row with PDL only (whole K)
@pytest.mark.parametrize("out_features", [80, 4096, 6144])
@pytest.mark.parametrize("with_pdl", [True, False])
def test_matches_nn_linear(
    device, rows, out_features, with_pdl, skinny_calls, monkeypatch
):
    monkeypatch.setattr(linear, "pdl", lambda device: with_pdl)
    torch.manual_seed(rows)
    layer = UnquantizedLinear(256, out_features, dtype=torch.bfloat16, device=device)
    layer.weight.normal_()
    x = torch.randn(rows, 256, device=device, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float()).bfloat16()
    out = layer(x)
    assert out.shape == (rows, out_features) and not layer.weight.requires_grad
    torch.testing.assert_close(out, ref, atol=0.1, rtol=2e-2)
    # leading dims pass through
    assert layer(x.view(1, rows, 256)).shape == (1, rows, out_features)
    one_row_any_n = rows == 1 and with_pdl  # K = 256: whole-K tiles
    skinny = one_row_any_n or (rows in (1, 2) and out_features <= 2048)
    assert skinny_calls == ([rows, rows] if skinny else [])


@pytest.mark.parametrize("rows", [1, 2, 3])
# skinny at 1-2 rows; at 1 row (whole K) only
@pytest.mark.parametrize("out_features", [80, 6144])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_linear_fuses_the_norm_where_skinny_runs(
    device, rows, out_features, with_residual, monkeypatch
):
    """``rms_norm_linear``: the norm in the GEMM's kernel where
    ``skinny_gemm`` takes the product, else the norm then the linear; the
    same product and sum either way, the residual left as it was."""
    fused: list[int] = []
    real = linear.rms_norm_skinny_gemm

    def counted(x, *args):
        fused.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(linear, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(linear, "pdl", lambda device: True)
    monkeypatch.setattr(linear, "rms_norm_skinny_gemm", counted)
    torch.manual_seed(rows * 10 + out_features)
    layer = UnquantizedLinear(256, out_features, dtype=torch.bfloat16, device=device)
    layer.weight.normal_()
    norm = RMSNorm(256, 1e-6, dtype=torch.bfloat16, device=device)
    norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(rows, 256, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    before = None if residual is None else residual.clone()
    out, total = linear.rms_norm_linear(norm, layer, x, residual)
    _, expected_total = rms_norm_reference(x, norm.weight, 1e-6, residual)
    # the product of the norm of the kernel's own sum (the interpreter rounds
    # that sum to bf16 by truncation)
    normed, _ = rms_norm_reference(total, norm.weight, 1e-6)
    ref = torch.nn.functional.linear(normed.float(), layer.weight.float()).bfloat16()
    torch.testing.assert_close(out, ref, atol=0.25, rtol=2e-2)
    if residual is None:
        assert total is x
    else:
        # one bf16 step: the interpreter rounds the sum to bf16 by truncation
        torch.testing.assert_close(total, expected_total, atol=1e-6, rtol=2**-7)
        assert before is not None and torch.equal(residual, before)
    skinny = rows == 1 or (rows == 2 and out_features == 80)
    assert fused == ([rows] if skinny else [])
