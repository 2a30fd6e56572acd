"""Launchers of the Marlin-style W4A16 GEMM: argument checks, then one launch.

:func:`marlin_gemm` (dense) and :func:`marlin_gemm_grouped` (MoE, rows
grouped by expert) check every argument before launching, never sync with the
host and allocate nothing but ``out`` when it is not given, so both are
CUDA-graph capturable. Weights come from :mod:`.packing`; the int32 lock
workspace (:func:`marlin_workspace_numel` counters) must be zero at launch and
is zero again after every call. Tile configs default to :mod:`.config`'s
heuristics; an explicit ``config`` is checked against the same bounds.
"""

import torch
import triton

from vllm.model_executor.kernels.common.checks import check_contiguous
from vllm.model_executor.kernels.grouped_gemm import hopper_plain
from vllm.model_executor.kernels.grouped_gemm.dispatch import hopper_supports
from vllm.model_executor.kernels.grouped_gemm.hopper_common import GROUP
from vllm.model_executor.kernels.marlin.config import (
    MAX_GROUPED_EXPERTS,
    PACK,
    TILE_K,
    MarlinConfig,
    default_config,
    grouped_config,
    grouped_m_tiles,
    marlin_workspace_numel,
    resident_programs,
)
from vllm.model_executor.kernels.marlin.gemv import (
    GemvConfig,
    default_gemv_config,
    gemv_applies,
    launch_gemv,
)
from vllm.model_executor.kernels.marlin.gemv_mma import (
    MmaGemvConfig,
    default_mma_gemv_config,
    launch_mma_gemv,
    mma_gemv_applies,
)
from vllm.model_executor.kernels.marlin.kernels import (
    _marlin_gemm_grouped_kernel,
    _marlin_gemm_kernel,
)
from vllm.model_executor.kernels.marlin.mma_rows import rows_aligned, runs_mma


def _check_problem(a: torch.Tensor, group_size: int, size_n: int, size_k: int) -> int:
    """Checks A and the sizes; returns the number of scale groups along K."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if a.dim() != 2 or a.shape[1] != size_k or a.stride(1) != 1:
        raise ValueError(
            f"a: expected [M, {size_k}] with unit stride along K, got "
            f"shape {tuple(a.shape)} stride {a.stride()}"
        )
    if size_k % TILE_K != 0 or size_k <= 0:
        raise ValueError(f"size_k: expected a multiple of {TILE_K}, got {size_k}")
    if size_n <= 0:
        raise ValueError(f"size_n: expected > 0, got {size_n}")
    if group_size != -1 and (group_size % TILE_K != 0 or size_k % group_size != 0):
        raise ValueError(
            f"group_size: expected -1 or a multiple of {TILE_K} dividing "
            f"size_k={size_k}, got {group_size}"
        )
    return 1 if group_size == -1 else size_k // group_size


def _check_workspace(workspace: torch.Tensor, device: torch.device) -> None:
    need = marlin_workspace_numel(device)
    if (
        workspace.dtype != torch.int32
        or workspace.numel() < need
        or workspace.device != device
    ):
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements on {device}, "
            f"got {workspace.dtype} with {workspace.numel()} on {workspace.device}"
        )


def _output(a: torch.Tensor, size_n: int, out: torch.Tensor | None) -> torch.Tensor:
    m = a.shape[0]
    if out is None:
        return torch.empty((m, size_n), dtype=a.dtype, device=a.device)
    if (
        out.shape != (m, size_n)
        or out.dtype != a.dtype
        or out.stride(1) != 1
        or out.device != a.device
    ):
        raise ValueError(
            f"out: expected {a.dtype} [{m}, {size_n}] with unit stride on "
            f"{a.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def _check_split(
    cfg: MarlinConfig,
    tiles: int,
    iters: int,
    workspace: torch.Tensor,
    device: torch.device,
) -> None:
    """All slices of a split grid must be resident and each tile needs a lock."""
    if cfg.split_k < 1 or iters % cfg.split_k != 0:
        raise ValueError(f"config: split_k must divide size_k / {TILE_K}: {cfg}")
    if cfg.split_k > 1 and (
        tiles * cfg.split_k > resident_programs(cfg, device)
        or tiles > workspace.numel()
    ):
        raise ValueError(f"config: split-K grid exceeds resident programs: {cfg}")


def check_marlin_args(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    scales: torch.Tensor,
    workspace: torch.Tensor,
    *,
    group_size: int,
    size_n: int,
    size_k: int,
) -> None:
    """The dense GEMM's argument checks (also run by the CPU reference path)."""
    groups = _check_problem(a, group_size, size_n, size_k)
    check_contiguous(
        "b_packed", b_packed, torch.int32, (size_n, size_k // PACK), a.device
    )
    check_contiguous("scales", scales, a.dtype, (groups, size_n), a.device)
    _check_workspace(workspace, a.device)


def marlin_gemm(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    scales: torch.Tensor,
    workspace: torch.Tensor,
    *,
    group_size: int,
    size_n: int,
    size_k: int,
    out: torch.Tensor | None = None,
    config: MarlinConfig | GemvConfig | MmaGemvConfig | None = None,
) -> torch.Tensor:
    """``a[M, K] @ dequant(b_packed)^T -> [M, N]`` in ``a``'s dtype.

    ``b_packed``: ``[N, K // 8]`` int32 from :func:`repack_weights`; ``scales``:
    ``[K // group_size, N]`` (or ``[1, N]`` with ``group_size == -1``) in
    ``a``'s dtype; ``workspace``: int32 lock counters, all zero, at least
    :func:`marlin_workspace_numel` long. No host sync, no allocation except
    ``out`` when not given. Where :func:`gemv_applies` (or with a
    :class:`GemvConfig`) the CUDA-core kernel of :mod:`.gemv` runs; where
    :func:`~.gemv_mma.mma_gemv_applies` on NVIDIA GPUs (or with an
    :class:`MmaGemvConfig`) the tensor-core one of :mod:`.gemv_mma`, up to 16
    rows (by default only where A's and the weights' rows are 16-byte
    aligned); both leave the workspace alone.
    """
    check_marlin_args(
        a,
        b_packed,
        scales,
        workspace,
        group_size=group_size,
        size_n=size_n,
        size_k=size_k,
    )
    out = _output(a, size_n, out)
    m = a.shape[0]
    if m == 0:
        return out
    if (
        config is None
        and runs_mma(a.device)
        and mma_gemv_applies(m, size_n, size_k)
        and rows_aligned(a)
        and rows_aligned(b_packed)
    ):
        config = default_mma_gemv_config(size_n, m)
    if isinstance(config, MmaGemvConfig):
        launch_mma_gemv(a, b_packed, scales, out, group_size, config)
        return out
    if isinstance(config, GemvConfig) or (config is None and gemv_applies(m)):
        if not isinstance(config, GemvConfig):
            config = default_gemv_config(m, size_k)
        launch_gemv(a, b_packed, scales, out, group_size, config)
        return out

    cfg = config or default_config(m, size_n, size_k, a.device)
    iters = size_k // TILE_K
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(size_n, cfg.block_n)
    _check_split(cfg, tiles, iters, workspace, a.device)

    _marlin_gemm_kernel[(tiles * cfg.split_k,)](
        a,
        b_packed,
        scales,
        out,
        workspace,
        m,
        size_n,
        size_k,
        a.stride(0),
        b_packed.stride(0),
        out.stride(0),
        iters // cfg.split_k,
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=TILE_K,
        SPLIT_K=cfg.split_k,
        GROUP_N=cfg.group_n,
        IS_BF16=a.dtype == torch.bfloat16,
        F32_MATH=a.device.type != "cuda",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# From this many rows per expert (on average) the grouped GEMM runs the
# warp-specialized Hopper kernel (:mod:`~..grouped_gemm.hopper_plain` with
# :mod:`~..grouped_gemm.hopper_uint4`'s unpack), whose 128-row tiles cost the
# same however few rows they hold. The W4A16 layer at qwen3-30b-a3b dims
# (128 experts, top-8; measured on an H100 only, RESULTS.md): 32 rows (512
# tokens) 289.1 us on the Triton kernel against 293.9, 40 rows (640) 345.7
# against 301.5, 64 rows (1024) 534.7 against 340.2.
HOPPER_MIN_ROWS_PER_EXPERT = 40


def _takes_hopper(
    a: torch.Tensor, b_packed: torch.Tensor, group_size: int, out: torch.Tensor
) -> bool:
    """Whether the Hopper kernel runs a grouped call: enough rows, groups
    of its K step pairs, operands TMA boxes read (16-byte aligned), and an
    ``out`` it stores (contiguous, :func:`hopper_supports`)."""
    return (
        a.shape[0] >= HOPPER_MIN_ROWS_PER_EXPERT * b_packed.shape[0]
        and group_size == GROUP.value
        and b_packed.data_ptr() % 16 == 0
        and a.stride(1) == 1
        and a.stride(0) * a.element_size() % 16 == 0
        and a.data_ptr() % 16 == 0
        and out.is_contiguous()
        and hopper_supports(a.device, out.shape[1], out)
    )


def marlin_gemm_grouped(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    scales: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    workspace: torch.Tensor,
    *,
    group_size: int,
    size_n: int,
    size_k: int,
    out: torch.Tensor | None = None,
    config: MarlinConfig | None = None,
) -> torch.Tensor:
    """Per-expert ``a[rows of e] @ dequant(b_packed[e])^T -> [R, N]`` (MoE).

    ``a`` [R, K]: rows grouped by expert, rows ``offsets[e]:offsets[e + 1]``
    belong to expert ``e``; rows at or past ``offsets[-1]`` are never written
    (the Hopper kernel's boxes may read and drop them). ``b_packed`` ``[E, N,
    K // 8]`` int32, ``scales`` ``[E, groups, N]`` in ``a``'s dtype,
    ``expert_first_token_offset`` int64 ``[E + 1]`` on ``a``'s device
    (ascending, ``offsets[-1] <= R``);
    ``workspace`` as in :func:`marlin_gemm`. No host sync (the offsets are
    read inside the kernel), no allocation except ``out`` when not given:
    CUDA-graph capturable. Without a ``config``, Hopper GPUs run the
    warp-specialized kernel where :func:`_takes_hopper` (the same weight
    rounding, fp32 sums in another order, no locks).
    """
    groups = _check_problem(a, group_size, size_n, size_k)
    if b_packed.dim() != 3 or not 0 < b_packed.shape[0] <= MAX_GROUPED_EXPERTS:
        raise ValueError(
            f"b_packed: expected [E, {size_n}, {size_k // PACK}] with 1 <= E <= "
            f"{MAX_GROUPED_EXPERTS}, got {tuple(b_packed.shape)}"
        )
    experts = b_packed.shape[0]
    check_contiguous(
        "b_packed", b_packed, torch.int32, (experts, size_n, size_k // PACK), a.device
    )
    check_contiguous("scales", scales, a.dtype, (experts, groups, size_n), a.device)
    offsets = expert_first_token_offset
    if (
        offsets.dtype != torch.int64
        or offsets.shape != (experts + 1,)
        or offsets.device != a.device
        or not offsets.is_contiguous()
    ):
        raise ValueError(
            f"expert_first_token_offset: expected contiguous int64 [{experts + 1}] on "
            f"{a.device}, got {offsets.dtype} {tuple(offsets.shape)} on "
            f"{offsets.device}"
        )
    _check_workspace(workspace, a.device)
    out = _output(a, size_n, out)
    rows = a.shape[0]
    if rows == 0:
        return out
    if config is None and _takes_hopper(a, b_packed, group_size, out):
        hopper_plain.launch(a, None, b_packed, None, offsets, out, w_steps=scales)
        return out

    cfg = config or grouped_config(rows, experts, size_n, size_k, a.device)
    iters = size_k // TILE_K
    m_tiles = grouped_m_tiles(rows, experts, cfg.block_m)
    tiles = m_tiles * triton.cdiv(size_n, cfg.block_n)
    _check_split(cfg, tiles, iters, workspace, a.device)

    _marlin_gemm_grouped_kernel[(tiles * cfg.split_k,)](
        a,
        b_packed,
        scales,
        out,
        workspace,
        offsets,
        size_n,
        size_k,
        a.stride(0),
        b_packed.stride(1),
        b_packed.stride(0),
        scales.stride(0),
        out.stride(0),
        iters // cfg.split_k,
        m_tiles,
        NUM_EXPERTS=experts,
        BLOCK_E=triton.next_power_of_2(experts),
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=TILE_K,
        SPLIT_K=cfg.split_k,
        IS_BF16=a.dtype == torch.bfloat16,
        F32_MATH=a.device.type != "cuda",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
