import pytest
import torch

from vllm.model_executor.kernels.common.activation_quant import act_and_quant
from vllm.model_executor.kernels.common.fp8 import (
    FP8_DTYPE,
    per_token_quant_fp8,
)
from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation

POISON = -3.0


def reference(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The plain-PyTorch path (CPU tensors take it), back on x's device."""
    x_cpu = x.cpu().float()
    if activation is None:
        return x_cpu.to(x.device)
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    return apply_moe_activation(activation, out, x_cpu).to(x.device)


@pytest.mark.parametrize("activation", [None, "silu", "swiglu"])
@pytest.mark.parametrize("rows,cols", [(0, 32), (1, 48), (5, 37), (70, 48), (3, 2500)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_only(device, activation, rows, cols, dtype):
    torch.manual_seed(rows * cols)
    width = 2 * cols if activation else cols
    x = (torch.randn(rows, width, device=device) * 4).to(dtype)
    out = torch.full((rows, cols), POISON, device=device, dtype=dtype)
    act_and_quant(x, out, activation)
    expected = reference(x, activation).to(dtype)
    torch.testing.assert_close(
        out, expected, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-3, atol=1e-3
    )


@pytest.mark.parametrize("activation", [None, "silu", "swiglu"])
@pytest.mark.parametrize("rows,cols", [(1, 64), (6, 37), (2, 2500)])
def test_fp8_quant_matches_reference(device, activation, rows, cols):
    torch.manual_seed(rows + cols)
    width = 2 * cols if activation else cols
    x = (torch.randn(rows, width, device=device) * 3).to(torch.bfloat16)
    x[0, :] = 0  # an all-zero row stays finite
    q = torch.full((rows, cols), POISON, device=device).to(FP8_DTYPE)
    scale = torch.full((rows,), POISON, device=device)
    act_and_quant(x, q, activation, scale)
    ref_q, ref_scale = per_token_quant_fp8(reference(x, activation))
    # The compiled kernel may use approximate division: a few ulp.
    torch.testing.assert_close(scale, ref_scale.view(-1), rtol=4e-6, atol=0)
    # Rounding may differ by one fp8 step (2^-3 relative for e4m3; 2^-9 of
    # the scale for subnormals): the kernel multiplies by the reciprocal.
    deq = q.float() * scale[:, None]
    ref = ref_q.float() * ref_scale
    assert (q.float() != ref_q.float()).float().mean().item() < 0.05
    if device.type == "cuda":
        # Triton's interpreter mis-rounds fp8 casts just below a power of two
        # (126.9 -> 64), so the bound per element only holds on the GPU.
        one_step = 0.125 * ref.abs() + 2**-9 * scale[:, None]
        assert bool(((deq - ref).abs() <= one_step + 1e-12).all())
    assert bool(torch.isfinite(deq).all())


def test_bad_arguments(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="activation"):
        act_and_quant(x, torch.empty(4, 32, device=device), "gelu")
    with pytest.raises(ValueError, match="out"):
        act_and_quant(x, torch.empty(4, 64, device=device), "silu")
    with pytest.raises(ValueError, match="out_scale"):
        act_and_quant(x, torch.empty(4, 32, device=device).to(FP8_DTYPE), "silu")
    with pytest.raises(ValueError, match="x"):
        act_and_quant(x.t(), torch.empty(64, 2, device=device), "silu")
    with pytest.raises(ValueError, match="x"):
        act_and_quant(x[0], torch.empty(32, device=device), "silu")
