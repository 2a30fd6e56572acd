"""``UnquantizedLinear``: ``nn.Linear``'s results at every row count, with
``skinny_gemm`` where it was measured to win."""

import pytest
import torch

from vllm.model_executor.layers import linear
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
# skinny at 1-2 rows, skinny at 1 row with PDL only, cuBLAS
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
    skinny = out_features <= {1: 5120 if with_pdl else 2048, 2: 2048}.get(rows, 0)
    assert skinny_calls == ([rows, rows] if skinny else [])
