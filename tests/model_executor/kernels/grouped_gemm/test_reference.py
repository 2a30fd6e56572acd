import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    POISON,
    bf16_gated_problem,
    problem,
)
from vllm.model_executor.kernels.common.activation_quant import gated_act_reference
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from vllm.model_executor.kernels.grouped_gemm import (
    act_groups,
    deinterleave_gate_up,
    grouped_gemm_fp8_reference,
    grouped_gemm_gated_reference,
    grouped_gemm_reference,
    quantize_groups_reference,
)
from vllm.model_executor.kernels.grouped_gemm.reference import dequantize_rows


def test_group_quantization_round_trips(device):
    """One scale per row and 128 columns (the last group partial), set by
    the group's absolute maximum; an all-zero group stays finite."""
    torch.manual_seed(3)
    y = torch.randn(5, 300, device=device)
    y[:, 128:256] *= 1e3  # groups of very different magnitude
    y[1, 256:] = 0.0
    q, scale = quantize_groups_reference(y)
    assert q.dtype == FP8_DTYPE and q.shape == (5, 300) and q.is_contiguous()
    assert scale.shape == (5, act_groups(300)) == (5, 3)
    torch.testing.assert_close(scale[:, 1], y[:, 128:256].abs().amax(1) / FP8_MAX)
    assert scale[1, 2] == MIN_SCALE / FP8_MAX
    # fp8 e4m3 keeps 3 mantissa bits: within 2^-4 of each value (normals),
    # half a subnormal step (2^-10 of the group's scale) below.
    back = dequantize_rows(q, scale)
    unit = dequantize_rows(torch.ones_like(q), scale)
    assert bool(((back - y).abs() <= 2**-4 * y.abs() + unit * 2**-10).all())
    assert bool((back[1, 256:] == 0).all())


def test_group_scaled_reference_sums_the_groups(device):
    """The reference GEMM with per-group scales: each K group times its own
    row scales (K = 200: a full and a partial group)."""
    torch.manual_seed(4)
    a, _, w, w_scale, offsets = problem([3, 0, 6], 24, 200, device, spare_rows=2)
    scale = torch.rand(a.shape[0], 2, device=device)
    scale[:, 1] *= 50.0
    out = torch.full((11, 24), POISON, device=device, dtype=torch.bfloat16)
    grouped_gemm_fp8_reference(a, scale, w, w_scale, offsets, out)
    for rows, e in ((slice(0, 3), 0), (slice(3, 9), 2)):
        want = sum(
            (a[rows, g * 128 : (g + 1) * 128].float() * scale[rows, g, None])
            @ w[e, :, g * 128 : (g + 1) * 128].float().t()
            for g in range(2)
        )
        want = (want * w_scale[e]).bfloat16()
        torch.testing.assert_close(out[rows], want)  # bf16 tolerances
    assert bool((out[9:] == POISON).all())


def test_gated_reference_is_the_plain_gemm_on_gathered_rows(device):
    """The two references agree: the gated one equals the plain one on the
    gathered token rows, then the activation of the deinterleaved halves."""
    torch.manual_seed(0)
    a, src_routes, topk, w13, offsets = bf16_gated_problem(9, 2, 3, 24, 40, device)
    act = torch.full((18, 24), POISON, device=device)
    act = grouped_gemm_gated_reference(
        a, src_routes, topk, w13, offsets, "silu", act.bfloat16()
    )
    gathered = a[src_routes.long() // topk]
    product = torch.empty(18, 48, device=device, dtype=torch.bfloat16)
    grouped_gemm_reference(gathered, w13, offsets, product)
    expected = gated_act_reference("silu", deinterleave_gate_up(product.float()))
    # The plain path rounds the product to bf16 before the activation.
    torch.testing.assert_close(act, expected.bfloat16(), rtol=2e-2, atol=2e-2)
