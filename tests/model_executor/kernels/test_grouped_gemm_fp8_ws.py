import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from tests.model_executor.kernels.test_grouped_gemm_fp8 import (
    POISON,
    gated_problem,
    problem,
)
from vllm.model_executor.kernels import grouped_gemm_fp8_ws as ws
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    GroupedGemmConfig,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
)

H200_SHARED_BYTES = 232448  # per block, opt-in maximum on sm90


def compile_for_sm90() -> None:
    """Compiles both kernels for Hopper and prints, per kernel, whether its
    PTX holds wgmma and its shared memory bytes (run by the test below in a
    process of its own)."""
    rows, experts, n, k, topk = 256, 4, 512, 256, 2
    fp8 = torch.float8_e4m3fn
    a, w = torch.empty(rows, k, dtype=fp8), torch.empty(experts * n, k, dtype=fp8)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    act = torch.empty(rows, n // 2, dtype=torch.bfloat16)
    block = [ws.BLOCK_M.value, ws.BLOCK_K.value]
    w_block = [ws.BLOCK_N.value, ws.BLOCK_K.value]
    out_block = [ws.BLOCK_M.value // 2, ws.BLOCK_N.value]
    act_block = [ws.BLOCK_M.value // 2, ws.BLOCK_N.value // 2]
    plain = {
        "a_desc": ws._descriptor(a, block),
        "w_desc": ws._descriptor(w, w_block),
        "a_scale_ptr": torch.empty(rows),
        "w_scale_ptr": torch.empty(experts * n),
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": out,
        "out_desc": ws._descriptor(out, out_block),
        "N": n,
        "K": k,
        "num_experts": experts,
    }
    gated = {
        "a_ptr": a,
        "a_scale_ptr": torch.empty(rows),
        "src_routes_ptr": torch.empty(rows, dtype=torch.int32),
        "w_desc": ws._descriptor(w, w_block),
        "w_scale_ptr": torch.empty(experts * n),
        "offsets_ptr": torch.empty(experts + 1, dtype=torch.int64),
        "out_ptr": act,
        "out_desc": ws._descriptor(act, act_block),
        "inter": n // 2,
        "K": k,
        "num_experts": experts,
        "topk": topk,
    }
    constexprs = {"MODE": 1, "ALPHA": 1.0, "LIMIT": 7.0}
    for kernel, args, consts in (
        (ws._grouped_gemm_fp8_ws_kernel, plain, {}),
        (ws._grouped_gemm_fp8_gated_ws_kernel, gated, constexprs),
    ):
        consts = {**consts, "BLOCK_E": experts}
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
        print(
            json.dumps(
                ["wgmma.mma_async" in compiled.asm["ptx"], compiled.metadata.shared]
            )
        )


def test_compiles_for_sm90_without_a_gpu():
    """The kernels build for Hopper with the installed Triton (CI has no GPU
    and a newer Triton than the H200 here) and fit its shared memory. In a
    process of its own: TRITON_INTERPRET, which the CPU tests run under,
    patches Triton's language for the kernels it runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[3]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    module = "tests.model_executor.kernels.test_grouped_gemm_fp8_ws"
    code = f"from {module} import compile_for_sm90; compile_for_sm90()"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    kernels = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(kernels) == 2
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


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "counts",
    [
        [1],
        [0, 70, 130, 1],  # empty first expert, halves with 6 and 2 rows
        [64, 65, 63, 128, 129, 0, 5, 300],  # exactly full halves and tiles
        [0, 0, 0],
    ],
    ids=["one-row", "uneven", "half-boundaries", "empty"],
)
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
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_launcher_takes_it_at_model_dims(tokens, monkeypatch):
    """qwen3-30b-a3b GEMM2 (N 2048, K 768, 128 experts, top-8): the launcher
    picks this kernel for 128-row tiles, and it agrees with the Triton one."""
    torch.manual_seed(tokens)
    ids = torch.randint(0, 128, (tokens * 8,))
    counts = torch.bincount(ids, minlength=128).tolist()
    inputs = problem(counts, 2048, 768, torch.device("cuda"), spare_rows=0)
    launched: list[None] = []
    launch = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *args: launched.append(launch(*args)))
    out = torch.full((tokens * 8, 2048), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8(*inputs, out)
    assert len(launched) == (tokens * 8 > 64 * 128)
    triton_out = torch.full_like(out, POISON)
    grouped_gemm_fp8(*inputs, triton_out, GroupedGemmConfig(128, 256, 128, 8, 4))
    torch.testing.assert_close(out, triton_out, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize(
    "tokens,topk,experts,inter,k,invalid",
    [
        (1, 1, 4, 128, 128, 0),  # one row
        (60, 3, 2, 200, 176, 9),  # partial gate/up tile and K step; non-local routes
        (300, 8, 16, 768, 2048, 0),  # model dims, ~150 rows per expert
        (40, 4, 3, 64, 48, 0),  # fewer gate/up columns than a tile
    ],
    ids=str,
)
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
def test_gated_launcher_takes_it_at_model_dims(monkeypatch):
    """qwen3-30b-a3b GEMM1 at 8192 tokens: the launcher picks this kernel,
    and it agrees with the Triton one."""
    torch.manual_seed(0)
    inputs = gated_problem(8192, 8, 128, 768, 2048, "cuda")
    launched: list[None] = []
    launch = ws.launch_gated
    monkeypatch.setattr(
        ws, "launch_gated", lambda *args: launched.append(launch(*args))
    )
    out = torch.full((8192 * 8, 768), POISON, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8_gated(*inputs, "silu", out)
    assert len(launched) == 1
    triton_out = torch.full_like(out, POISON)
    config = GroupedGemmConfig(128, 128, 128, 8, 4)
    grouped_gemm_fp8_gated(*inputs, "silu", triton_out, config)
    torch.testing.assert_close(out, triton_out, rtol=1e-3, atol=1e-3)
