"""The plain Hopper kernel: built for sm90 without a GPU, and launched
directly (an H200) against the reference, with per-row and per-group
scales."""

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    EXPERT_COUNTS,
    POISON,
    assert_hopper_builds,
    compile_for_sm90,
    group_scales,
    needs_hopper,
    problem,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm_fp8_reference,
    hopper_common,
    hopper_plain,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import hopper_supports

GROUP = hopper_common.GROUP.value


def kernel_args(operand: torch.dtype) -> dict[str, object]:
    """Host arguments of the kernel for ``operand`` (fp8 or 16-bit) A and
    weights, as the launcher passes them (16-bit calls pass ``out`` for the
    scales they never read)."""
    rows, experts, n, k = 256, 4, 512, 256
    fp8 = operand == FP8_DTYPE
    a = torch.empty(rows, k, dtype=operand)
    w = torch.empty(experts * n, k, dtype=operand)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    out_block = [hopper_common.BLOCK_M.value // 2, hopper_common.BLOCK_N.value]
    return {
        "a_desc": hopper_common.k_box(a, hopper_common.BLOCK_M.value),
        "w_desc": hopper_common.k_box(w, hopper_common.BLOCK_N.value),
        "a_scale_ptr": torch.empty(rows) if fp8 else out,
        "w_scale_ptr": torch.empty(experts * n) if fp8 else out,
        "w_steps_ptr": out,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": out,
        "out_desc": hopper_common.descriptor(out, out_block),
        "N": n,
        "K": k,
        "groups": 1,
        "num_experts": experts,
    }


def compile_kernels() -> None:
    """fp8 per-row and group-scaled, and bf16 (run in a process of its own
    by the test below)."""
    kernel = hopper_plain._grouped_gemm_warp_specialized_kernel
    compile_for_sm90(
        [
            (kernel, kernel_args(FP8_DTYPE), {"GROUPED": False, "W4": False}),
            (kernel, kernel_args(FP8_DTYPE), {"GROUPED": True, "W4": False}),
            (kernel, kernel_args(torch.bfloat16), {"GROUPED": False, "W4": False}),
        ]
    )


def test_compiles_for_sm90_without_a_gpu():
    """The kernel builds for Hopper with the installed Triton (CI has no GPU
    and a newer Triton than the H200 here), fits its shared memory, and ptxas
    leaves its wgmmas overlapped."""
    assert_hopper_builds(
        "tests.model_executor.kernels.grouped_gemm.test_hopper_plain", 6
    )


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize(
    "n,k", [(512, 256), (96, 48), (2048, 768), (264, 176)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(counts, n, k, dtype):
    """Several N tiles and K steps, partial last ones (N = 96, 264; K = 48,
    176), halves that are full, partial or empty; rows past the last
    expert's end stay untouched."""
    torch.manual_seed(sum(counts) + n + k)
    inputs = problem(counts, n, k, torch.device("cuda"), spare_rows=17)
    rows = inputs[0].shape[0]
    out = torch.full((rows, n), POISON, device="cuda", dtype=dtype)
    ref = torch.full((rows, n), POISON, device="cuda", dtype=dtype)
    assert hopper_supports(out.device, n, out)
    hopper_plain.launch(*inputs, out)
    grouped_gemm_fp8_reference(*inputs, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize("n,k", [(512, 256), (2048, 768), (264, 176)], ids=str)
def test_group_scales_match_reference(counts, n, k):
    """Per-group A scales (K 176: a partial last group), several N tiles,
    halves full, partial or empty; rows past the last expert stay untouched.
    Every other row has an all-zero second group with the smallest scale
    GEMM1 writes (a rescale by ~1e15 and back)."""
    torch.manual_seed(sum(counts) + n + k + 1)
    a, _, w, w_scale, offsets = problem(counts, n, k, torch.device("cuda"), 17)
    scale = group_scales(a.shape[0], k)
    a[::2, GROUP : 2 * GROUP] = 0
    scale[::2, 1] = MIN_SCALE / FP8_MAX
    out = torch.full((a.shape[0], n), POISON, device="cuda", dtype=torch.bfloat16)
    ref = torch.full_like(out, POISON)
    hopper_plain.launch(a, scale, w, w_scale, offsets, out)
    grouped_gemm_fp8_reference(a, scale, w, w_scale, offsets, ref)
    # Hopper's fp8 MMAs add with fewer mantissa bits than fp32: a sum that
    # nearly cancels is off by a share of its largest terms.
    largest = float(ref.float().abs().max())
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-3 * largest)
    assert bool((out[sum(counts) :] == POISON).all())
