import pytest
import torch

from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    FP8_DTYPE,
    GroupedGemmConfig,
    grouped_gemm_fp8,
    grouped_gemm_fp8_reference,
)

POISON = -7.0
# a, a_scale, w, w_scale, expert_first_token_offset
Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def problem(
    counts: list[int], n: int, k: int, device: torch.device, spare_rows: int = 3
) -> Problem:
    """Random fp8 rows grouped by expert (``counts`` rows each), plus
    ``spare_rows`` past the last expert's end, as the permute leaves them."""
    rows = sum(counts) + spare_rows
    a = (torch.randn(rows, k, device=device) * 2).to(FP8_DTYPE)
    a_scale = torch.rand(rows, device=device) + 0.1
    w = (torch.randn(len(counts), n, k, device=device) * 2).to(FP8_DTYPE)
    w_scale = torch.rand(len(counts), n, device=device) / k + 1e-3
    offsets = torch.tensor([0, *counts], device=device).cumsum(0)
    return a, a_scale, w, w_scale, offsets


def run_both(
    inputs: Problem,
    dtype: torch.dtype = torch.bfloat16,
    config: GroupedGemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    a, _, w, _, _ = inputs
    shape = (a.shape[0], w.shape[1])
    out = torch.full(shape, POISON, device=a.device, dtype=dtype)
    ref = torch.full(shape, POISON, device=a.device, dtype=dtype)
    grouped_gemm_fp8(*inputs, out, config)
    grouped_gemm_fp8_reference(*inputs, ref)
    return out, ref


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
        (80, 72, GroupedGemmConfig(16, 32, 32, 4, 1)),
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


def test_zero_rows_and_fp16(device):
    a, a_scale, w, w_scale, offsets = problem([0, 0], 32, 32, device, spare_rows=0)
    out = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    assert grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out) is out
    torch.manual_seed(1)
    out, ref = run_both(problem([3, 9], 48, 64, device), torch.float16)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024, 8192])
def test_matches_scaled_grouped_mm_at_model_dims(tokens):
    """qwen3-30b-a3b GEMM1 dims; the routing's row counts are uneven."""
    torch.manual_seed(tokens)
    experts, topk, n, k = 128, 8, 1536, 2048
    ids = torch.randint(0, experts, (tokens * topk,))
    counts = torch.bincount(ids, minlength=experts).tolist()
    inputs = problem(counts, n, k, torch.device("cuda"), spare_rows=0)
    a, a_scale, w, w_scale, offsets = inputs
    out = torch.full((a.shape[0], n), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8(*inputs, out)
    torch_out = torch._scaled_grouped_mm(
        a,
        w.transpose(1, 2),
        a_scale,
        w_scale,
        offs=offsets[1:].to(torch.int32),
        out_dtype=torch.bfloat16,
    )
    torch.testing.assert_close(out, torch_out, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(a=t["a"].float()), "a: expected contiguous"),
        (lambda t: t.update(a=t["a"][None]), "a: expected [R, K]"),
        (lambda t: t.update(a_scale=t["a_scale"][:-1]), "a_scale: expected"),
        (lambda t: t.update(w=t["w"][0]), "w: expected [E, N, K]"),
        (
            lambda t: t.update(w_scale=t["w_scale"].T.contiguous().T),
            "w_scale: expected contiguous .* got non-contiguous",
        ),
        (
            lambda t: t.update(offsets=t["offsets"].int()),
            "expert_first_token_offset: expected",
        ),
        (lambda t: t.update(out=t["out"].float()), "out: expected bfloat16"),
        (lambda t: t.update(out=t["out"][:-1]), "out: expected contiguous"),
    ],
    ids=["a-dtype", "a-rank", "a_scale", "w", "w_scale", "offsets", "out", "out-rows"],
)
def test_bad_input_names_the_argument(device, change, message):
    a, a_scale, w, w_scale, offsets = problem([2, 3], 32, 32, device)
    tensors = {
        "a": a,
        "a_scale": a_scale,
        "w": w,
        "w_scale": w_scale,
        "offsets": offsets,
        "out": torch.empty(a.shape[0], 32, device=device, dtype=torch.bfloat16),
    }
    change(tensors)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        grouped_gemm_fp8(
            tensors["a"],
            tensors["a_scale"],
            tensors["w"],
            tensors["w_scale"],
            tensors["offsets"],
            tensors["out"],
        )
