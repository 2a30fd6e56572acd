import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import triton

from tests.model_executor.kernels.test_grouped_gemm_fp8 import (
    POISON,
    GatedProblem,
    Problem,
    gated_problem,
    problem,
)
from vllm.model_executor.kernels import grouped_gemm_ws as ws
from vllm.model_executor.kernels.common.activation_quant import (
    FP8_MAX,
    MIN_SCALE,
    act_and_quant,
)
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    FP8_DTYPE,
    GroupedGemmConfig,
    act_groups,
    dequantize_rows,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    takes_gluon,
    takes_gluon_gated,
)

H200_SHARED_BYTES = 232448  # per block, opt-in maximum on sm90
GROUP = ws.GROUP.value


COMPILED = "compiled for sm90:"


def kernel_args(
    operand: torch.dtype,
) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    """Host arguments of the plain, gated and fp8-out gated kernels for
    ``operand`` (fp8 or 16-bit) A and weights, as the launchers pass them
    (16-bit calls pass ``out`` for the scales they never read)."""
    rows, experts, n, k, topk = 256, 4, 512, 256, 2
    fp8 = operand == FP8_DTYPE
    a = torch.empty(rows, k, dtype=operand)
    w = torch.empty(experts * n, k, dtype=operand)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    act = torch.empty(rows, n // 2, dtype=torch.bfloat16)
    act_q = torch.empty(rows, n // 2, dtype=FP8_DTYPE)
    out_block = [ws.BLOCK_M.value // 2, ws.BLOCK_N.value]
    act_block = [ws.BLOCK_M.value // 2, ws.BLOCK_N.value // 2]
    plain = {
        "a_desc": ws._k_box(a, ws.BLOCK_M.value),
        "w_desc": ws._k_box(w, ws.BLOCK_N.value),
        "a_scale_ptr": torch.empty(rows) if fp8 else out,
        "w_scale_ptr": torch.empty(experts * n) if fp8 else out,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": out,
        "out_desc": ws._descriptor(out, out_block),
        "N": n,
        "K": k,
        "groups": 1,
        "num_experts": experts,
    }
    gated = {
        "a_ptr": a,
        "a_scale_ptr": torch.empty(rows) if fp8 else act,
        "src_routes_ptr": torch.empty(rows, dtype=torch.int32),
        "w_desc": ws._k_box(w, ws.BLOCK_N.value),
        "w_scale_ptr": torch.empty(experts * n) if fp8 else act,
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": act,
        "out_desc": ws._descriptor(act, act_block),
        "out_scale_ptr": torch.empty(rows, n // 2 // GROUP),
        "inter": n // 2,
        "K": k,
        "num_experts": experts,
        "topk": topk,
    }
    quantized = {**gated, "out_desc": ws._descriptor(act_q, act_block)}
    return plain, gated, quantized


def compile_for_sm90() -> None:
    """Compiles both kernels for Hopper with 4 and 256 experts: fp8 per-row
    and group-quantized, and bf16. Prints per build whether its PTX holds
    wgmma and its shared memory bytes (run by the test below in a process
    of its own)."""
    # Triton internals: imported here, so that a move fails this test only.
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    plain, gated, quantized = kernel_args(FP8_DTYPE)
    plain16, gated16, _ = kernel_args(torch.bfloat16)
    act_consts = {"MODE": 1, "ALPHA": 1.0, "LIMIT": 7.0}
    gated_consts = {**act_consts, "QUANT": False}
    for (kernel, args, consts), block_e in itertools.product(
        (
            (ws._grouped_gemm_ws_kernel, plain, {"GROUPED": False}),
            (ws._grouped_gemm_ws_kernel, plain, {"GROUPED": True}),
            (ws._grouped_gemm_gated_ws_kernel, gated, gated_consts),
            (
                ws._grouped_gemm_gated_ws_kernel,
                quantized,
                {**act_consts, "QUANT": True},
            ),
            (ws._grouped_gemm_ws_kernel, plain16, {"GROUPED": False}),
            (ws._grouped_gemm_gated_ws_kernel, gated16, gated_consts),
        ),
        (4, 256),
    ):
        consts = {**consts, "BLOCK_E": block_e}
        signature = {name: mangle_type(value) for name, value in args.items()}
        signature |= dict.fromkeys(consts, "constexpr")
        # As the launch specializes them: 16-byte aligned pointers and sizes.
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, (name, value) in enumerate(args.items())
            if isinstance(value, torch.Tensor) or name in ("N", "K", "inter")
        }
        source = GluonASTSource(kernel, signature, constexprs=consts, attrs=aligned)
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
        )
        wgmma = "wgmma.mma_async" in compiled.asm["ptx"]
        print(COMPILED, json.dumps([wgmma, compiled.metadata.shared]))


def test_compiles_for_sm90_without_a_gpu():
    """The kernels build for Hopper with the installed Triton (CI has no GPU
    and a newer Triton than the H200 here) and fit its shared memory. In a
    process of its own: TRITON_INTERPRET, which the CPU tests run under,
    patches Triton's language for the kernels it runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[3]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    module = "tests.model_executor.kernels.test_grouped_gemm_ws"
    code = f"from {module} import compile_for_sm90; compile_for_sm90()"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    kernels = [json.loads(x[len(COMPILED) :]) for x in lines if x.startswith(COMPILED)]
    assert len(kernels) == 12
    for has_wgmma, shared in kernels:
        assert has_wgmma
        assert 0 < shared <= H200_SHARED_BYTES


def test_not_taken_off_hopper():
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    assert not ws.supports(torch.device("cpu"), 16, out)


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm90 GPU",
)
HALF_BOUNDARIES = [64, 65, 63, 128, 129, 0, 5, 300]  # full, partial, empty halves
EXPERT_COUNTS = pytest.mark.parametrize(  # rows per expert
    "counts",
    [[1], [0, 70, 130, 1], HALF_BOUNDARIES, [0, 0, 0]],
    ids=["one-row", "uneven", "half-boundaries", "empty"],
)
GATED_CASES = [  # tokens, topk, experts, inter, k, non-local routes
    (1, 1, 4, 128, 128, 0),  # one row
    (60, 3, 2, 208, 176, 9),  # partial gate/up tile (group) and K step
    (300, 8, 16, 768, 2048, 0),  # model dims, ~150 rows per expert, six groups
    (40, 4, 3, 64, 48, 0),  # fewer gate/up columns than a tile
    (64, 8, 256, 128, 128, 0),  # 256 experts
]


def counted_gated_problem(
    counts: list[int], inter: int, k: int, spare_rows: int = 0
) -> GatedProblem:
    """gated_problem with ``counts`` routes per expert (top-1, so a route is
    its token), the routes shuffled over the tokens, and ``spare_rows``
    past the last expert's end whose routes must never be read."""
    experts = len(counts)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    ids = ids[torch.randperm(ids.numel())].cuda()
    a = (torch.randn(ids.numel(), k, device="cuda") * 2).to(torch.float8_e4m3fn)
    a_scale = torch.rand(ids.numel(), device="cuda") + 0.1
    src_routes = torch.full((ids.numel() + spare_rows,), 2**30, device="cuda")
    src_routes[: ids.numel()] = torch.sort(ids, stable=True).indices
    offsets = torch.tensor([0, *counts], device="cuda").cumsum(0)
    w13 = (torch.randn(experts, 2 * inter, k, device="cuda") * 2).to(
        torch.float8_e4m3fn
    )
    w13_scale = torch.rand(experts, 2 * inter, device="cuda") / k + 1e-3
    return a, a_scale, src_routes.int(), 1, w13, w13_scale, offsets


def model_gemm2(tokens: int, experts: int = 128) -> Problem:
    """qwen3-30b-a3b GEMM2 operands (N 2048, K 768, top-8), uneven routing."""
    ids = torch.randint(0, experts, (tokens * 8,))
    counts = torch.bincount(ids, minlength=experts).tolist()
    return problem(counts, 2048, 768, torch.device("cuda"), spare_rows=0)


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
    assert ws.supports(out.device, n, out)
    ws.launch(*inputs, out)
    grouped_gemm_fp8_reference(*inputs, ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tokens,experts", [(1024, 128), (8192, 128), (4096, 256)])
def test_launcher_takes_it_and_matches_triton_bitwise(tokens, experts):
    """GEMM2 at model dims (and 256 experts): the launcher picks this kernel
    for 128-row tiles; its output equals the Triton kernel's bit for bit
    (same K order) and the same on every call."""
    torch.manual_seed(tokens)
    inputs = model_gemm2(tokens, experts)
    out = torch.full((tokens * 8, 2048), POISON, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(ws, "launch", wraps=ws.launch) as launch:
        grouped_gemm_fp8(*inputs, out)
    assert launch.call_count == (tokens * 8 > 64 * experts)
    triton_out = torch.full_like(out, POISON)
    grouped_gemm_fp8(*inputs, triton_out, GroupedGemmConfig(128, 256, 128, 8, 4))
    assert torch.equal(out, triton_out)
    again = torch.full_like(out, POISON)
    for _ in range(4):
        grouped_gemm_fp8(*inputs, again)
        assert torch.equal(again, out)


def group_scales(rows: int, k: int) -> torch.Tensor:
    """Per-group row scales [rows, act_groups(k)] whose groups differ by up
    to 10^4 within a row: the rescale between K steps must carry them."""
    groups = act_groups(k)
    exponents = torch.randint(-2, 3, (rows, groups), device="cuda").float()
    return (torch.rand(rows, groups, device="cuda") + 0.1) * 10**exponents


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
    ws.launch(a, scale, w, w_scale, offsets, out)
    grouped_gemm_fp8_reference(a, scale, w, w_scale, offsets, ref)
    # Hopper's fp8 MMAs add with fewer mantissa bits than fp32: a sum that
    # nearly cancels is off by a share of its largest terms.
    largest = float(ref.float().abs().max())
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-3 * largest)
    assert bool((out[sum(counts) :] == POISON).all())


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
    assert ws.supports_gated(inputs[0], inter, out)
    ws.launch_gated(*inputs, activation, out, scale)
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
        mock.patch.object(ws, "launch_gated", wraps=ws.launch_gated) as gated,
        mock.patch.object(ws, "launch", wraps=ws.launch) as plain,
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
def test_cuda_graph_replay_follows_the_routing(grouped):
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
def test_unsupported_calls_take_the_triton_kernels():
    """N not a multiple of 8, an ``out`` or gathered ``a`` off 16-byte
    alignment: the Triton kernels run, with the same results."""
    torch.manual_seed(2)
    inputs = model_gemm2(2048)
    rows = inputs[0].shape[0]
    ref = grouped_gemm_fp8_reference(
        *inputs, torch.empty(rows, 2048, device="cuda", dtype=torch.bfloat16)
    )
    flat = torch.empty(rows * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(rows, 2048)  # 2-byte aligned
    assert not takes_gluon(inputs[0], inputs[2], shifted)
    grouped_gemm_fp8(*inputs, shifted)
    torch.testing.assert_close(shifted, ref, rtol=1.6e-2, atol=1e-2)
    narrow = torch.empty(rows, 2044, device="cuda", dtype=torch.bfloat16)
    assert not takes_gluon(inputs[0], inputs[2][:, :2044], narrow)
    gated = counted_gated_problem([300, 200], 128, 256)
    a_bytes = torch.empty(gated[0].numel() + 8, device="cuda", dtype=torch.uint8)
    a_off = a_bytes[8:].view(gated[0].dtype).view(gated[0].shape)
    a_off.copy_(gated[0])
    act = torch.empty(500, 128, device="cuda", dtype=torch.bfloat16)
    assert takes_gluon_gated(gated[0], gated[4], act)
    assert not takes_gluon_gated(a_off, gated[4], act)
    grouped_gemm_fp8_gated(a_off, *gated[1:], "silu", act)
    ref_act = grouped_gemm_fp8_gated_reference(*gated, "silu", torch.empty_like(act))
    torch.testing.assert_close(act, ref_act, rtol=1.6e-2, atol=1e-2)


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
    assert ws.supports_gated(inputs[0], inter, out)
    ws.launch_gated(*inputs, activation, out)
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
    ws.launch_gated(*inputs, "silu", out)
    grouped_gemm_fp8_gated_reference(*inputs, "silu", ref)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert bool((out[sum(counts) :] == POISON).all())


@pytest.mark.gpu
@needs_hopper
def test_gated_launcher_takes_it_and_matches_triton_bitwise():
    """qwen3-30b-a3b GEMM1 at 8192 tokens: the launcher picks this kernel;
    bit for bit the Triton kernel's output, on every call."""
    torch.manual_seed(0)
    inputs = gated_problem(8192, 8, 128, 768, 2048, "cuda")
    out = torch.full((8192 * 8, 768), POISON, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(ws, "launch_gated", wraps=ws.launch_gated) as launch:
        grouped_gemm_fp8_gated(*inputs, "silu", out)
    launch.assert_called_once()
    triton_out = torch.full_like(out, POISON)
    config = GroupedGemmConfig(128, 128, 128, 8, 4)
    grouped_gemm_fp8_gated(*inputs, "silu", triton_out, config)
    assert torch.equal(out, triton_out)
    again = torch.full_like(out, POISON)
    for _ in range(4):
        grouped_gemm_fp8_gated(*inputs, "silu", again)
        assert torch.equal(again, out)
