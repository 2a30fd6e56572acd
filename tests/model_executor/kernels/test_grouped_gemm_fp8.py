from typing import Any

import pytest
import torch

from vllm.model_executor.kernels.common.activation_quant import FP8_MAX, MIN_SCALE
from vllm.model_executor.kernels.common.device_info import num_sms
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    FP8_DTYPE,
    GroupedGemmConfig,
    act_groups,
    deinterleave_gate_up,
    dequantize_rows,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    interleave_gate_up,
    quantize_groups_reference,
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


GatedProblem = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    int,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]


def sorted_routing(
    routes: int, num_experts: int, device, invalid: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random routing sorted by expert, as the permute leaves it: the
    destination -> route index (int32 [routes], ``invalid`` routes last, as
    non-local ones) and the expert offsets (int64 [E + 1])."""
    ids = torch.randint(0, num_experts, (routes,), device=device)
    ids[torch.randperm(routes, device=device)[:invalid]] = num_experts
    src_routes = torch.sort(ids, stable=True).indices.to(torch.int32)
    counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = counts.cumsum(0)
    return src_routes, offsets


def gated_problem(
    tokens: int, topk: int, num_experts: int, inter: int, k: int, device, invalid=0
) -> GatedProblem:
    """fp8 tokens, a routing sorted by expert (``invalid`` routes last, as
    non-local ones), and w13 [E, 2I, K] with per-channel scales."""
    a = (torch.randn(tokens, k, device=device) * 2).to(FP8_DTYPE)
    a_scale = torch.rand(tokens, device=device) + 0.1
    src_routes, offsets = sorted_routing(tokens * topk, num_experts, device, invalid)
    w13 = (torch.randn(num_experts, 2 * inter, k, device=device) * 2).to(FP8_DTYPE)
    w13_scale = torch.rand(num_experts, 2 * inter, device=device) / k + 1e-3
    return a, a_scale, src_routes, topk, w13, w13_scale, offsets


def run_gated(
    inputs: GatedProblem,
    activation: str,
    config: GroupedGemmConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    a, _, src_routes, _, w13, _, _ = inputs
    shape = (src_routes.shape[0], w13.shape[1] // 2)
    out = torch.full(shape, POISON, device=a.device, dtype=dtype)
    ref = torch.full(shape, POISON, device=a.device, dtype=dtype)
    assert grouped_gemm_fp8_gated(*inputs, activation, out, config) is out
    grouped_gemm_fp8_gated_reference(*inputs, activation, ref)
    return out, ref


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


def test_gate_up_interleaving(device):
    w13 = torch.randn(3, 2 * 5, 4, device=device)
    inter = interleave_gate_up(w13)
    assert torch.equal(inter[:, 0::2], w13[:, :5])
    assert torch.equal(inter[:, 1::2], w13[:, 5:])
    assert torch.equal(deinterleave_gate_up(inter), w13)
    scales = torch.randn(3, 10, device=device)
    assert torch.equal(interleave_gate_up(scales)[:, 0::2], scales[:, :5])
    assert torch.equal(interleave_gate_up(scales)[:, 1::2], scales[:, 5:])


def test_gated_zero_rows_and_fp16(device):
    inputs = gated_problem(0, 2, 3, 32, 32, device)
    out = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    assert grouped_gemm_fp8_gated(*inputs, "silu", out) is out
    torch.manual_seed(2)
    out, ref = run_gated(
        gated_problem(9, 2, 3, 48, 64, device), "silu", dtype=torch.float16
    )
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(w13=t["w13"][:, :-1]), r"w13: expected \[E, 2 \* I, K\]"),
        (lambda t: t.update(src_routes=t["src_routes"].long()), "src_routes: expected"),
        (lambda t: t.update(a=t["a"].float()), "a: expected contiguous"),
        (lambda t: t.update(a=t["a"][:, :-16]), "a: expected contiguous"),
        (lambda t: t.update(a_scale=t["a_scale"][:-1]), "a_scale: expected"),
        (lambda t: t.update(w13_scale=t["w13_scale"][:1]), "w13_scale: expected"),
        (
            lambda t: t.update(offsets=t["offsets"].int()),
            "expert_first_token_offset: expected",
        ),
        (lambda t: t.update(out=t["out"].float()), "out: expected a bfloat16"),
        (lambda t: t.update(out=t["out"][0]), "out: expected a bfloat16"),
        (lambda t: t.update(out=t["out"][:, :-1]), "out: expected contiguous"),
        (lambda t: t.update(activation="gelu"), "activation: expected"),
        (lambda t: t.update(topk=0), "topk: expected"),
        (lambda t: t.update(out=t["out"].to(FP8_DTYPE)), "out_scale: required"),
        (lambda t: t.update(out_scale=torch.ones(6, 1)), "out_scale: required"),
        (
            lambda t: t.update(out=t["out"].to(FP8_DTYPE), out_scale=torch.ones(6, 2)),
            "out_scale: expected contiguous",
        ),
    ],
    ids=[
        "w13",
        "src_routes",
        "a-dtype",
        "a-k",
        "a_scale",
        "w13_scale",
        "offsets",
        "out-dtype",
        "out-rank",
        "out-cols",
        "act",
        "topk",
        "fp8-out-no-scale",
        "scale-bf16-out",
        "out_scale-groups",
    ],
)
def test_gated_bad_input_names_the_argument(device, change, message):
    a, a_scale, src_routes, topk, w13, w13_scale, offsets = gated_problem(
        3, 2, 2, 32, 32, device
    )
    t: dict[str, Any] = {
        "a": a,
        "a_scale": a_scale,
        "src_routes": src_routes,
        "topk": topk,
        "w13": w13,
        "w13_scale": w13_scale,
        "offsets": offsets,
        "activation": "silu",
        "out": torch.empty(6, 32, device=device, dtype=torch.bfloat16),
    }
    change(t)
    with pytest.raises(ValueError, match=message):
        grouped_gemm_fp8_gated(
            t["a"],
            t["a_scale"],
            t["src_routes"],
            t["topk"],
            t["w13"],
            t["w13_scale"],
            t["offsets"],
            t["activation"],
            t["out"],
            out_scale=t.get("out_scale"),
        )


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


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024, 8192])
def test_gated_at_model_dims(tokens):
    """qwen3-30b-a3b GEMM1 with the launcher's tiles; a share of the routes
    is non-local (sorted last, as the permute leaves them)."""
    torch.manual_seed(tokens)
    inputs = gated_problem(tokens, 8, 128, 768, 2048, "cuda", invalid=tokens)
    out, ref = run_gated(inputs, "silu")
    valid = int(inputs[-1][-1])
    torch.testing.assert_close(out[:valid], ref[:valid], rtol=1.6e-2, atol=1e-2)
    assert bool((out[valid:] == POISON).all())


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(a=t["a"].float()), "a: expected contiguous"),
        (lambda t: t.update(a=t["a"][None]), "a: expected [R, K]"),
        (lambda t: t.update(a_scale=t["a_scale"][:-1]), "a_scale: expected"),
        (
            lambda t: t.update(a_scale=torch.ones(t["a"].shape[0], 2)),
            "a_scale: expected contiguous torch.float32 [8, 1]",
        ),
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
    ids=[
        "a-dtype",
        "a-rank",
        "a_scale",
        "a_scale-groups",
        "w",
        "w_scale",
        "offsets",
        "out",
        "out-rows",
    ],
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


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` starting 8 bytes past an aligned address."""
    flat = torch.empty(t.numel() + 8, dtype=torch.uint8, device=t.device)
    out = flat[8:].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_tma_operands_must_be_16_byte_aligned(device):
    out = torch.empty(8, 32, device=device, dtype=torch.bfloat16)
    for k in (40, 0):
        a, a_scale, w, w_scale, offsets = problem([2, 3], 32, k, device)
        with pytest.raises(ValueError, match=rf"a: expected a 16-byte .* K={k} "):
            grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out)
    a, a_scale, w, w_scale, offsets = problem([2, 3], 32, 32, device)
    with pytest.raises(ValueError, match=r"a: expected a 16-byte .* K=32 "):
        grouped_gemm_fp8(_misaligned(a), a_scale, w, w_scale, offsets, out)
    with pytest.raises(ValueError, match=r"w: expected a 16-byte .* K=32 "):
        grouped_gemm_fp8(a, a_scale, _misaligned(w), w_scale, offsets, out)
    for k, misaligned in ((32, True), (40, False)):
        a, a_scale, src_routes, topk, w13, w13_scale, offsets = gated_problem(
            3, 2, 2, 32, k, device
        )
        with pytest.raises(ValueError, match=rf"w13: expected a 16-byte .* K={k} "):
            grouped_gemm_fp8_gated(
                a,
                a_scale,
                src_routes,
                topk,
                _misaligned(w13) if misaligned else w13,
                w13_scale,
                offsets,
                "silu",
                torch.empty(6, 32, device=device, dtype=torch.bfloat16),
            )


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


def test_group_scales_need_the_hopper_kernel(device):
    """The Triton kernels take per-row scales only: per-group ones (and an
    fp8 gated output) are refused, naming the argument."""
    a, _, w, w_scale, offsets = problem([2, 3], 32, 32, device)
    out = torch.empty(a.shape[0], 32, device=device, dtype=torch.bfloat16)
    scale = torch.ones(a.shape[0], 1, device=device)
    config = GroupedGemmConfig(16, 32, 32, 4, 1)
    with pytest.raises(ValueError, match="a_scale: per-group scales need the Hopper"):
        grouped_gemm_fp8(a, scale, w, w_scale, offsets, out, config)
    inputs = gated_problem(3, 2, 2, 32, 32, device)
    act = torch.empty(6, 32, device=device, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="out: an fp8 out needs the Hopper"):
        grouped_gemm_fp8_gated(
            *inputs, "silu", act, config, out_scale=torch.ones(6, 1, device=device)
        )
