"""The W4A16 decode kernel (``marlin/gemv.py``) against the exact product.

The kernel never rounds a weight to 16 bits, so the oracle is the fp32
product with the dequantized weights kept in fp32; the bound is the output's
16-bit rounding plus fp32 accumulation over the terms' magnitudes. CPU runs
go through TRITON_INTERPRET at tiny sizes; ``gpu`` tests use model sizes.
"""

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.model_executor.kernels.marlin import (
    marlin_gemm,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
    unpack_weights,
)
from vllm.model_executor.kernels.marlin.gemv import (
    GEMV_MAX_M,
    GemvConfig,
    default_gemv_config,
    gemv_applies,
)

# The interpreter rounds to bf16 by truncation: one ulp, not half.
ROUNDING = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _exact(a, packed, scales, group_size):
    """The fp32 product with the dequantized weights kept in fp32, and the
    bound each output element must meet."""
    g = a.shape[1] if group_size == -1 else group_size
    w = (unpack_weights(packed).float() - 8) * scales.float().t().repeat_interleave(
        g, dim=1
    )
    exact = a.float() @ w.t()
    terms = a.float().abs() @ w.abs().t()
    return exact, ROUNDING[a.dtype] * exact.abs() + 1e-5 * terms


def _problem(m, n, k, group_size, dtype, device):
    """Fresh random A, packed weights and scales, and :func:`_exact`."""
    q, scales = quantize_weights(torch.randn(n, k, device=device), group_size)
    scales = scales.to(dtype)
    packed = repack_weights(q)
    a = (torch.randn(m, k, device=device) * 3).to(dtype)
    return a, packed, scales, *_exact(a, packed, scales, group_size)


def _check(out, exact, bound):
    error = (out.float() - exact).abs()
    assert bool((error <= bound).all()), (
        f"{int((error > bound).sum())} of {error.numel()} outside the bound; "
        f"max error {float(error.max())}"
    )


def _workspace(device):
    return torch.zeros(marlin_workspace_numel(device), dtype=torch.int32, device=device)


# (N, K, group): N not a multiple of block_n, K a multiple of block_k or not
# (the tail step masked), groups of 128 / 256 / 384 (not a power of two,
# spanning K steps) / per channel.
SHAPES = [
    (40, 384, 128),
    (24, 1024, 128),
    (64, 512, 256),
    (16, 768, 384),
    (24, 256, -1),
    (8, 128, 128),
]
CONFIGS = [GemvConfig(8, 256, 1), GemvConfig(16, 512, 2)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_exact_product(device, shape, m, dtype, config):
    n, k, group_size = shape
    a, packed, scales, exact, bound = _problem(m, n, k, group_size, dtype, device)
    locks = _workspace(device)
    locks[0] = 1000  # poisoned: the kernel must not read or clear it
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    res = marlin_gemm(
        a, packed, scales, locks, group_size=group_size, size_n=n, size_k=k,
        out=out, config=config,
    )  # fmt: skip
    assert res is out
    _check(out, exact, bound)
    assert int(locks[0]) == 1000 and int(locks[1:].abs().sum()) == 0


def test_gemv_applies_by_rows():
    assert gemv_applies(1) and gemv_applies(2)
    assert not gemv_applies(3) and not gemv_applies(GEMV_MAX_M + 1)


def test_default_dispatch_by_rows(device):
    """Up to 2 rows the default path is this kernel (its default config, K a
    whole number of its steps), from 3 the tensor-core kernel, and both
    match."""
    n = 48
    for m in (1, 2, 3):
        # The tensor-core bound below is calibrated at K 256 (its fp16
        # weight rounding grows with K).
        k = 2048 if gemv_applies(m) else 256
        a, packed, scales, exact, bound = _problem(m, n, k, 128, torch.float16, device)
        out = marlin_gemm(
            a, packed, scales, _workspace(device), group_size=128, size_n=n, size_k=k
        )
        # The tensor-core kernel rounds weights to fp16 first: a looser bound.
        _check(out, exact, bound if gemv_applies(m) else 4 * bound + 1e-2)


def test_rows_of_a_and_out_with_a_stride(device):
    """A and out as views with row strides past K and N (slices of wider
    buffers) and a K-step tail: only their own columns are read / written."""
    n, k = 16, 384
    a, packed, scales, exact, bound = _problem(3, n, k, 128, torch.bfloat16, device)
    wide = torch.full((3, k + 128), float("inf"), dtype=a.dtype, device=device)
    wide[:, :k] = a
    out = torch.full((3, n + 8), 7.0, dtype=a.dtype, device=device)
    marlin_gemm(
        wide[:, :k], packed, scales, _workspace(device), group_size=128, size_n=n,
        size_k=k, out=out[:, :n], config=GemvConfig(8, 256, 1),
    )  # fmt: skip
    _check(out[:, :n], exact, bound)
    assert bool((out[:, n:] == 7.0).all())


def test_bad_configs_raise(device):
    n, k = 16, 256
    a, packed, scales, _, _ = _problem(GEMV_MAX_M + 1, n, k, 128, torch.float16, device)
    call = functools.partial(
        marlin_gemm, b_packed=packed, scales=scales, workspace=_workspace(device),
        group_size=128, size_n=n, size_k=k,
    )  # fmt: skip
    with pytest.raises(ValueError, match="a: at most"):
        call(a, config=GemvConfig(8, 256, 1))
    with pytest.raises(ValueError, match="block_k"):
        call(a[:1], config=GemvConfig(8, 384, 1))
    with pytest.raises(ValueError, match="lanes"):
        call(a[:1], config=GemvConfig(8, 256, 2))
    with pytest.raises(ValueError, match="block_n"):
        call(a[:1], config=GemvConfig(12, 256, 1))
    with pytest.raises(ValueError, match="num_warps"):
        call(a[:1], config=GemvConfig(8, 1024, 3))


GPU_SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_model_sizes(shape, m, group_size):
    n, k = shape
    dev = torch.device("cuda")
    a, packed, scales, exact, bound = _problem(m, n, k, group_size, torch.bfloat16, dev)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    marlin_gemm(
        a, packed, scales, _workspace(dev), group_size=group_size, size_n=n,
        size_k=k, out=out, config=default_gemv_config(m, k),
    )  # fmt: skip
    _check(out, exact, bound)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs():
    m, n, k = 2, 8192, 8192
    dev = torch.device("cuda")
    a, packed, scales, _, _ = _problem(m, n, k, 128, torch.bfloat16, dev)
    locks = _workspace(dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    gemm = functools.partial(
        marlin_gemm, b_packed=packed, scales=scales, workspace=locks,
        group_size=128, size_n=n, size_k=k, out=out, config=default_gemv_config(m, k),
    )  # fmt: skip
    replay_with_new_inputs(gemm, a, out, lambda: _exact(a, packed, scales, 128))


def replay_with_new_inputs(gemm, a, out, exact_and_bound) -> None:
    """Captures ``gemm(a)`` (writing ``out``) in a CUDA graph, compiled
    outside it, and replays it twice on fresh random ``a`` with ``out``
    poisoned, checking each result against ``exact_and_bound()``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemm(a)  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm(a)
    for _ in range(2):
        a.copy_(torch.randn_like(a.float()).to(a.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, *exact_and_bound())


SANITIZER = shutil.which("compute-sanitizer") or shutil.which(
    "compute-sanitizer",
    path=Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"),
)


@pytest.mark.gpu
@pytest.mark.skipif(
    SANITIZER is None, reason="needs compute-sanitizer (PATH, $CUDA_HOME/bin)"
)
@pytest.mark.parametrize("module", ["test_gemv.py", "test_moe_decode.py"])
def test_gpu_clamped_reads_stay_in_bounds(module):
    """The decode kernels clamp rows past N, rows of A past M, invalid expert
    ids and the EVEN_K load of the next step instead of masking them: the
    device tests of ``module`` (partial tiles, invalid ids, row strides)
    under memcheck, with the caching allocator off so that a read past any
    tensor is caught."""
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", GPU_TESTS_ONLY="1")
    result = subprocess.run(
        [str(SANITIZER), "--tool", "memcheck", "--error-exitcode", "99",
         sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", "not gpu", str(Path(__file__).with_name(module))],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert "ERROR SUMMARY: 0 errors" in report, report
