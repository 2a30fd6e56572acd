"""The Hopper kernels with packed uint4 weights: W4A8's carried rescaling
on the CPU, the builds for sm90 without a GPU (W4A8 plain and gated, W4A16
plain), and launches against the references (W4A8 through its launchers,
W4A16 through the plain kernel's)."""

import itertools

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    EXPERT_COUNTS,
    POISON,
    assert_hopper_builds,
    compile_for_sm90,
    needs_hopper,
    sorted_routing,
)
from vllm.model_executor.kernels.common.activation_quant import (
    SWIGLU_ALPHA,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    deinterleave_gate_up,
    hopper_common,
    hopper_gated,
    hopper_plain,
    hopper_uint4,
)
from vllm.model_executor.kernels.grouped_gemm.hopper_uint4 import w4_scale_steps
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    W4_GROUP,
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
    grouped_gemm_w4a8_gated_reference,
    grouped_gemm_w4a8_reference,
    quantize_w4,
)
from vllm.model_executor.kernels.marlin.packing import (
    dequantize_weights,
    quantize_weights,
    repack_weights,
)


def test_scale_steps_carry_the_group_scales():
    """Carrying a sum in units of the current group's scales (multiply by
    the step, add the group's product) and multiplying by the last scales
    gives the scaled sum, for scales that differ by up to 10^6."""
    torch.manual_seed(0)
    experts, n, groups = 3, 7, 5
    spread = 10.0 ** torch.randint(-3, 4, (1, 1, groups))
    scale = (torch.rand(experts, n, groups) + 0.1) * spread
    products = torch.randn(experts, groups, n)  # one unscaled product per group
    steps, last = w4_scale_steps(scale)
    assert steps.shape == (experts, groups, n) and last.shape == (experts, n)
    carried = products[:, 0]
    for g in range(1, groups):
        carried = carried * steps[:, g] + products[:, g]
    terms = products * scale.transpose(1, 2)
    largest = float(terms.abs().max())
    torch.testing.assert_close(
        carried * last, terms.sum(1), rtol=1e-5, atol=1e-6 * largest
    )


def kernel_args(
    a_dtype: torch.dtype = FP8_DTYPE,
) -> tuple[dict[str, object], dict[str, object]]:
    """Host arguments of the plain and the gated kernel for packed weights
    and A of ``a_dtype``, as the launchers pass them."""
    rows, experts, n, k, topk = 256, 4, 512, 256, 2
    a = torch.empty(rows, k, dtype=a_dtype)
    w = torch.empty(experts * n, k // 2, dtype=torch.uint8)
    box = hopper_uint4.packed_box(w, a)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    act = torch.empty(rows, n // 2, dtype=torch.bfloat16)
    sub, block_n = hopper_common.SUB.value, hopper_common.BLOCK_N.value
    scales = {
        "w_scale_ptr": torch.empty(experts * n),
        # W4A8's scale steps, or W4A16's scales
        "w_steps_ptr": torch.empty(
            experts * n * k // W4_GROUP,
            dtype=torch.float32 if a_dtype == FP8_DTYPE else a_dtype,
        ),
    }
    plain = {
        "a_desc": hopper_common.k_box(a, hopper_common.BLOCK_M.value),
        "w_desc": box,
        "a_scale_ptr": torch.empty(rows),
        **scales,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": out,
        "out_desc": hopper_common.descriptor(out, [sub, block_n]),
        "N": n,
        "K": k,
        "groups": 1,
        "num_experts": experts,
    }
    gated = {
        "a_ptr": a,
        "a_scale_ptr": torch.empty(rows),
        "src_routes_ptr": torch.empty(rows, dtype=torch.int32),
        "w_desc": box,
        **scales,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": act,
        "out_desc": hopper_common.descriptor(act, [sub, block_n // 2]),
        "out_scale_ptr": act,
        "inter": n // 2,
        "K": k,
        "num_experts": experts,
        "topk": topk,
    }
    return plain, gated


def compile_kernels() -> None:
    """Both kernels with packed weights and fp8 A, and the plain one with
    bf16 A (W4A16; run in a process of its own by the test below)."""
    plain, gated = kernel_args()
    plain_16 = kernel_args(torch.bfloat16)[0]
    compile_for_sm90(
        [
            (
                hopper_plain._grouped_gemm_warp_specialized_kernel,
                plain,
                {"GROUPED": False, "W4": True},
            ),
            (
                hopper_plain._grouped_gemm_warp_specialized_kernel,
                plain_16,
                {"GROUPED": False, "W4": True},
            ),
            (
                hopper_gated._grouped_gemm_gated_warp_specialized_kernel,
                gated,
                {"MODE": 1, "ALPHA": 1.0, "LIMIT": 7.0, "QUANT": False, "W4": True},
            ),
        ]
    )


def test_compiles_for_sm90_without_a_gpu():
    """All three build for Hopper with the installed Triton, fit the shared
    memory of a block (the unpacked double buffer beside the ring), and
    ptxas leaves their wgmmas overlapped."""
    assert_hopper_builds(
        "tests.model_executor.kernels.grouped_gemm.test_hopper_uint4", 6
    )


def _weights(experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed weights whose group scales differ by up to 10^4 along K."""
    w = torch.randn(experts, n, k, device="cuda") / k**0.5
    spread = 10 ** torch.randint(-2, 3, (experts, n, k // W4_GROUP), device="cuda")
    return quantize_w4(w * spread.repeat_interleave(W4_GROUP, -1))


# fp8 MMAs add with fewer mantissa bits than fp32: a sum is off by a share
# of the sum of its terms' magnitudes (group-scale spreads make that far
# larger than the sum); this share is well above what the H200 showed and
# far below a wrong or missing product (a sum of K random-signed terms is
# ~K^-0.5 of their magnitudes).
MMA_ERROR = 4e-3
GATE_MINIMUM = -1.2785  # where x * sigmoid(x) is lowest


def _magnitudes(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|a| and packed |w| (|q - 8| + 8 per nibble): the reference of these
    sums the magnitudes of the terms."""
    a_abs = (a.view(torch.uint8) & 0x7F).view(FP8_DTYPE)
    low, high = (w & 15).int(), (w >> 4).int()
    low, high = (low - 8).abs() + 8, (high - 8).abs() + 8
    return a_abs, (low | (high << 4)).to(torch.uint8)


def _activation_bound(
    activation: str, sums: torch.Tensor, margin: torch.Tensor
) -> torch.Tensor:
    """The largest change of the activation of ``sums`` [R, 2I] (gate, up)
    when each moves by up to ``margin``: over the box's corners, its
    middles, and the gate's own minimum (x * sigmoid(alpha x) falls, then
    rises) where the box holds it; the up factor is linear."""
    gate, up = sums.chunk(2, dim=-1)
    d_gate, d_up = margin.chunk(2, dim=-1)
    alpha = SWIGLU_ALPHA if activation == "swiglu" else 1.0
    lowest = torch.clamp(
        torch.full_like(gate, GATE_MINIMUM / alpha), gate - d_gate, gate + d_gate
    )
    center = gated_act_reference(activation, sums)
    bound = torch.zeros_like(center)
    for g, u in itertools.product(
        (gate - d_gate, gate, gate + d_gate, lowest), (up - d_up, up, up + d_up)
    ):
        moved = gated_act_reference(activation, torch.cat([g, u], -1))
        bound = torch.maximum(bound, (moved - center).abs())
    return bound


def _within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    error = (out.float() - ref.float()).abs()
    allowed = bound + 1.6e-2 * ref.float().abs()  # + bf16 rounding
    if error.numel() == 0:  # every expert empty: nothing written
        return
    worst = int((error - allowed).argmax())
    assert bool((error <= allowed).all()), (
        f"{int((error > allowed).sum())} of {error.numel()} outside; worst: "
        f"{float(out.flatten()[worst])} against {float(ref.flatten()[worst])}"
    )


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize("n,k", [(512, 256), (2048, 768), (264, 128)], ids=str)
def test_plain_matches_reference(counts, n, k):
    """Several N tiles and groups, a partial N tile (264), halves full,
    partial or empty; rows past the last expert's end stay untouched."""
    torch.manual_seed(sum(counts) + n + k)
    rows = sum(counts) + 17
    a = (torch.randn(rows, k, device="cuda") * 3).to(FP8_DTYPE)
    a_scale = torch.rand(rows, device="cuda") + 0.1
    w, w_scale = _weights(len(counts), n, k)
    offsets = torch.tensor([0, *counts], device="cuda").cumsum(0)
    out = torch.full((rows, n), POISON, device="cuda", dtype=torch.bfloat16)
    ref = out.clone()
    steps = w4_scale_steps(w_scale)
    grouped_gemm_w4a8(a, a_scale, w, w_scale, offsets, out, scale_steps=steps)
    grouped_gemm_w4a8_reference(a, a_scale, w, w_scale, offsets, ref)
    terms = torch.zeros_like(ref)
    a_abs, w_abs = _magnitudes(a, w)
    grouped_gemm_w4a8_reference(a_abs, a_scale, w_abs, w_scale, offsets, terms)
    written = sum(counts)
    _within(out[:written], ref[:written], MMA_ERROR * terms[:written].float())
    assert bool((out[written:] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(512, 256), (264, 384)], ids=str)
def test_plain_w4a16_matches_reference(counts, n, k, dtype):
    """W4A16 on the plain kernel: Marlin's words unpacked to ``(q - 8) *
    scale`` as the reference rounds them, so each element is off by its
    output's rounding only; halves full, partial or empty, a partial N tile
    (264), three groups of two K steps; rows past the last expert's end
    stay untouched."""
    torch.manual_seed(sum(counts) + n + k)
    rows = sum(counts) + 17
    a = torch.randn(rows, k, device="cuda").to(dtype)
    quantized = [
        quantize_weights(torch.randn(n, k, device="cuda"), W4_GROUP) for _ in counts
    ]
    packed = torch.stack([repack_weights(q) for q, _ in quantized])
    scales = torch.stack([s.to(dtype) for _, s in quantized])
    offsets = torch.tensor([0, *counts], device="cuda").cumsum(0)
    out = torch.full((rows, n), POISON, device="cuda", dtype=dtype)
    hopper_plain.launch(a, None, packed, None, offsets, out, w_steps=scales)
    bounds = offsets.tolist()
    ref = torch.cat(
        [
            a[lo:hi].float() @ dequantize_weights(w, s, W4_GROUP).float().t()
            for w, s, lo, hi in zip(packed, scales, bounds, bounds[1:], strict=False)
        ]
    )
    written = sum(counts)
    torch.testing.assert_close(out[:written].float(), ref, rtol=2**-7, atol=1e-3)
    assert bool((out[written:] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "tokens,topk,experts,inter,k,invalid",
    [
        (1, 1, 4, 128, 128, 0),  # one row
        (60, 3, 2, 136, 256, 9),  # a partial gate/up tile, non-local routes
        (300, 8, 16, 768, 2048, 0),  # model dims, ~150 rows per expert
        (64, 8, 256, 128, 128, 0),  # 256 experts
    ],
)
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
def test_gated_matches_reference(tokens, topk, experts, inter, k, invalid, activation):
    torch.manual_seed(tokens + experts + k)
    a = (torch.randn(tokens, k, device="cuda") * 3).to(FP8_DTYPE)
    a_scale = torch.rand(tokens, device="cuda") + 0.1
    w13, w13_scale = _weights(experts, 2 * inter, k)
    src_routes, offsets = sorted_routing(tokens * topk, experts, "cuda", invalid)
    out = torch.full(
        (tokens * topk, inter), POISON, device="cuda", dtype=torch.bfloat16
    )
    ref = out.clone()
    args = (a, a_scale, src_routes, topk, w13, w13_scale, offsets, activation)
    steps = w4_scale_steps(w13_scale)
    grouped_gemm_w4a8_gated(*args, out, scale_steps=steps)
    grouped_gemm_w4a8_gated_reference(*args, ref)
    # The activation of gate and up sums each off by up to MMA_ERROR times
    # its terms' magnitudes: bounded by its largest change over that box.
    written = int(offsets[-1])
    gathered = src_routes.long() // topk
    rows = a.view(torch.uint8)[gathered].view(FP8_DTYPE)
    sums = torch.empty(tokens * topk, 2 * inter, device="cuda", dtype=torch.bfloat16)
    terms = torch.empty_like(sums)
    grouped_gemm_w4a8_reference(rows, a_scale[gathered], w13, w13_scale, offsets, sums)
    rows_abs, w13_abs = _magnitudes(rows, w13)
    grouped_gemm_w4a8_reference(
        rows_abs, a_scale[gathered], w13_abs, w13_scale, offsets, terms
    )
    sums = deinterleave_gate_up(sums[:written].float())
    margin = MMA_ERROR * deinterleave_gate_up(terms[:written].float())
    _within(out[:written], ref[:written], _activation_bound(activation, sums, margin))
    assert bool((out[written:] == POISON).all())


def test_bad_scale_steps_are_named(device):
    a = torch.zeros(4, 128, device=device).to(FP8_DTYPE)
    w, w_scale = quantize_w4(torch.randn(2, 32, 128, device=device))
    offsets = torch.tensor([0, 2, 4], device=device)
    out = torch.empty(4, 32, device=device, dtype=torch.bfloat16)
    steps, last = w4_scale_steps(w_scale)
    args = (a, torch.ones(4, device=device), w, w_scale, offsets, out)
    with pytest.raises(ValueError, match="w_steps: expected contiguous"):
        grouped_gemm_w4a8(*args, scale_steps=(steps[:, :, :16], last))
    with pytest.raises(ValueError, match="w_last: expected contiguous"):
        grouped_gemm_w4a8(*args, scale_steps=(steps, last.double()))


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), -1.0])
def test_scale_steps_refuse_scales_they_cannot_carry(bad):
    """A zero scale would divide the carried sum by zero (the Triton kernels
    take it): refused by name, as are infinite, NaN and negative ones."""
    scale = torch.rand(2, 3, 4) + 0.1
    scale[1, 2, 1] = bad
    with pytest.raises(ValueError, match="w_scale: expected finite positive"):
        w4_scale_steps(scale)
