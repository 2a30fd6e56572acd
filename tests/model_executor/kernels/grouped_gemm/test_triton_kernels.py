"""The Triton kernels, through the API with per-row fp8 scales: on the CPU
(interpreted) every call runs them; a ``config`` forces their tiles."""

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    POISON,
    gated_problem,
    problem,
    run_both,
    run_gated,
)
from vllm.model_executor.kernels.common.device_info import num_sms
from vllm.model_executor.kernels.grouped_gemm import (
    GroupedGemmConfig,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
)


@pytest.mark.parametrize(
    "counts",
    [[1], [5, 0, 130, 2], [0, 0, 0], [0, 5], [7, 0], [300, 1, 0, 17, 64]],
    ids=["one-row", "uneven", "empty", "first-empty", "last-empty", "multi-tile"],
)
@pytest.mark.parametrize(
    "n,k,config",
    [
        (64, 128, None),  # the launcher's tiles
        (96, 80, None),
        # Small tiles: several N tiles and K steps, partial last ones.
        (80, 48, GroupedGemmConfig(16, 32, 32, 4, 1)),
    ],
    ids=["default-tiles", "partial-k", "small-tiles"],
)
def test_matches_reference(device, counts, n, k, config):
    torch.manual_seed(sum(counts) + n + k)
    inputs = problem(counts, n, k, device)
    out, ref = run_both(inputs, config=config)
    # fp32 accumulation in both: the difference is bf16 rounding of the output.
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    # Rows past the last expert's end are never written.
    assert bool((out[sum(counts) :] == POISON).all())


def test_programs_walk_several_tiles(device):
    """More (row, N) tiles than SMs (or the interpreter's program bound):
    each persistent program computes several."""
    torch.manual_seed(5)
    counts, n, config = [600, 1, 0, 17, 64], 160, GroupedGemmConfig(16, 32, 32, 4, 1)
    tiles = sum(-(-c // 16) for c in counts) * (n // 32)
    assert tiles > num_sms(torch.device(device))
    out, ref = run_both(problem(counts, n, 48, device), config=config)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


def test_zero_rows_and_fp16(device):
    a, a_scale, w, w_scale, offsets = problem([0, 0], 32, 32, device, spare_rows=0)
    out = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    assert grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out) is out
    # No experts: no row is below offsets[0], none is written.
    out, _ = run_both(problem([], 32, 32, device))
    assert bool((out == POISON).all())
    torch.manual_seed(1)
    out, ref = run_both(problem([3, 9], 48, 64, device), torch.float16)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize(
    "tokens,topk,invalid", [(1, 1, 0), (13, 2, 0), (40, 3, 7)], ids=str
)
def test_gated_matches_reference(device, activation, tokens, topk, invalid):
    """Small tiles: several gate/up tiles and K steps (I=80 and K=48 end in
    partial ones); routes past the offsets' end are never written."""
    torch.manual_seed(tokens + topk)
    inputs = gated_problem(tokens, topk, 4, 80, 48, device, invalid)
    valid = int(inputs[-1][-1])
    inputs[2][valid:] = 2**30  # routes past the offsets' end are never read
    out, ref = run_gated(inputs, activation, GroupedGemmConfig(16, 32, 32, 4, 1))
    assert valid == tokens * topk - invalid
    torch.testing.assert_close(out[:valid], ref[:valid], rtol=1.6e-2, atol=1e-2)
    assert bool((out[valid:] == POISON).all())


@pytest.mark.parametrize("tokens", [1, 13], ids=["decode-tiles", "short-tiles"])
def test_gated_launcher_tiles(device, tokens):
    """The launcher's own tiles: fewer rows than experts (decode), and a few
    rows per expert."""
    torch.manual_seed(tokens)
    out, ref = run_gated(gated_problem(tokens, 2, 4, 80, 48, device), "silu")
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)


def test_gated_zero_rows_and_fp16(device):
    inputs = gated_problem(0, 2, 3, 32, 32, device)
    out = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    assert grouped_gemm_fp8_gated(*inputs, "silu", out) is out
    torch.manual_seed(2)
    out, ref = run_gated(
        gated_problem(9, 2, 3, 48, 64, device), "silu", dtype=torch.float16
    )
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
