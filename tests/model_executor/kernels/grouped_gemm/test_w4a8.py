"""The W4A8 grouped GEMMs against their references (on the CPU the Triton
kernels run interpreted), the weight format's round trip, and the named
argument errors."""

from typing import Any

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import POISON, sorted_routing
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import GroupedGemmConfig
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    dequantize_w4,
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
    grouped_gemm_w4a8_gated_reference,
    grouped_gemm_w4a8_reference,
    quantize_w4,
)

SMALL = GroupedGemmConfig(16, 32, 128, 4, 1)  # several N tiles, partial ones


def _weights(experts: int, n: int, k: int, device) -> tuple[torch.Tensor, ...]:
    return quantize_w4(torch.randn(experts, n, k, device=device) / k**0.5)


def _tokens(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    a = (torch.randn(rows, k, device=device) * 3).to(FP8_DTYPE)
    return a, torch.rand(rows, device=device) + 0.1


def test_quantize_w4_round_trip(device):
    w = torch.randn(3, 5, 256, device=device)
    w[0, 0, :128] = 0.0  # an all-zero group stays zero
    packed, scale = quantize_w4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 128)
    assert scale.shape == (3, 5, 2)
    back = dequantize_w4(packed, scale)
    assert bool((back[0, 0, :128] == 0).all())
    # within half a level of each group's step; the largest magnitude exact
    step = scale.repeat_interleave(128, -1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())
    peak = w.abs().unflatten(-1, (2, 128)).amax(-1)
    torch.testing.assert_close(back.abs().unflatten(-1, (2, 128)).amax(-1), peak)
    with pytest.raises(ValueError, match="w: expected K a multiple of 128"):
        quantize_w4(w[..., :100])


@pytest.mark.parametrize("counts", [[1], [5, 0, 21, 2], [0, 0], [40, 0, 3]], ids=str)
@pytest.mark.parametrize("k", [128, 384])  # one and three groups (K steps)
def test_plain_matches_reference(device, counts, k):
    torch.manual_seed(sum(counts) + k)
    n, spare = 80, 3
    rows = sum(counts) + spare
    a, a_scale = _tokens(rows, k, device)
    w, w_scale = _weights(len(counts), n, k, device)
    offsets = torch.tensor([0, *counts], device=device).cumsum(0)
    out = torch.full((rows, n), POISON, device=device, dtype=torch.bfloat16)
    ref = out.clone()
    grouped_gemm_w4a8(a, a_scale, w, w_scale, offsets, out, SMALL)
    grouped_gemm_w4a8_reference(a, a_scale, w, w_scale, offsets, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())  # never written


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("invalid", [0, 5])  # routes to non-local experts
def test_gated_matches_reference(device, activation, invalid):
    torch.manual_seed(invalid)
    tokens, topk, experts, inter, k = 9, 4, 5, 48, 256
    a, a_scale = _tokens(tokens, k, device)
    w13, w13_scale = _weights(experts, 2 * inter, k, device)
    src_routes, offsets = sorted_routing(tokens * topk, experts, device, invalid)
    out = torch.full((tokens * topk, inter), POISON, device=device)
    out = out.to(torch.bfloat16)
    ref = out.clone()
    args = (a, a_scale, src_routes, topk, w13, w13_scale, offsets, activation)
    grouped_gemm_w4a8_gated(*args, out, SMALL)
    grouped_gemm_w4a8_gated_reference(*args, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    written = int(offsets[-1])
    assert written == tokens * topk - invalid
    assert bool((out[written:] == POISON).all())


def test_bad_arguments_are_named(device):
    a, a_scale = _tokens(4, 128, device)
    w, w_scale = _weights(2, 32, 128, device)
    offsets = torch.tensor([0, 2, 4], device=device)
    out = torch.empty(4, 32, device=device, dtype=torch.bfloat16)
    good: dict[str, Any] = {"a": a, "a_scale": a_scale, "w": w, "w_scale": w_scale,
            "expert_first_token_offset": offsets, "out": out}  # fmt: skip
    for name, bad, message in (
        ("a", a.float(), "a: expected fp8 e4m3 rows"),
        ("a", a[:, :64].contiguous(), "K a positive multiple of 128"),
        ("a", a[:, :0].contiguous(), "K a positive multiple of 128"),
        ("w", w.view(torch.int8), "w: expected contiguous torch.uint8"),
        ("w_scale", w_scale[..., :0], "w_scale: expected contiguous"),
        ("a_scale", a_scale[:3], "a_scale: expected"),
        ("expert_first_token_offset", offsets.int(), "expert_first_token_offset"),
        ("out", out.float(), "out: expected bfloat16 or float16"),
        ("out", out[:, :16], "out: expected contiguous"),
    ):
        with pytest.raises(ValueError, match=message):
            grouped_gemm_w4a8(**(good | {name: bad}))
    routes = torch.zeros(4, dtype=torch.int32, device=device)
    gated = (a, a_scale, routes, 2, w, w_scale, offsets)
    with pytest.raises(ValueError, match="activation: expected one of"):
        grouped_gemm_w4a8_gated(*gated, "gelu", out[:, :16].contiguous())
    long_routes = (*gated[:2], routes.long(), *gated[3:], "silu")
    with pytest.raises(ValueError, match=r"src_routes: expected contiguous torch\.int"):
        grouped_gemm_w4a8_gated(*long_routes, out[:, :16].contiguous())
