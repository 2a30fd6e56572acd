"""``UnquantizedLinear``: ``nn.Linear``'s results at every row count."""

import pytest
import torch

from vllm.model_executor.layers.linear import UnquantizedLinear


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 17, 64])
def test_matches_nn_linear(device, rows):
    torch.manual_seed(rows)
    layer = UnquantizedLinear(256, 80, dtype=torch.bfloat16, device=device)
    layer.weight.normal_()
    x = torch.randn(rows, 256, device=device, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float()).bfloat16()
    out = layer(x)
    assert out.shape == (rows, 80) and not layer.weight.requires_grad
    torch.testing.assert_close(out, ref, atol=0.1, rtol=2e-2)
    # leading dims pass through
    assert layer(x.view(1, rows, 256)).shape == (1, rows, 80)
