"""The gated Hopper kernel: built for sm90 without a GPU, and launched
directly (an H200) against the reference, with 16-bit, fp8 and
group-quantized fp8 outputs."""

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    GATED_CASES,
    HALF_BOUNDARIES,
    POISON,
    assert_hopper_builds,
    compile_for_sm90,
    counted_gated_problem,
    gated_problem,
    needs_hopper,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    act_groups,
    grouped_gemm_fp8_gated_reference,
    hopper_common,
    hopper_gated,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import hopper_supports_gated
from vllm.model_executor.kernels.grouped_gemm.reference import dequantize_rows

GROUP = hopper_common.GROUP.value


def kernel_args(
    operand: torch.dtype,
) -> tuple[dict[str, object], dict[str, object]]:
    """Host arguments of the kernel and of its fp8-out variant for
    ``operand`` (fp8 or 16-bit) A and weights, as the launcher passes them
    (16-bit calls pass ``out`` for the scales they never read)."""
    rows, experts, n, k, topk = 256, 4, 512, 256, 2
    fp8 = operand == FP8_DTYPE
    a = torch.empty(rows, k, dtype=operand)
    w = torch.empty(experts * n, k, dtype=operand)
    act = torch.empty(rows, n // 2, dtype=torch.bfloat16)
    act_q = torch.empty(rows, n // 2, dtype=FP8_DTYPE)
    act_block = [hopper_common.BLOCK_M.value // 2, hopper_common.BLOCK_N.value // 2]
    gated = {
        "a_ptr": a,
        "a_scale_ptr": torch.empty(rows) if fp8 else act,
        "src_routes_ptr": torch.empty(rows, dtype=torch.int32),
        "w_desc": hopper_common.k_box(w, hopper_common.BLOCK_N.value),
        "w_scale_ptr": torch.empty(experts * n) if fp8 else act,
        "w_steps_ptr": act,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": act,
        "out_desc": hopper_common.descriptor(act, act_block),
        "out_scale_ptr": torch.empty(rows, n // 2 // GROUP),
        "inter": n // 2,
        "K": k,
        "num_experts": experts,
        "topk": topk,
    }
    quantized = {**gated, "out_desc": hopper_common.descriptor(act_q, act_block)}
    return gated, quantized


def compile_kernels() -> None:
    """fp8 with a bf16 and an fp8 output, and bf16 (run in a process of its
    own by the test below)."""
    kernel = hopper_gated._grouped_gemm_gated_warp_specialized_kernel
    gated, quantized = kernel_args(FP8_DTYPE)
    gated16, _ = kernel_args(torch.bfloat16)
    consts = {"MODE": 1, "ALPHA": 1.0, "LIMIT": 7.0, "W4": False}
    compile_for_sm90(
        [
            (kernel, gated, {**consts, "QUANT": False}),
            (kernel, quantized, {**consts, "QUANT": True}),
            (kernel, gated16, {**consts, "QUANT": False}),
        ]
    )


def test_compiles_for_sm90_without_a_gpu():
    """The kernel builds for Hopper with the installed Triton (CI has no GPU
    and a newer Triton than the H200 here), fits its shared memory, and ptxas
    leaves its wgmmas overlapped."""
    assert_hopper_builds(
        "tests.model_executor.kernels.grouped_gemm.test_hopper_gated", 6
    )


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens,topk,experts,inter,k,invalid", GATED_CASES, ids=str)
def test_gated_quantized_matches_reference(
    activation, tokens, topk, experts, inter, k, invalid
):
    """fp8 output with one scale per row and 128 columns: the scales and
    the quantized values as the reference quantizes its own activation;
    rows past the offsets' end (and their scales) are never written."""
    torch.manual_seed(tokens + inter + k + 1)
    inputs = gated_problem(tokens, topk, experts, inter, k, "cuda", invalid)
    valid = int(inputs[-1][-1])
    inputs[2][valid:] = 2**30
    rows, groups = tokens * topk, act_groups(inter)
    out = torch.full((rows, inter), POISON, device="cuda").to(FP8_DTYPE)
    scale = torch.full((rows, groups), -1.0, device="cuda")
    ref, ref_scale = torch.empty_like(out), torch.empty_like(scale)
    assert hopper_supports_gated(inputs[0], inter, out)
    hopper_gated.launch_gated(*inputs, activation, out, scale)
    grouped_gemm_fp8_gated_reference(*inputs, activation, ref, ref_scale)
    # Hopper's fp8 MMAs add with fewer mantissa bits than fp32 (~1e-3 of
    # the largest terms), which moves the group maxima a little and can move
    # a value across an fp8 rounding boundary (a step: 2^-3 relative, or a
    # unit of the scale near zero), rarely.
    torch.testing.assert_close(scale[:valid], ref_scale[:valid], rtol=1e-2, atol=0)
    got = dequantize_rows(out[:valid], scale[:valid])
    want = dequantize_rows(ref[:valid], ref_scale[:valid])
    unit = ref_scale[:valid].repeat_interleave(GROUP, 1)[:, :inter]
    assert bool(((got - want).abs() <= 2**-3 * want.abs() + unit).all())
    assert (out[:valid].float() != ref[:valid].float()).float().mean() < 0.05
    assert bool((out[valid:].float() == POISON).all())
    assert bool((scale[valid:] == -1.0).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens,topk,experts,inter,k,invalid", GATED_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gated_matches_reference(
    activation, tokens, topk, experts, inter, k, invalid, dtype
):
    """Tokens gathered by route, gate/up halves of partial and empty row
    halves; routes past the offsets' end are never read nor written."""
    torch.manual_seed(tokens + inter + k)
    inputs = gated_problem(tokens, topk, experts, inter, k, "cuda", invalid)
    valid = int(inputs[-1][-1])
    inputs[2][valid:] = 2**30
    rows = tokens * topk
    out = torch.full((rows, inter), POISON, device="cuda", dtype=dtype)
    ref = torch.full((rows, inter), POISON, device="cuda", dtype=dtype)
    assert hopper_supports_gated(inputs[0], inter, out)
    hopper_gated.launch_gated(*inputs, activation, out)
    grouped_gemm_fp8_gated_reference(*inputs, activation, ref)
    torch.testing.assert_close(out[:valid], ref[:valid], rtol=1.6e-2, atol=1e-2)
    assert bool((out[valid:] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "counts", [HALF_BOUNDARIES, [200], [0, 0, 0]], ids=["halves", "one-expert", "empty"]
)
def test_gated_half_boundaries(counts):
    """Explicit row counts: halves that are full, one row short or over,
    empty experts, a single expert, no rows at all (top-1)."""
    torch.manual_seed(len(counts))
    inputs = counted_gated_problem(counts, 200, 176, spare_rows=5)
    out = torch.full((sum(counts) + 5, 200), POISON, device="cuda").bfloat16()
    ref = torch.full_like(out, POISON)
    hopper_gated.launch_gated(*inputs, "silu", out)
    grouped_gemm_fp8_gated_reference(*inputs, "silu", ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())
