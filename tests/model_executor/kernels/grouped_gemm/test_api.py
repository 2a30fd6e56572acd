"""The API's contracts for fp8 and 16-bit operands: arguments checked and
named before any launch, calls a kernel cannot take refused, and (on an
H200) results at model dims, under CUDA graphs, against torch."""

from typing import Any
from unittest import mock

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    EXPERT_COUNTS,
    GATED_CASES,
    POISON,
    bf16_gated_problem,
    bf16_problem,
    gated_problem,
    group_scales,
    model_gemm2,
    needs_hopper,
    problem,
    run_gated,
)
from vllm.model_executor.kernels.common.activation_quant import (
    act_and_quant,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    act_groups,
    deinterleave_gate_up,
    grouped_gemm,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_gated,
    grouped_gemm_gated_reference,
    grouped_gemm_reference,
    hopper_gated,
    hopper_plain,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import hopper_supports

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda t: t.update(a=t["a"].float()),
            "a: expected float8_e4m3fn, bfloat16 or float16, got torch.float32",
        ),
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
def test_fp8_bad_input_names_the_argument(device, change, message):
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


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(w13=t["w13"][:, :-1]), r"w13: expected \[E, 2 \* I, K\]"),
        (lambda t: t.update(src_routes=t["src_routes"].long()), "src_routes: expected"),
        (
            lambda t: t.update(a=t["a"].float()),
            "a: expected float8_e4m3fn, bfloat16 or float16, got torch.float32",
        ),
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
def test_fp8_gated_bad_input_names_the_argument(device, change, message):
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


def test_scales_follow_the_operand_dtype(device):
    """One table: fp8 operands need both scales, 16-bit ones take none."""
    a, a_scale, w, w_scale, offsets = problem([2, 3], 32, 32, device)
    out = torch.empty(a.shape[0], 32, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a_scale: expected a tensor for float8"):
        grouped_gemm(a, w, offsets, out, w_scale=w_scale)
    with pytest.raises(ValueError, match="w_scale: expected a tensor for float8"):
        grouped_gemm(a, w, offsets, out, a_scale=a_scale)
    a16, w16 = a.bfloat16(), w.bfloat16()
    with pytest.raises(ValueError, match="a_scale: expected None for bfloat16"):
        grouped_gemm(a16, w16, offsets, out, a_scale=a_scale)
    a, a_scale, src_routes, topk, w13, w13_scale, offsets = gated_problem(
        3, 2, 2, 16, 32, device
    )
    act = torch.empty(6, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="w13_scale: expected None for float16"):
        grouped_gemm_gated(
            a.half(),
            src_routes,
            topk,
            w13.half(),
            offsets,
            "silu",
            act,
            w13_scale=w13_scale,
        )


def test_refused_off_hopper():
    a, w, offsets = bf16_problem([3, 2], 32, 16, "cpu", spare_rows=0)
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: expected a tensor on a Hopper GPU"):
        grouped_gemm(a, w, offsets, out)
    a, src_routes, topk, w13, offsets = bf16_gated_problem(4, 2, 2, 16, 32, "cpu")
    with pytest.raises(ValueError, match=r"a: expected a tensor on a Hopper GPU"):
        grouped_gemm_gated(
            a, src_routes, topk, w13, offsets, "silu", torch.empty(8, 16).bfloat16()
        )


def test_zero_rows_and_no_experts_write_nothing():
    """Checked before any device requirement: also on the CPU."""
    a, w, offsets = bf16_problem([0, 0], 32, 16, "cpu", spare_rows=0)
    out = torch.empty(0, 32, dtype=torch.bfloat16)
    assert grouped_gemm(a, w, offsets, out) is out
    a, w, offsets = bf16_problem([], 32, 16, "cpu", spare_rows=4)
    out = torch.full((4, 32), POISON, dtype=torch.bfloat16)
    grouped_gemm(a, w, offsets, out)
    assert bool((out == POISON).all())
    a, src_routes, topk, w13, offsets = bf16_gated_problem(0, 2, 3, 16, 32, "cpu")
    act = torch.empty(0, 16, dtype=torch.bfloat16)
    assert grouped_gemm_gated(a, src_routes, topk, w13, offsets, "silu", act) is act


def test_gathered_rows_need_k_a_multiple_of_16():
    """The gated GEMM's 16-byte copies of token rows compile only when K is
    a multiple of 16 (the plain GEMM takes multiples of 8)."""
    a, src_routes, topk, w13, offsets = bf16_gated_problem(4, 2, 2, 16, 40, "cpu")
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: expected .* multiple of 16 .* K=40 "):
        grouped_gemm_gated(a, src_routes, topk, w13, offsets, "silu", out)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(a=t["a"].half()), "w: expected contiguous torch.float16"),
        (
            lambda t: t.update(a=t["a"].float()),
            "a: expected float8_e4m3fn, bfloat16 or float16, got torch.float32",
        ),
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
def test_bf16_bad_input_names_the_argument(device, change, message):
    a, w, offsets = bf16_problem([3, 4], 32, 16, device, spare_rows=0)
    t: dict[str, Any] = {
        "a": a,
        "w": w,
        "offsets": offsets,
        "out": torch.empty(7, 32, device=device, dtype=torch.bfloat16),
    }
    change(t)
    with pytest.raises(ValueError, match=message):
        grouped_gemm(t["a"], t["w"], t["offsets"], t["out"])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(w13=t["w13"][:, :3]), r"w13: expected \[E, 2 \* I, K\]"),
        (lambda t: t.update(activation="gelu"), "activation: expected"),
        (lambda t: t.update(topk=0), "topk: expected >= 1"),
        (lambda t: t.update(src_routes=t["src_routes"].long()), "src_routes"),
        (
            lambda t: t.update(out=t["out"].half()),
            r"out: expected a bfloat16 \[R, I\], got \[8, 16\] torch.float16",
        ),
        (lambda t: t.update(out=t["out"][:, :8]), r"out: expected.*\[8, 16\]"),
    ],
    ids=["w13-odd", "activation", "topk", "routes-int64", "out-dtype", "out-cols"],
)
def test_bf16_gated_bad_input_names_the_argument(device, change, message):
    a, src_routes, topk, w13, offsets = bf16_gated_problem(4, 2, 2, 16, 32, device)
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
        grouped_gemm_gated(
            t["a"],
            t["src_routes"],
            t["topk"],
            t["w13"].contiguous(),
            t["offsets"],
            t["activation"],
            t["out"].contiguous(),
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


@pytest.mark.gpu
@needs_hopper
def test_quantized_pair_at_model_dims():
    """qwen3-30b-a3b at 8192 tokens: the launchers take the Hopper kernels
    for the fp8 activation and its group scales; GEMM2's rows are as close
    to GEMM2 on the unquantized activation as those of the per-row path
    (bf16 activation, a per-row quantization pass, per-row scales), or
    closer."""
    torch.manual_seed(1)
    experts, inter, hidden, rows = 128, 768, 2048, 8192 * 8
    inputs = gated_problem(8192, 8, experts, inter, hidden, "cuda")
    offsets = inputs[-1]
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * 2).to(FP8_DTYPE)
    w2_scale = torch.rand(experts, hidden, device="cuda") / inter + 1e-3
    act = torch.empty(rows, inter, device="cuda", dtype=FP8_DTYPE)
    act_scale = torch.empty(rows, act_groups(inter), device="cuda")
    down = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    with (
        mock.patch.object(
            hopper_gated, "launch_gated", wraps=hopper_gated.launch_gated
        ) as gated,
        mock.patch.object(hopper_plain, "launch", wraps=hopper_plain.launch) as plain,
    ):
        grouped_gemm_fp8_gated(*inputs, "silu", act, out_scale=act_scale)
        grouped_gemm_fp8(act, act_scale, w2, w2_scale, offsets, down)
    gated.assert_called_once()
    plain.assert_called_once()
    act_bf16 = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8_gated(*inputs, "silu", act_bf16)
    row_q, row_scale = torch.empty_like(act), torch.empty(rows, device="cuda")
    act_and_quant(act_bf16, row_q, None, row_scale)
    per_row = torch.empty_like(down)
    grouped_gemm_fp8(row_q, row_scale, w2, w2_scale, offsets, per_row)
    ideal = torch.empty(rows, hidden, device="cuda")
    bounds = offsets.tolist()
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        ideal[lo:hi] = (
            act_bf16[lo:hi].float() @ (w2[e].float() * w2_scale[e, :, None]).t()
        )

    def error(x: torch.Tensor) -> float:
        return float((x.float() - ideal).norm() / ideal.norm())

    assert error(down) <= error(per_row) < 0.05


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("grouped", [False, True], ids=["row-scales", "group-scales"])
def test_fp8_cuda_graph_replay_follows_the_routing(grouped):
    """Captured once, replayed with other offsets (same row count): equals
    eager calls, so nothing of the first routing is baked in."""
    torch.manual_seed(7)
    a, a_scale, w, w_scale, offsets = model_gemm2(2048)
    if grouped:
        a_scale = group_scales(a.shape[0], a.shape[1])
    out = torch.full((a.shape[0], 2048), POISON, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out)
    for seed in range(3):
        torch.manual_seed(seed)
        counts = torch.bincount(torch.randint(0, 128, (a.shape[0],)), minlength=128)
        offsets[1:] = counts.cumsum(0)
        graph.replay()
        eager = torch.full_like(out, POISON)
        grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, eager)
        assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_hopper
@EXPERT_COUNTS
@pytest.mark.parametrize(
    "n,k",
    [(512, 256), (96, 48), (2048, 768), (264, 176), (96, 40), (264, 200)],
    ids=str,
)
@DTYPES
def test_bf16_matches_reference(counts, n, k, dtype):
    """Several N tiles and 64-column K steps, partial last ones (N = 96,
    264; K = 48, 176, and 40, 200: 8 past a multiple of 16), halves full,
    partial or empty; rows past the last expert's end stay untouched."""
    torch.manual_seed(sum(counts) + n + k)
    a, w, offsets = bf16_problem(counts, n, k, "cuda", dtype)
    out = torch.full((a.shape[0], n), POISON, device="cuda", dtype=dtype)
    ref = torch.full_like(out, POISON)
    grouped_gemm(a, w, offsets, out)
    grouped_gemm_reference(a, w, offsets, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("tokens,topk,experts,inter,k,invalid", GATED_CASES, ids=str)
@DTYPES
def test_bf16_gated_matches_reference(
    activation, tokens, topk, experts, inter, k, invalid, dtype
):
    """Tokens gathered by route (8 columns per 16-byte copy), gate/up
    halves of partial and empty row halves; routes past the offsets' end
    are never read nor written."""
    torch.manual_seed(tokens + inter + k)
    inputs = bf16_gated_problem(tokens, topk, experts, inter, k, "cuda", invalid, dtype)
    rows, valid = tokens * topk, tokens * topk - invalid
    out = torch.full((rows, inter), POISON, device="cuda", dtype=dtype)
    ref = torch.full_like(out, POISON)
    grouped_gemm_gated(*inputs, activation, out)
    grouped_gemm_gated_reference(*inputs, activation, ref)
    torch.testing.assert_close(out[:valid], ref[:valid], rtol=1.6e-2, atol=1e-2)
    assert bool((out[valid:] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_model_dims_match_torch_grouped_mm(tokens):
    """qwen3-30b-a3b (128 experts, top-8, hidden 2048, intermediate 768):
    both GEMMs against ``torch._grouped_mm`` on the permuted rows."""
    torch.manual_seed(tokens)
    a, src_routes, topk, w13, offsets = bf16_gated_problem(
        tokens, 8, 128, 768, 2048, "cuda"
    )
    rows = tokens * 8
    act = torch.full((rows, 768), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_gated(a, src_routes, topk, w13, offsets, "silu", act)
    ends = offsets[1:].int()
    gate_up = torch._grouped_mm(
        a[src_routes.long() // topk], deinterleave_gate_up(w13).transpose(1, 2), ends
    )
    expected = gated_act_reference("silu", gate_up.float())
    torch.testing.assert_close(act.float(), expected, rtol=2e-2, atol=2e-2)
    w2 = (torch.randn(128, 2048, 768, device="cuda") / 768**0.5).bfloat16()
    down = torch.full((rows, 2048), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm(act, w2, offsets, down)
    torch.testing.assert_close(
        down, torch._grouped_mm(act, w2.transpose(1, 2), ends), rtol=2e-2, atol=2e-2
    )


@pytest.mark.gpu
@needs_hopper
def test_bf16_cuda_graph_replay_follows_the_routing():
    """Both GEMMs captured once: replays with new offsets and routes equal
    eager calls bit for bit."""
    torch.manual_seed(3)
    a, src_routes, topk, w13, offsets = bf16_gated_problem(512, 4, 32, 256, 512, "cuda")
    w2 = (torch.randn(32, 512, 256, device="cuda") / 16).bfloat16()
    act = torch.full((2048, 256), POISON, device="cuda", dtype=torch.bfloat16)
    down = torch.full((2048, 512), POISON, device="cuda", dtype=torch.bfloat16)

    def layer() -> None:
        grouped_gemm_gated(a, src_routes, topk, w13, offsets, "silu", act)
        grouped_gemm(act, w2, offsets, down)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer()  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer()
    for seed in range(3):
        torch.manual_seed(seed)
        fresh = bf16_gated_problem(512, 4, 32, 256, 512, "cuda")
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
    a, w, offsets = bf16_problem([100, 50], 256, 128, "cuda", spare_rows=0)
    flat = torch.empty(150 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(150, 256)
    assert not hopper_supports(a.device, 256, shifted)
    with pytest.raises(ValueError, match="out: expected a 16-byte aligned start"):
        grouped_gemm(a, w, offsets, shifted)
    flat_a = torch.empty(150 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    a_shifted = flat_a[1:].view(150, 128)
    a_shifted.copy_(a)
    out = torch.empty(150, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a: expected a 16-byte aligned start"):
        grouped_gemm(a_shifted, w, offsets, out)
