"""Problems and helpers shared by the grouped GEMM tests."""

import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    GroupedGemmConfig,
    act_groups,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    interleave_gate_up,
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


def bf16_problem(
    counts: list[int], n: int, k: int, device, dtype=torch.bfloat16, spare_rows=17
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows grouped by expert (``counts`` each) plus ``spare_rows``
    past the last expert's end, weights [E, N, K] scaled to unit outputs,
    and the offsets."""
    a = torch.randn(sum(counts) + spare_rows, k, device=device).to(dtype)
    w = (torch.randn(len(counts), n, k, device=device) / k**0.5).to(dtype)
    return a, w, torch.tensor([0, *counts], device=device).cumsum(0)


def bf16_gated_problem(
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


def group_scales(rows: int, k: int) -> torch.Tensor:
    """Per-group row scales [rows, act_groups(k)] whose groups differ by up
    to 10^4 within a row: the rescale between K steps must carry them."""
    groups = act_groups(k)
    exponents = torch.randint(-2, 3, (rows, groups), device="cuda").float()
    return (torch.rand(rows, groups, device="cuda") + 0.1) * 10**exponents


H200_SHARED_BYTES = 232448  # per block, opt-in maximum on sm90
COMPILED = "compiled for sm90:"


def compile_for_sm90(
    builds: list[tuple[triton.JITFunction, dict[str, object], dict[str, object]]],
) -> None:
    """Compiles each (kernel, host arguments, constexprs) for Hopper with 4
    and 256 experts. Prints per build whether its PTX holds wgmma, its
    shared memory bytes and :func:`wgmmas_serialized` (run by
    :func:`compiled_in_own_process`)."""
    # Triton internals: imported here, so that a move fails this test only.
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for (kernel, args, consts), block_e in itertools.product(builds, (4, 256)):
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
        serialized = wgmmas_serialized(compiled.asm["ptx"])
        print(COMPILED, json.dumps([wgmma, compiled.metadata.shared, serialized]))


def sass(cubin: bytes, option: str = "-sass") -> str:
    """The SASS of ``cubin`` (or what ``option`` asks), by the cuobjdump
    Triton ships."""
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = [str(cuobjdump), option, f.name]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout


def wgmmas_serialized(ptx: str) -> bool:
    """Whether ptxas serializes the wgmmas of ``ptx`` (sm_90a): it does so
    to all of a kernel's where it cannot tell that an accumulator read
    follows the wait that retired its MMA, saying so only in its info log,
    which Triton does not show."""
    # Triton internals: imported here, so that a move fails this test only.
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        run = [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source)]
        log = subprocess.run(
            [*run, "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return "wgmma.mma_async instructions are serialized" in log


def asm_for_sm90(
    kernel: triton.JITFunction,
    consts: Mapping[str, object],
    pointers: Mapping[str, str],
    aligned: tuple[str, ...],
    num_warps: int,
    num_stages: int = 3,
) -> dict[str, Any]:
    """``kernel`` (plain Triton) built for Hopper, its code by kind ("ptx",
    "cubin", ...): its other arguments are pointers (``*bf16`` unless
    ``pointers`` names their type) and int32 scalars; the pointers and the
    scalars named in ``aligned`` 16-byte divisible, as a launch at model
    sizes specializes them."""
    # Triton internals: imported here, so that a move fails this test only.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    args = [p.name for p in kernel.params if p.name not in consts]
    signature = {
        a: pointers.get(a, "*bf16") if a.endswith("_ptr") else "i32" for a in args
    }
    signature |= dict.fromkeys(consts, "constexpr")
    # (attribute keys index all parameters, constexprs included)
    divisible = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(p.name for p in kernel.params)
        if a in args and (a.endswith("_ptr") or a in aligned)
    }
    source = ASTSource(kernel, signature, constexprs=dict(consts), attrs=divisible)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm


def compiled_in_own_process(module: str) -> list[tuple[Any, ...]]:
    """What ``module``'s ``compile_kernels()`` prints per build (the grouped
    GEMMs: PTX holds wgmma, shared memory bytes), run in a process of its
    own: TRITON_INTERPRET, which the CPU tests run under, patches Triton's
    language for the kernels it runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[4]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    code = f"from {module} import compile_kernels; compile_kernels()"
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
    return [
        tuple(json.loads(x[len(COMPILED) :])) for x in lines if x.startswith(COMPILED)
    ]


def assert_hopper_builds(module: str, count: int) -> None:
    """``module``'s ``compile_kernels()`` (Gluon Hopper GEMMs) in a process
    of its own: ``count`` builds, each multiplying on wgmma within a block's
    shared memory, with ptxas overlapping its wgmmas."""
    builds = compiled_in_own_process(module)
    assert len(builds) == count
    for has_wgmma, shared, serialized in builds:
        assert has_wgmma
        assert 0 < shared <= H200_SHARED_BYTES
        assert not serialized  # ptxas overlaps the MMAs
