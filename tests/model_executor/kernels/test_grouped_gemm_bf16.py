from typing import Any

import pytest
import torch

from tests.model_executor.kernels.test_grouped_gemm_fp8 import sorted_routing
from tests.model_executor.kernels.test_grouped_gemm_ws import (
    GATED_CASES,
    HALF_BOUNDARIES,
    needs_hopper,
)
from vllm.model_executor.kernels import grouped_gemm_ws as ws
from vllm.model_executor.kernels.common.activation_quant import gated_act_reference
from vllm.model_executor.kernels.grouped_gemm_bf16 import (
    grouped_gemm_bf16,
    grouped_gemm_bf16_gated,
    grouped_gemm_bf16_gated_reference,
    grouped_gemm_bf16_reference,
)
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    deinterleave_gate_up,
    interleave_gate_up,
)

POISON = -7.0
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)


def problem(
    counts: list[int], n: int, k: int, device, dtype=torch.bfloat16, spare_rows=17
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows grouped by expert (``counts`` each) plus ``spare_rows``
    past the last expert's end, weights [E, N, K] scaled to unit outputs,
    and the offsets."""
    a = torch.randn(sum(counts) + spare_rows, k, device=device).to(dtype)
    w = (torch.randn(len(counts), n, k, device=device) / k**0.5).to(dtype)
    return a, w, torch.tensor([0, *counts], device=device).cumsum(0)


def gated_problem(
    tokens: int,
    topk: int,
    experts: int,
    inter: int,
    k: int,
    device,
    invalid: int = 0,
    dtype=torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """Tokens, a routing sorted by expert with ``invalid`` routes last (as
    non-local ones, their source set out of range: never to be read) and
    interleaved w13 [E, 2I, K]."""
    a = torch.randn(tokens, k, device=device).to(dtype)
    src_routes, offsets = sorted_routing(tokens * topk, experts, device, invalid)
    src_routes[tokens * topk - invalid :] = 2**30
    w13 = (torch.randn(experts, 2 * inter, k, device=device) / k**0.5).to(dtype)
    return a, src_routes, topk, interleave_gate_up(w13), offsets


def test_gated_reference_is_the_plain_gemm_on_gathered_rows(device):
    """The two references agree: the gated one equals the plain one on the
    gathered token rows, then the activation of the deinterleaved halves."""
    torch.manual_seed(0)
    a, src_routes, topk, w13, offsets = gated_problem(9, 2, 3, 24, 40, device)
    act = torch.full((18, 24), POISON, device=device)
    act = grouped_gemm_bf16_gated_reference(
        a, src_routes, topk, w13, offsets, "silu", act.bfloat16()
    )
    gathered = a[src_routes.long() // topk]
    product = torch.empty(18, 48, device=device, dtype=torch.bfloat16)
    grouped_gemm_bf16_reference(gathered, w13, offsets, product)
    expected = gated_act_reference("silu", deinterleave_gate_up(product.float()))
    # The plain path rounds the product to bf16 before the activation.
    torch.testing.assert_close(act, expected.bfloat16(), rtol=2e-2, atol=2e-2)


def test_refused_off_hopper():
    a, w, offsets = problem([3, 2], 32, 16, "cpu", spare_rows=0)
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: expected a tensor on a Hopper GPU"):
        grouped_gemm_bf16(a, w, offsets, out)
    a, src_routes, topk, w13, offsets = gated_problem(4, 2, 2, 16, 32, "cpu")
    with pytest.raises(ValueError, match=r"a: expected a tensor on a Hopper GPU"):
        grouped_gemm_bf16_gated(
            a, src_routes, topk, w13, offsets, "silu", torch.empty(8, 16).bfloat16()
        )


def test_zero_rows_and_no_experts_write_nothing():
    """Checked before any device requirement: also on the CPU."""
    a, w, offsets = problem([0, 0], 32, 16, "cpu", spare_rows=0)
    out = torch.empty(0, 32, dtype=torch.bfloat16)
    assert grouped_gemm_bf16(a, w, offsets, out) is out
    a, w, offsets = problem([], 32, 16, "cpu", spare_rows=4)
    out = torch.full((4, 32), POISON, dtype=torch.bfloat16)
    grouped_gemm_bf16(a, w, offsets, out)
    assert bool((out == POISON).all())
    a, src_routes, topk, w13, offsets = gated_problem(0, 2, 3, 16, 32, "cpu")
    act = torch.empty(0, 16, dtype=torch.bfloat16)
    assert (
        grouped_gemm_bf16_gated(a, src_routes, topk, w13, offsets, "silu", act) is act
    )


def test_gathered_rows_need_k_a_multiple_of_16():
    """The gated GEMM's 16-byte copies of token rows compile only when K is
    a multiple of 16 (the plain GEMM takes multiples of 8)."""
    a, src_routes, topk, w13, offsets = gated_problem(4, 2, 2, 16, 40, "cpu")
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: expected .* multiple of 16 .* K=40 "):
        grouped_gemm_bf16_gated(a, src_routes, topk, w13, offsets, "silu", out)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(a=t["a"].half()), "w: expected a's dtype torch.float16"),
        (lambda t: t.update(a=t["a"].float()), "a: expected bfloat16 or float16"),
        (lambda t: t.update(w=t["w"][0]), r"w: expected \[E, N, K\]"),
        (lambda t: t.update(a=t["a"][:, :8]), r"a: expected contiguous.*\[7, 16\]"),
        (lambda t: t.update(out=t["out"][:, :8]), r"out: expected.*\[7, 32\]"),
        (lambda t: t.update(offsets=t["offsets"].int()), "expert_first_token_offset"),
        (
            lambda t: t.update(a=t["a"][:, :4].contiguous(), w=t["w"][..., :4].clone()),
            "a: expected a 16-byte aligned start and K a positive multiple of 8",
        ),
    ],
    ids=["mixed-dtypes", "fp32", "w-rank", "a-k", "out-cols", "offsets", "k-4"],
)
def test_bad_input_names_the_argument(device, change, message):
    a, w, offsets = problem([3, 4], 32, 16, device, spare_rows=0)
    t: dict[str, Any] = {
        "a": a,
        "w": w,
        "offsets": offsets,
        "out": torch.empty(7, 32, device=device, dtype=torch.bfloat16),
    }
    change(t)
    with pytest.raises(ValueError, match=message):
        grouped_gemm_bf16(t["a"], t["w"], t["offsets"], t["out"])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(w13=t["w13"][:, :3]), r"w13: expected \[E, 2 \* I, K\]"),
        (lambda t: t.update(activation="gelu"), "activation: expected"),
        (lambda t: t.update(topk=0), "topk: expected >= 1"),
        (lambda t: t.update(src_routes=t["src_routes"].long()), "src_routes"),
        (lambda t: t.update(out=t["out"].half()), "out: expected a's dtype"),
        (lambda t: t.update(out=t["out"][:, :8]), r"out: expected.*\[8, 16\]"),
    ],
    ids=["w13-odd", "activation", "topk", "routes-int64", "out-dtype", "out-cols"],
)
def test_gated_bad_input_names_the_argument(device, change, message):
    a, src_routes, topk, w13, offsets = gated_problem(4, 2, 2, 16, 32, device)
    t: dict[str, Any] = {
        "a": a,
        "src_routes": src_routes,
        "topk": topk,
        "w13": w13,
        "offsets": offsets,
        "activation": "silu",
        "out": torch.empty(8, 16, device=device, dtype=torch.bfloat16),
    }
    change(t)
    with pytest.raises(ValueError, match=message):
        grouped_gemm_bf16_gated(
            t["a"],
            t["src_routes"],
            t["topk"],
            t["w13"].contiguous(),
            t["offsets"],
            t["activation"],
            t["out"].contiguous(),
        )


EXPERT_COUNTS = pytest.mark.parametrize(
    "counts",
    [[1], [0, 70, 130, 1], HALF_BOUNDARIES, [0, 0, 0]],
    ids=["one-row", "uneven", "half-boundaries", "empty"],
)


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize(
    "n,k",
    [(512, 256), (96, 48), (2048, 768), (264, 176), (96, 40), (264, 200)],
    ids=str,
)
@DTYPES
def test_matches_reference(counts, n, k, dtype):
    """Several N tiles and 64-column K steps, partial last ones (N = 96,
    264; K = 48, 176, and 40, 200: 8 past a multiple of 16), halves full,
    partial or empty; rows past the last expert's end stay untouched."""
    torch.manual_seed(sum(counts) + n + k)
    a, w, offsets = problem(counts, n, k, "cuda", dtype)
    out = torch.full((a.shape[0], n), POISON, device="cuda", dtype=dtype)
    ref = torch.full_like(out, POISON)
    grouped_gemm_bf16(a, w, offsets, out)
    grouped_gemm_bf16_reference(a, w, offsets, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens,topk,experts,inter,k,invalid", GATED_CASES, ids=str)
@DTYPES
def test_gated_matches_reference(
    activation, tokens, topk, experts, inter, k, invalid, dtype
):
    """Tokens gathered by route (8 columns per 16-byte copy), gate/up
    halves of partial and empty row halves; routes past the offsets' end
    are never read nor written."""
    torch.manual_seed(tokens + inter + k)
    inputs = gated_problem(tokens, topk, experts, inter, k, "cuda", invalid, dtype)
    rows, valid = tokens * topk, tokens * topk - invalid
    out = torch.full((rows, inter), POISON, device="cuda", dtype=dtype)
    ref = torch.full_like(out, POISON)
    grouped_gemm_bf16_gated(*inputs, activation, out)
    grouped_gemm_bf16_gated_reference(*inputs, activation, ref)
    torch.testing.assert_close(out[:valid], ref[:valid], rtol=1.6e-2, atol=1e-2)
    assert bool((out[valid:] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_model_dims_match_torch_grouped_mm(tokens):
    """qwen3-30b-a3b (128 experts, top-8, hidden 2048, intermediate 768):
    both GEMMs against ``torch._grouped_mm`` on the permuted rows."""
    torch.manual_seed(tokens)
    a, src_routes, topk, w13, offsets = gated_problem(tokens, 8, 128, 768, 2048, "cuda")
    rows = tokens * 8
    act = torch.full((rows, 768), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_bf16_gated(a, src_routes, topk, w13, offsets, "silu", act)
    ends = offsets[1:].int()
    gate_up = torch._grouped_mm(
        a[src_routes.long() // topk], deinterleave_gate_up(w13).transpose(1, 2), ends
    )
    expected = gated_act_reference("silu", gate_up.float())
    torch.testing.assert_close(act.float(), expected, rtol=2e-2, atol=2e-2)
    w2 = (torch.randn(128, 2048, 768, device="cuda") / 768**0.5).bfloat16()
    down = torch.full((rows, 2048), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_bf16(act, w2, offsets, down)
    torch.testing.assert_close(
        down, torch._grouped_mm(act, w2.transpose(1, 2), ends), rtol=2e-2, atol=2e-2
    )


@pytest.mark.gpu
@needs_hopper
def test_cuda_graph_replay_follows_the_routing():
    """Both GEMMs captured once: replays with new offsets and routes equal
    eager calls bit for bit."""
    torch.manual_seed(3)
    a, src_routes, topk, w13, offsets = gated_problem(512, 4, 32, 256, 512, "cuda")
    w2 = (torch.randn(32, 512, 256, device="cuda") / 16).bfloat16()
    act = torch.full((2048, 256), POISON, device="cuda", dtype=torch.bfloat16)
    down = torch.full((2048, 512), POISON, device="cuda", dtype=torch.bfloat16)

    def layer() -> None:
        grouped_gemm_bf16_gated(a, src_routes, topk, w13, offsets, "silu", act)
        grouped_gemm_bf16(act, w2, offsets, down)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer()  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer()
    for seed in range(3):
        torch.manual_seed(seed)
        fresh = gated_problem(512, 4, 32, 256, 512, "cuda")
        src_routes.copy_(fresh[1])
        offsets.copy_(fresh[4])
        graph.replay()
        torch.cuda.synchronize()
        replayed = act.clone(), down.clone()
        layer()
        assert torch.equal(replayed[0], act) and torch.equal(replayed[1], down)


@pytest.mark.gpu
@needs_hopper
def test_misaligned_rows_are_refused():
    """An ``out`` or ``a`` 2 bytes off 16-byte alignment cannot take TMA
    boxes: a named error, not a fallback (there is no 16-bit Triton
    kernel)."""
    a, w, offsets = problem([100, 50], 256, 128, "cuda", spare_rows=0)
    flat = torch.empty(150 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(150, 256)
    assert not ws.supports(a.device, 256, shifted)
    with pytest.raises(ValueError, match="out: expected a 16-byte aligned start"):
        grouped_gemm_bf16(a, w, offsets, shifted)
    flat_a = torch.empty(150 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    a_shifted = flat_a[1:].view(150, 128)
    a_shifted.copy_(a)
    out = torch.empty(150, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a: expected a 16-byte aligned start"):
        grouped_gemm_bf16(a_shifted, w, offsets, out)
