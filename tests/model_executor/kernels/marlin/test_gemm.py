"""The Marlin W4A16 launchers (dense and grouped) against plain-PyTorch
dequantized references.

CPU runs go through TRITON_INTERPRET (set by tests/conftest.py) at tiny sizes;
``gpu`` tests use full model sizes. In the grouped tests rows past
``offsets[-1]`` are poisoned in A and in the output, and must stay untouched.
"""

import functools
import json

import pytest
import torch

from tests.model_executor.kernels.grouped_gemm.utils import (
    COMPILED,
    asm_for_sm90,
    compiled_in_own_process,
    needs_hopper,
    wgmmas_serialized,
)
from vllm.model_executor.kernels.grouped_gemm import hopper_plain
from vllm.model_executor.kernels.marlin import (
    MAX_GROUPED_EXPERTS,
    MarlinConfig,
    dequantize_weights,
    marlin_gemm,
    marlin_gemm_grouped,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
)
from vllm.model_executor.kernels.marlin import gemm as gemm_module
from vllm.model_executor.kernels.marlin.config import TILE_K, _tile_for_m
from vllm.model_executor.kernels.marlin.kernels import _marlin_gemm_grouped_kernel

SENTINEL = 7.0  # untouched output rows of the grouped GEMM keep it


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


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
    locks = _workspace(device)
    out = _poisoned_out(m, n, dtype, device)
    res = marlin_gemm(
        a, packed, scales, locks, group_size=group_size, size_n=n, size_k=k, out=out
    )
    assert res is out
    # The interpreter rounds to bf16 by truncation, and split-K partials pass
    # through the output dtype: a few bf16 ulps.
    assert _rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-3)
    assert int(locks.abs().sum()) == 0


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_leaves_locks_zero(device: torch.device, split_k: int) -> None:
    m, n, k = 5, 128, 512
    a, packed, scales, ref = _problem(m, n, k, 128, torch.float16, device)
    locks = _workspace(device)
    cfg = MarlinConfig(16, 64, split_k, 4, 2)
    for _ in range(2):  # the second call relies on the first leaving zeros
        out = marlin_gemm(
            a, packed, scales, locks, group_size=128, size_n=n, size_k=k, config=cfg
        )
        assert _rel_err(out, ref) < 2e-3
        assert int(locks.abs().sum()) == 0


def test_poisoned_lock_stays_visible(device: torch.device) -> None:
    """A counter that no slice can produce is passed over, not spun on forever.

    The poison survives the call, so a later call (or a check) sees a dirty
    buffer; on the GPU its slices race (see the gpu test for wrong results).
    A counter inside 0..split_k-1 would make slice 0 wait for a later slice,
    which never ends under the interpreter and is why the buffer must be zero.
    """
    m, n, k = 3, 64, 256
    a, packed, scales, _ = _problem(m, n, k, 128, torch.float16, device)
    locks = _workspace(device)
    locks[0] = 1000
    marlin_gemm(
        a,
        packed,
        scales,
        locks,
        group_size=128,
        size_n=n,
        size_k=k,
        config=MarlinConfig(16, 64, 2, 4, 2),
    )
    assert int(locks[0]) == 1000 and int(locks[1:].abs().sum()) == 0


def test_bad_inputs_raise(device: torch.device) -> None:
    m, n, k = 2, 64, 256
    a, packed, scales, _ = _problem(m, n, k, 128, torch.bfloat16, device)
    locks = _workspace(device)
    gemm = functools.partial(marlin_gemm, group_size=128, size_n=n, size_k=k)
    with pytest.raises(ValueError, match="a:"):
        gemm(a.float(), packed, scales, locks)
    with pytest.raises(ValueError, match="a:"):
        gemm(a[:, :128], packed, scales, locks)
    with pytest.raises(ValueError, match="size_k"):
        marlin_gemm(
            a[:, :200], packed, scales, locks, group_size=128, size_n=n, size_k=200
        )
    with pytest.raises(ValueError, match="group_size"):
        marlin_gemm(a, packed, scales, locks, group_size=96, size_n=n, size_k=k)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed.to(torch.int64), scales, locks)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed[:32], scales, locks)
    with pytest.raises(ValueError, match="scales"):
        gemm(a, packed, scales.half(), locks)
    with pytest.raises(ValueError, match="scales"):
        gemm(a, packed, scales[:1], locks)
    with pytest.raises(ValueError, match="workspace"):
        gemm(a, packed, scales, locks.to(torch.int64))
    with pytest.raises(ValueError, match="workspace"):
        gemm(a, packed, scales, locks[:1])
    with pytest.raises(ValueError, match="out"):
        gemm(a, packed, scales, locks, out=torch.empty_like(a))
    with pytest.raises(ValueError, match="config"):
        gemm(a, packed, scales, locks, config=MarlinConfig(16, 64, 3, 4, 2))


GPU_SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 1000, 4096])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_full_sizes(m: int, shape: tuple[int, int], group_size: int) -> None:
    n, k = shape
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, group_size, torch.bfloat16, dev)
    locks = _workspace(dev)
    out = _poisoned_out(m, n, torch.bfloat16, dev)
    marlin_gemm(
        a, packed, scales, locks, group_size=group_size, size_n=n, size_k=k, out=out
    )
    assert _rel_err(out, ref) < 1e-2
    assert int(locks.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_poisoned_lock_gives_wrong_result() -> None:
    """Counter 1 at launch: slice 1 goes first and slice 0 then overwrites it."""
    m, n, k = 1, 4096, 4096
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, 128, torch.bfloat16, dev)
    locks = _workspace(dev)
    cfg = MarlinConfig(16, 128, 2, 4, 4)
    locks[0] = 1
    out = marlin_gemm(
        a, packed, scales, locks, group_size=128, size_n=n, size_k=k, config=cfg
    )
    assert _rel_err(out[:, :128], ref[:, :128]) > 0.1
    assert int(locks[0]) == 1  # still dirty: the next call would go wrong too
    assert _rel_err(out[:, 128:], ref[:, 128:]) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay() -> None:
    m, n, k = 16, 8192, 8192
    dev = torch.device("cuda")
    a, packed, scales, ref = _problem(m, n, k, 128, torch.bfloat16, dev)
    locks = _workspace(dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.Stream()
    gemm = functools.partial(marlin_gemm, group_size=128, size_n=n, size_k=k, out=out)
    with torch.cuda.stream(stream):
        gemm(a, packed, scales, locks)  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm(a, packed, scales, locks)
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, ref) < 1e-2
    assert int(locks.abs().sum()) == 0


# -- grouped (MoE) GEMM ----------------------------------------------------------


def _weights(
    experts: int,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``[E, N, K // 8]`` weights and ``[E, groups, N]`` scales."""
    packed, scales = [], []
    for _ in range(experts):
        q, s = quantize_weights(torch.randn(n, k, device=device), group_size)
        packed.append(repack_weights(q))
        scales.append(s.to(dtype))
    return torch.stack(packed), torch.stack(scales)


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return offsets.to(device)


def _counts(rows: int, experts: int, gen: torch.Generator) -> list[int]:
    """Rows per expert: about a fifth of the rows left as an invalid tail and,
    with several experts, expert 1 and the last expert empty."""
    valid = rows - rows // 5
    live = [e for e in range(experts) if experts < 3 or e not in (1, experts - 1)]
    counts = [0] * experts
    for e in torch.randint(0, len(live), (valid,), generator=gen).tolist():
        counts[live[e]] += 1
    return counts


def _reference(
    a: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    counts: list[int],
    group_size: int,
) -> torch.Tensor:
    """fp32 ``[valid rows, N]``: each expert's rows times its weights."""
    parts, start = [], 0
    for e, count in enumerate(counts):
        weight = dequantize_weights(packed[e], scales[e], group_size).float()
        parts.append(a[start : start + count].float() @ weight.t())
        start += count
    return torch.cat(parts)


def _check(
    rows: int,
    counts: list[int],
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    config: MarlinConfig | None = None,
    calls: int = 1,
    tolerance: float = 2e-2,
) -> None:
    packed, scales = _weights(len(counts), n, k, group_size, dtype, device)
    offsets = _offsets(counts, device)
    valid = sum(counts)
    a = torch.randn(rows, k, device=device).to(dtype)
    a[valid:] = float("nan")  # never read
    ref = _reference(a, packed, scales, counts, group_size)
    locks = torch.zeros(
        marlin_workspace_numel(device), dtype=torch.int32, device=device
    )
    out = torch.full((rows, n), SENTINEL, dtype=dtype, device=device)
    for _ in range(calls):  # later calls rely on the earlier ones leaving zeros
        out[:valid] = float("nan")
        res = marlin_gemm_grouped(
            a,
            packed,
            scales,
            offsets,
            locks,
            group_size=group_size,
            size_n=n,
            size_k=k,
            out=out,
            config=config,
        )
        assert res is out
        assert int(locks.abs().sum()) == 0
        assert bool((out[valid:] == SENTINEL).all())  # never written
        if valid:
            # bf16 on the interpreter rounds by truncation, and split-K
            # partials pass through the output dtype: a few ulps.
            assert _rel_err(out[:valid], ref) < tolerance


CONFIGS = {
    "auto": None,
    "split1": MarlinConfig(16, 64, 1, 4, 2),
    "split2": MarlinConfig(64, 64, 2, 4, 2),  # bounded grid <= 16 on CPU
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("experts", [1, 3, 5])
@pytest.mark.parametrize("rows", [0, 1, 7, 37])
def test_grouped_matches_reference(
    device: torch.device, rows: int, experts: int, config: str
) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + experts)
    torch.manual_seed(rows * 10 + experts)
    counts = _counts(rows, experts, gen)
    # N = 96 leaves a partial N-tile; the split-2 config keeps to one N-tile
    # so its bounded grid stays resident on the interpreter's 8 "SMs".
    n = 64 if config == "split2" else 96
    _check(rows, counts, n, 256, 128, torch.bfloat16, device, CONFIGS[config])


@pytest.mark.parametrize("group_size", [128, -1])
def test_grouped_fp16_groups_and_repeated_calls(
    device: torch.device, group_size: int
) -> None:
    torch.manual_seed(1)
    # Uneven experts straddling tile edges; the default config splits K here.
    _check(
        20,
        [17, 0, 2],
        64,
        512,
        group_size,
        torch.float16,
        device,
        calls=2,
        tolerance=2e-3,
    )


def test_grouped_all_experts_empty(device: torch.device) -> None:
    _check(6, [0, 0, 0], 64, 256, 128, torch.bfloat16, device, calls=2)


def test_grouped_bad_inputs_raise(device: torch.device) -> None:
    experts, n, k = 2, 64, 256
    packed, scales = _weights(experts, n, k, 128, torch.bfloat16, device)
    offsets = _offsets([1, 2], device)
    a = torch.randn(4, k, device=device).to(torch.bfloat16)
    locks = torch.zeros(
        marlin_workspace_numel(device), dtype=torch.int32, device=device
    )
    gemm = functools.partial(marlin_gemm_grouped, group_size=128, size_n=n, size_k=k)
    with pytest.raises(ValueError, match="a:"):
        gemm(a.float(), packed, scales, offsets, locks)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed[0], scales, offsets, locks)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, packed[:, :32], scales, offsets, locks)
    too_many = packed[:1].expand(MAX_GROUPED_EXPERTS + 1, -1, -1)
    with pytest.raises(ValueError, match="b_packed"):
        gemm(a, too_many, scales, offsets, locks)
    with pytest.raises(ValueError, match="scales"):
        gemm(a, packed, scales[:1], offsets, locks)
    with pytest.raises(ValueError, match="expert_first_token_offset"):
        gemm(a, packed, scales, offsets.int(), locks)
    with pytest.raises(ValueError, match="expert_first_token_offset"):
        gemm(a, packed, scales, offsets[:2], locks)
    with pytest.raises(ValueError, match="workspace"):
        gemm(a, packed, scales, offsets, locks[:1])
    with pytest.raises(ValueError, match="out"):
        gemm(a, packed, scales, offsets, locks, out=torch.empty_like(a))
    with pytest.raises(ValueError, match="config"):
        gemm(a, packed, scales, offsets, locks, config=MarlinConfig(16, 64, 16, 4, 2))


# -- grouped: the Hopper build ----------------------------------------------------

MODULE = "tests.model_executor.kernels.marlin.test_gemm"
M_RANGES = (16, 32, 64, 256, 1024)  # rows per expert: one per tile of _tile_for_m


def compile_kernels() -> None:
    """The grouped kernel built for Hopper with each M range's tiles (run in
    a process of its own by the test below)."""
    for m in M_RANGES:
        block_m, block_n, warps, stages, _ = _tile_for_m(m)
        consts = {
            "NUM_EXPERTS": 128, "BLOCK_E": 128, "GROUP_SIZE": 128,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": TILE_K,
            "SPLIT_K": 1, "IS_BF16": True, "F32_MATH": False,
        }  # fmt: skip
        pointers = {"b_ptr": "*i32", "lock_ptr": "*i32", "offsets_ptr": "*i64"}
        strides = ("stride_am", "stride_bn", "stride_be", "stride_se", "stride_cm")
        aligned = ("N", "K", *strides)
        kernel = _marlin_gemm_grouped_kernel
        ptx = asm_for_sm90(kernel, consts, pointers, aligned, warps, stages)["ptx"]
        wgmma = "wgmma.mma_async" in ptx
        print(COMPILED, json.dumps([block_m, wgmma, wgmmas_serialized(ptx)]))


def test_grouped_kernel_overlaps_its_wgmmas_on_sm90() -> None:
    """At every M range's tiles the Hopper build multiplies on wgmma and
    ptxas overlaps them: while the K loop had a zero-trip path (before
    ``tl.assume``), ptxas serialized those of the 4-warp tiles."""
    builds = compiled_in_own_process(MODULE)
    assert len(builds) == len(M_RANGES)
    for block_m, has_wgmma, serialized in builds:
        assert has_wgmma, block_m
        assert not serialized, block_m


# -- grouped GPU: model sizes ----------------------------------------------------


def _routed_counts(rows: int, experts: int, gen: torch.Generator) -> list[int]:
    """Skewed routing: a few hot experts, some empty ones."""
    weights = torch.rand(experts, generator=gen) ** 4
    weights[:: max(1, experts // 4)] = 0
    ids = torch.multinomial(weights, rows, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=experts).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["default", "triton"])
@pytest.mark.parametrize("rows", [1, 8, 56, 512, 8192])
@pytest.mark.parametrize("experts,n,k", [(8, 1536, 2048), (32, 2048, 768)])
def test_gpu_grouped_model_sizes(
    monkeypatch: pytest.MonkeyPatch, rows: int, experts: int, n: int, k: int, path: str
) -> None:
    """The default path, and the Triton kernel's large-M tiles, which
    Hopper GPUs no longer take by default."""
    if path == "triton":
        monkeypatch.setattr(gemm_module, "HOPPER_MIN_ROWS_PER_EXPERT", 1 << 40)
    gen = torch.Generator().manual_seed(rows + experts)
    counts = _routed_counts(rows - rows // 8, experts, gen)
    _check(rows, counts, n, k, 128, torch.bfloat16, torch.device("cuda"), calls=2)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows,experts,n,k",
    [
        (1, 8, 256, 128),
        (300, 8, 264, 256),
        (2048, 16, 1536, 2048),
        (4096, 128, 2048, 768),
    ],
    ids=str,
)
def test_gpu_grouped_hopper_kernel(
    monkeypatch: pytest.MonkeyPatch,
    rows: int,
    experts: int,
    n: int,
    k: int,
    dtype: torch.dtype,
) -> None:
    """The warp-specialized Hopper kernel (every row count takes it here,
    and each call did): one row, a partial N tile (264), one to sixteen
    groups along K, skewed routing with empty experts, both 16-bit dtypes;
    its weights round as the reference's, so only the output's rounding is
    left."""
    monkeypatch.setattr(gemm_module, "HOPPER_MIN_ROWS_PER_EXPERT", 0)
    launches: list[None] = []
    launch = hopper_plain.launch
    monkeypatch.setattr(
        hopper_plain, "launch", lambda *a, **kw: launches.append(launch(*a, **kw))
    )
    gen = torch.Generator().manual_seed(rows + experts)
    counts = _routed_counts(rows - rows // 8, experts, gen)
    tolerance = 5e-3 if dtype == torch.bfloat16 else 1e-3
    device = torch.device("cuda")
    _check(rows, counts, n, k, 128, dtype, device, calls=2, tolerance=tolerance)
    assert len(launches) == 2


@pytest.mark.gpu
@needs_hopper
def test_gpu_grouped_takes_hopper_where_it_can() -> None:
    """From 40 rows per expert on average, group 128, 16-byte aligned
    operands and a contiguous ``out``; the Triton kernel otherwise."""
    device = torch.device("cuda")
    experts, n, k = 4, 256, 256
    packed, _ = _weights(experts, n, k, 128, torch.bfloat16, device)
    a = torch.randn(40 * experts, k, device=device).to(torch.bfloat16)
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device=device)
    takes = gemm_module._takes_hopper
    assert takes(a, packed, 128, out)
    assert not takes(a[1:], packed, 128, out[1:])  # 39.75 rows per expert
    assert not takes(a, packed, -1, out)  # per-channel scales
    shifted = torch.empty(packed.numel() + 1, dtype=packed.dtype, device=device)
    assert not takes(a, shifted[1:].view(packed.shape), 128, out)  # 4-byte aligned
    assert not takes(a, packed, 128, out.t().contiguous().t())  # strided out


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 2048])  # the Triton and the Hopper kernel
def test_gpu_grouped_cuda_graph_replay_with_new_offsets(rows: int) -> None:
    """The offsets are read on the device: a captured call follows new routing."""
    dev = torch.device("cuda")
    experts, n, k = 16, 1536, 2048
    packed, scales = _weights(experts, n, k, 128, torch.bfloat16, dev)
    a = torch.randn(rows, k, device=dev).to(torch.bfloat16)
    offsets = _offsets([rows // experts] * experts, dev)
    locks = torch.zeros(marlin_workspace_numel(dev), dtype=torch.int32, device=dev)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    gemm = functools.partial(
        marlin_gemm_grouped, group_size=128, size_n=n, size_k=k, out=out
    )
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemm(a, packed, scales, offsets, locks)  # compile outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm(a, packed, scales, offsets, locks)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        counts = _routed_counts(rows, experts, gen)
        offsets.copy_(_offsets(counts, dev))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(a, packed, scales, counts, 128)
        assert _rel_err(out, ref) < 1e-2
        assert int(locks.abs().sum()) == 0
