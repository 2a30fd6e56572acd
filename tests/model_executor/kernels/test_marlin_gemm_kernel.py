"""Marlin W4A16 Triton GEMM against the plain-PyTorch dequantized reference.

CPU runs go through TRITON_INTERPRET (set by tests/conftest.py) at tiny sizes;
``gpu`` tests use full model sizes.
"""

import functools

import pytest
import torch

from vllm.model_executor.kernels.marlin_gemm import (
    MarlinConfig,
    dequantize_weights,
    marlin_gemm,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
    unpack_weights,
)

CUDA = torch.cuda.is_available()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _problem(
    m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random ``a``, packed weights, scales and the fp32 reference output."""
    w = torch.randn(n, k, device=device)
    q, scales = quantize_weights(w, group_size)
    scales = scales.to(dtype)
    packed = repack_weights(q)
    a = torch.randn(m, k, device=device).to(dtype)
    ref = a.float() @ dequantize_weights(packed, scales, group_size).float().t()
    return a, packed, scales, ref


def _workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(marlin_workspace_numel(device), dtype=torch.int32, device=device)


def _poisoned_out(m: int, n: int, dtype: torch.dtype, device: torch.device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def test_repack_roundtrip(device: torch.device) -> None:
    q = torch.randint(0, 16, (24, 256), dtype=torch.uint8, device=device)
    packed = repack_weights(q)
    assert packed.dtype == torch.int32 and packed.shape == (24, 32)
    assert torch.equal(unpack_weights(packed), q.to(torch.int32))
    scales = torch.rand(2, 24, device=device).to(torch.bfloat16)
    assert torch.equal(
        dequantize_weights(packed, scales, 128), dequantize_weights(q, scales, 128)
    )


@pytest.mark.parametrize("group_size", [128, -1])
def test_quantize_close_to_weights(device: torch.device, group_size: int) -> None:
    w = torch.randn(32, 256, device=device)
    q, scales = quantize_weights(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    deq = dequantize_weights(q, scales, group_size)
    # Uniform rounding error on a grid of max|w| / 7: about 0.11 for Gaussians.
    assert _rel_err(deq, w) < 0.2


# (N, K, group): split-K active at small M; N not a multiple of the tile; groups.
SHAPES = [(64, 512, 128), (96, 256, -1), (128, 256, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 1000])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(
    device: torch.device, dtype: torch.dtype, m: int, shape: tuple[int, int, int]
) -> None:
    n, k, group_size = shape
    a, packed, scales, ref = _problem(m, n, k, group_size, dtype, device)
    ws = _workspace(device)
    out = _poisoned_out(m, n, dtype, device)
    res = marlin_gemm(
        a, packed, scales, ws, group_size=group_size, size_n=n, size_k=k, out=out
    )
    assert res is out
    # The interpreter rounds to bf16 by truncation, and split-K partials pass
    # through the output dtype: a few bf16 ulps.
    assert _rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-3)
    assert int(ws.abs().sum()) == 0


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_leaves_locks_zero(device: torch.device, split_k: int) -> None:
    m, n, k = 5, 128, 512
    a, packed, scales, ref = _problem(m, n, k, 128, torch.float16, device)
    ws = _workspace(device)
    cfg = MarlinConfig(16, 64, split_k, 4, 2)
    for _ in range(2):  # the second call relies on the first leaving zeros
        out = marlin_gemm(
            a, packed, scales, ws, group_size=128, size_n=n, size_k=k, config=cfg
        )
        assert _rel_err(out, ref) < 2e-3
        assert int(ws.abs().sum()) == 0


def test_poisoned_lock_stays_visible(device: torch.device) -> None:
    """A counter that no slice can produce is passed over, not spun on forever.

    The poison survives the call, so a later call (or a check) sees a dirty
    buffer; on the GPU its slices race (see the gpu test for wrong results).
    A counter inside 0..split_k-1 would make slice 0 wait for a later slice,
    which never ends under the interpreter and is why the buffer must be zero.
    """
    m, n, k = 3, 64, 256
    a, packed, scales, _ = _problem(m, n, k, 128, torch.float16, device)
    ws = _workspace(device)
    ws[0] = 1000
    marlin_gemm(
        a,
        packed,
        scales,
        ws,
        group_size=128,
        size_n=n,
        size_k=k,
        config=MarlinConfig(16, 64, 2, 4, 2),
    )
    assert int(ws[0]) == 1000 and int(ws[1:].abs().sum()) == 0


def test_bad_inputs_raise(device: torch.device) -> None:
    m, n, k = 2, 64, 256
    a, packed, scales, _ = _problem(m, n, k, 128, torch.bfloat16, device)
    ws = _workspace(device)
    gemm = functools.partial(marlin_gemm, group_size=128, size_n=n, size_k=k)
    with pytest.raises(ValueError, match="a:"):
        gemm(a.float(), packed, scales, ws)
    with pytest.raises(ValueError, match="a:"):
        gemm(a[:, :128], packed, scales, ws)
    with pytest.raises(ValueError, match="size_k"):
        marlin_gemm(
            a[:, :200], packed, scales, ws, group_size=128, size_n=n, size_k=200
        )
    with pytest.raises(ValueError, match="group_size"):
        marlin_gemm(a, packed, scales, ws, group_size=96, size_n=n, size_k=k)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed.to(torch.int64), scales, ws)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed[:32], scales, ws)
    with pytest.raises(ValueError, match="scales"):
        gemm(a, packed, scales.half(), ws)
    with pytest.raises(ValueError, match="scales"):
        gemm(a, packed, scales[:1], ws)
    with pytest.raises(ValueError, match="workspace"):
        gemm(a, packed, scales, ws.to(torch.int64))
    with pytest.raises(ValueError, match="workspace"):
        gemm(a, packed, scales, ws[:1])
    with pytest.raises(ValueError, match="out"):
        gemm(a, packed, scales, ws, out=torch.empty_like(a))
    with pytest.raises(ValueError, match="config"):
        gemm(a, packed, scales, ws, config=MarlinConfig(16, 64, 3, 4, 2))


GPU_SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 1000, 4096])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_full_sizes(m: int, shape: tuple[int, int], group_size: int) -> None:
    n, k = shape
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, group_size, torch.bfloat16, dev)
    ws = _workspace(dev)
    out = _poisoned_out(m, n, torch.bfloat16, dev)
    marlin_gemm(
        a, packed, scales, ws, group_size=group_size, size_n=n, size_k=k, out=out
    )
    assert _rel_err(out, ref) < 1e-2
    assert int(ws.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_poisoned_lock_gives_wrong_result() -> None:
    """Counter 1 at launch: slice 1 goes first and slice 0 then overwrites it."""
    m, n, k = 1, 4096, 4096
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, 128, torch.bfloat16, dev)
    ws = _workspace(dev)
    cfg = MarlinConfig(16, 128, 2, 4, 4)
    ws[0] = 1
    out = marlin_gemm(
        a, packed, scales, ws, group_size=128, size_n=n, size_k=k, config=cfg
    )
    assert _rel_err(out[:, :128], ref[:, :128]) > 0.1
    assert int(ws[0]) == 1  # still dirty: the next call would go wrong too
    assert _rel_err(out[:, 128:], ref[:, 128:]) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay() -> None:
    m, n, k = 16, 8192, 8192
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, 128, torch.bfloat16, dev)
    ws = _workspace(dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.Stream()
    gemm = functools.partial(marlin_gemm, group_size=128, size_n=n, size_k=k, out=out)
    with torch.cuda.stream(stream):
        gemm(a, packed, scales, ws)  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm(a, packed, scales, ws)
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, ref) < 1e-2
    assert int(ws.abs().sum()) == 0
