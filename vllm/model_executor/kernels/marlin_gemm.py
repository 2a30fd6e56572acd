"""Marlin-style W4A16 GEMM in Triton: ``C[M, N] = A[M, K] @ dequant(B)^T``.

B holds uint4 weights ``q`` in 0..15 with ``dequant = (q - 8) * scale``; scales
are per group of ``group_size`` along K (``[K // group_size, N]``) or per output
channel (``group_size == -1``, ``[1, N]``). A and C are bf16 or fp16.

Layout (offline, :func:`repack_weights`): ``packed[N, K // 8]`` int32, K
contiguous. Word ``c`` of row ``n`` holds ``k = 8c .. 8c + 7``; nibble ``i < 4``
holds ``k = 8c + 2i`` and nibble ``i + 4`` holds ``k = 8c + 2i + 1``, so one
``(word >> 4i) & 0x000F000F`` yields the two halves of a (k, k + 1) pair, which
an OR with the float pattern of 128 (bf16) or 1024 (fp16) turns into the two
16-bit floats ``magic + q`` without any int-to-float conversion.

The kernel computes the transposed product ``C^T = W @ A^T`` (swap A/B): the
dequantized weights are the dot's left operand and M is the dot's N dimension,
so small M pads only to 16. Split-K reduces the K slices of one output tile
into C in slice order under a per-tile int32 lock (Marlin's protocol): slice
``s`` waits for ``lock == s``, adds (slice 0 stores), then sets ``s + 1``; the
last slice brings it back to 0, so every call leaves the lock buffer zero and
no memset is needed between calls.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import check_contiguous
from vllm.model_executor.kernels.common.device_info import num_sms

PACK = 8  # nibbles per int32 word
TILE_K = 128  # K step of the kernel; K and group sizes are multiples of it
MAX_TILES_PER_SM = 4  # lock counters per SM in the workspace
_REGS_PER_SM = 65536
_SMEM_PER_SM = 228 * 1024
MAX_GROUPED_EXPERTS = 1024  # experts per grouped call: one register vector


@triton.jit
def _dequant_mma(
    a_ptr,
    b_ptr,  # this tile's expert (grouped) or the whole matrix (dense)
    s_ptr,
    rm,  # [BLOCK_M] A rows to read (all valid: masked rows clamped)
    offs_n,
    mask_n,
    N,
    stride_am,
    stride_bn,
    k_iter0,  # first K step of this slice
    iters,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr,
    F32_MATH: tl.constexpr,
):
    """fp32 ``acc[BLOCK_N, BLOCK_M] = dequant(B[offs_n, slice]) @ A[rm, slice]^T``."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    # 16-bit float patterns: bf16 0x4300 = 128.0, fp16 0x6400 = 1024.0; both
    # represent magic + q exactly for q < 16.
    magic = 0x43004300 if IS_BF16 else 0x64006400
    bias = 136.0 if IS_BF16 else 1032.0  # magic + 8
    dtype = tl.bfloat16 if IS_BF16 else tl.float16
    ASM_DEQUANT: tl.constexpr = (
        "{ .reg .b32 t; add.rn.bf16x2 t, $1, $2; mul.rn.bf16x2 $0, t, $3; }"
        if IS_BF16
        else "{ .reg .b32 t; add.rn.f16x2 t, $1, $2; mul.rn.f16x2 $0, t, $3; }"
    )
    shifts = (tl.arange(0, 4) * 4)[None, None, :]

    b_ptrs = (
        b_ptr
        + offs_n[:, None] * stride_bn
        + (k_iter0 * (BLOCK_K // 8) + offs_w)[None, :]
    )
    a_ptrs = (
        a_ptr
        + rm.to(tl.int64)[None, :] * stride_am
        + (k_iter0 * BLOCK_K + offs_k)[:, None]
    )
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(iters):
        packed = tl.load(
            b_ptrs, mask=mask_n[:, None], other=0
        )  # [BLOCK_N, BLOCK_K // 8] int32
        a = tl.load(a_ptrs)  # [BLOCK_K, BLOCK_M]
        pairs = ((packed[:, :, None] >> shifts) & 0x000F000F) | magic
        lo = pairs.to(tl.int16).to(dtype, bitcast=True)  # k = 8c + 2i
        hi = (pairs >> 16).to(tl.int16).to(dtype, bitcast=True)  # k = 8c + 2i + 1
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # magic + q
        if GROUP_SIZE > 0:
            group = ((k_iter0 + i) * BLOCK_K) // GROUP_SIZE
            scale = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0)[:, None]
        else:
            scale = tl.full((BLOCK_N, 1), 1.0, dtype)
        if F32_MATH:
            # (q - 8) exact, times the scale: one rounding, as the reference.
            w = ((w.to(tl.float32) - bias) * scale.to(tl.float32)).to(dtype)
            acc = tl.dot(
                w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee"
            )
        else:
            # Triton lowers 16-bit float math through fp32; packed x2
            # instructions do two weights per op (sub is exact, mul rounds once).
            w = tl.inline_asm_elementwise(
                ASM_DEQUANT,
                "=r,r,r,r",
                [
                    w,
                    tl.full((BLOCK_N, BLOCK_K), -bias, dtype),
                    scale.broadcast_to(w.shape),
                ],
                dtype=dtype,
                is_pure=True,
                pack=2,
            )
            acc = tl.dot(w, a, acc)
        b_ptrs += BLOCK_K // 8
        a_ptrs += BLOCK_K
    if GROUP_SIZE < 0:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _store_tile(
    c_ptr,
    lock,  # this output tile's counter
    acc,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    stride_cm,
    pid_k,
    SPLIT_K: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """Write ``acc^T`` to C; split-K slices add into it in order under ``lock``."""
    dtype = tl.bfloat16 if IS_BF16 else tl.float16
    # int64: M x N may exceed 2^31 elements (e.g. a vocabulary-sized N).
    c_ptrs = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    c_mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(dtype), mask=c_mask)
    else:
        # Spin on plain (volatile) loads, which do not queue at the L2 atomic
        # unit like RMWs do, then acquire once. A counter outside 0..SPLIT_K-1
        # cannot come from this protocol (the buffer was not zero at launch):
        # go on rather than spin forever. One inside that range silently
        # reorders the slices: the buffer must be zero at launch.
        seen = tl.load(lock, volatile=True)
        while (seen != pid_k) & (seen >= 0) & (seen < SPLIT_K):
            seen = tl.load(lock, volatile=True)
        tl.atomic_add(lock, 0, sem="acquire")
        # The acquire may be issued by one thread: order every thread's reads
        # of the previous slice's sum after it.
        tl.debug_barrier()
        if pid_k == 0:
            tl.store(c_ptrs, acc.to(dtype), mask=c_mask)
        else:
            # .cg: read the previous slice's sum from L2, not a stale L1 line.
            prev = tl.load(c_ptrs, mask=c_mask, cache_modifier=".cg")
            tl.store(c_ptrs, (acc + prev.to(tl.float32)).to(dtype), mask=c_mask)
        # Every thread's stores happen before the release below.
        tl.debug_barrier()
        # Relative updates (+1, the last slice -(SPLIT_K - 1)) bring a clean
        # counter back to 0 and leave a poisoned one visibly non-zero.
        step = tl.where(pid_k < SPLIT_K - 1, 1, 1 - SPLIT_K)
        tl.atomic_add(lock, step, sem="release")


@triton.jit
def _marlin_gemm_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,  # K // 8, passed so Triton sees its divisibility (16 B loads)
    stride_cm,
    iters_per_slice,
    GROUP_SIZE: tl.constexpr,  # -1: per-channel scales
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_N: tl.constexpr,  # n-tiles per swizzle group (L2 reuse of A)
    IS_BF16: tl.constexpr,
    # The interpreter keeps bf16 as uint16 and does integer math on it (also in
    # tl.dot), so it dequantizes and multiplies in fp32; the GPU dequantizes in
    # 16-bit and feeds the tensor cores 16-bit operands.
    F32_MATH: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # Slice-major order: slice s of a tile has a higher program id than slice
    # s - 1, so a program only waits on lower ids (the interpreter runs ids in
    # order, the GPU schedules lower ids first).
    pid_k = pid // num_tiles
    tile = pid % num_tiles
    tiles_in_group = GROUP_N * num_pid_m
    first_n = (tile // tiles_in_group) * GROUP_N
    group_n = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (tile % tiles_in_group) % group_n
    pid_m = (tile % tiles_in_group) // group_n

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    # Clamp A rows instead of masking them: rows past M are never stored.
    rm = tl.where(mask_m, offs_m, 0)
    acc = _dequant_mma(
        a_ptr,
        b_ptr,
        s_ptr,
        rm,
        offs_n,
        mask_n,
        N,
        stride_am,
        stride_bn,
        pid_k * iters_per_slice,
        iters_per_slice,
        GROUP_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IS_BF16,
        F32_MATH,
    )
    _store_tile(
        c_ptr,
        lock_ptr + tile,
        acc,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        stride_cm,
        pid_k,
        SPLIT_K,
        IS_BF16,
    )


@triton.jit
def _marlin_gemm_grouped_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    lock_ptr,
    offsets_ptr,  # int64 [E + 1]: rows of expert e are offsets[e]:offsets[e + 1]
    N,
    K,
    stride_am,
    stride_bn,  # K // 8
    stride_be,  # N * K // 8
    stride_se,  # groups * N
    stride_cm,
    iters_per_slice,
    num_m_tiles,  # host bound on the M-tiles of all experts together
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # NUM_EXPERTS rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IS_BF16: tl.constexpr,
    F32_MATH: tl.constexpr,  # as in _marlin_gemm_kernel
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m_tiles * num_pid_n
    # Slice-major, as in the dense kernel; the N-tiles of one M-tile are
    # neighbours (same expert, same A rows).
    pid_k = pid // num_tiles
    tile = pid % num_tiles
    m_tile = tile // num_pid_n
    pid_n = tile % num_pid_n

    # The offsets stay on the device: every program finds its expert from the
    # running sum of per-expert M-tile counts (cheap for a few hundred experts).
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < NUM_EXPERTS
    starts = tl.load(offsets_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + offs_e + 1, mask=mask_e, other=0).to(tl.int32)
    tiles_e = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles_e, axis=0)
    expert = tl.sum((tile_ends <= m_tile).to(tl.int32), axis=0)
    if expert >= NUM_EXPERTS:
        return  # past the last expert's tiles (all slices of the tile agree)
    this = offs_e == expert
    first_tile = tl.sum(tl.where(this, tile_ends - tiles_e, 0), axis=0)
    row_start = tl.sum(tl.where(this, starts, 0), axis=0)
    row_start += (m_tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < row_end
    # Clamp to the tile's first row (valid): rows past it belong to another
    # expert or to the unspecified tail and are never stored.
    rm = tl.where(mask_m, offs_m, row_start)
    expert_64 = expert.to(tl.int64)
    acc = _dequant_mma(
        a_ptr,
        b_ptr + expert_64 * stride_be,
        s_ptr + expert_64 * stride_se,
        rm,
        offs_n,
        mask_n,
        N,
        stride_am,
        stride_bn,
        pid_k * iters_per_slice,
        iters_per_slice,
        GROUP_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IS_BF16,
        F32_MATH,
    )
    _store_tile(
        c_ptr,
        lock_ptr + tile,
        acc,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        stride_cm,
        pid_k,
        SPLIT_K,
        IS_BF16,
    )


@dataclass(frozen=True)
class MarlinConfig:
    """Tile shape and launch parameters; K is always stepped by ``TILE_K``.

    (block_k = 64 with 8 warps and block_n = 128 gave wrong results on the
    H200 with Triton 3.6, so the K step is fixed at the verified 128.)
    """

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    group_n: int = 8


def marlin_workspace_numel(device: torch.device | str) -> int:
    """Int32 lock counters the kernel may use at most on ``device``.

    The caller allocates them zeroed once (e.g. ``torch.zeros(n,
    dtype=torch.int32)``); every call leaves them zero again.
    """
    return num_sms(torch.device(device)) * MAX_TILES_PER_SM


def _resident_programs(cfg: MarlinConfig, device: torch.device) -> int:
    """Programs guaranteed resident at once (split-K slices wait on each other)."""
    by_regs = _REGS_PER_SM // (cfg.num_warps * 32 * 255)  # worst-case registers
    stage_bytes = cfg.block_n * TILE_K // 2 + TILE_K * cfg.block_m * 2
    # Pipeline stages plus room for a dequantized tile and the output tile.
    scratch = cfg.block_n * TILE_K * 2 + cfg.block_n * cfg.block_m * 4
    by_smem = _SMEM_PER_SM // (cfg.num_stages * stage_bytes + scratch)
    return num_sms(device) * max(1, min(by_regs, by_smem, MAX_TILES_PER_SM))


def _tile_for_m(m: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages, max split) for M rows.

    The fastest checked tiles per M range on the H200 (NOTES_marlin.md, v2).
    Small M streams weights: narrow tiles, deep pipelines, split-K up to the
    resident-program bound. Every split adds a serial hand-off through the
    lock, so from M > 16 on splits stop at 2.
    """
    if m <= 16:
        return 16, 64, 4, 6, 16
    if m <= 32:
        return 32, 64, 4, 4, 2
    if m <= 64:
        return 64, 64, 4, 4, 2
    if m <= 256:
        return 128, 128, 8, 3, 4
    return 256, 128, 8, 3, 1


def _largest_split(tiles: int, iters: int, max_split: int, limit: int) -> int:
    """Largest power-of-two split dividing ``iters`` with ``tiles x split <= limit``."""
    split = 1
    while (
        split * 2 <= max_split
        and tiles * split * 2 <= limit
        and iters % (split * 2) == 0
    ):
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, k: int, device: torch.device) -> MarlinConfig:
    bm, bn, warps, stages, max_split = _tile_for_m(m)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    limit = _resident_programs(MarlinConfig(bm, bn, 1, warps, stages), device)
    split = _largest_split(tiles, k // TILE_K, max_split, limit)
    return MarlinConfig(bm, bn, split, warps, stages)


def _grouped_m_tiles(rows: int, experts: int, block_m: int) -> int:
    """Bound on the M-tiles of ``rows`` rows split among ``experts`` groups.

    sum_e cdiv(rows_e, block_m) <= rows / block_m + (non-empty groups), with at
    most min(experts, rows) groups non-empty.
    """
    return triton.cdiv(rows, block_m) + min(experts, rows)


@functools.lru_cache(maxsize=4096)
def _grouped_config(
    rows: int, experts: int, n: int, k: int, device: torch.device
) -> MarlinConfig:
    """Tiles for the mean rows per non-empty expert (the split is unknown on
    the host); split-K only while the whole bounded grid is resident."""
    bm, bn, warps, stages, max_split = _tile_for_m(
        triton.cdiv(rows, min(experts, rows))
    )
    tiles = _grouped_m_tiles(rows, experts, bm) * triton.cdiv(n, bn)
    # tiles x split <= resident programs <= marlin_workspace_numel: the
    # locks fit any valid workspace.
    limit = _resident_programs(MarlinConfig(bm, bn, 1, warps, stages), device)
    split = _largest_split(tiles, k // TILE_K, max_split, limit)
    return MarlinConfig(bm, bn, split, warps, stages)


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
        tiles * cfg.split_k > _resident_programs(cfg, device)
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
    config: MarlinConfig | None = None,
) -> torch.Tensor:
    """``a[M, K] @ dequant(b_packed)^T -> [M, N]`` in ``a``'s dtype.

    ``b_packed``: ``[N, K // 8]`` int32 from :func:`repack_weights`; ``scales``:
    ``[K // group_size, N]`` (or ``[1, N]`` with ``group_size == -1``) in
    ``a``'s dtype; ``workspace``: int32 lock counters, all zero, at least
    :func:`marlin_workspace_numel` long. No host sync, no allocation except
    ``out`` when not given.
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

    cfg = config or _default_config(m, size_n, size_k, a.device)
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
    belong to expert ``e``; rows at or past ``offsets[-1]`` are neither read
    nor written. ``b_packed`` ``[E, N, K // 8]`` int32, ``scales`` ``[E,
    groups, N]`` in ``a``'s dtype, ``expert_first_token_offset`` int64
    ``[E + 1]`` on ``a``'s device (ascending, ``offsets[-1] <= R``);
    ``workspace`` as in :func:`marlin_gemm`. No host sync (the offsets are
    read inside the kernel), no allocation except ``out`` when not given:
    CUDA-graph capturable.
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

    cfg = config or _grouped_config(rows, experts, size_n, size_k, a.device)
    iters = size_k // TILE_K
    m_tiles = _grouped_m_tiles(rows, experts, cfg.block_m)
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


def quantize_weights(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric uint4 (bias 8) quantization of ``w[N, K]``.

    Returns ``q[N, K]`` uint8 in 0..15 and float32 ``scales[K // group_size, N]``
    (``[1, N]`` for ``group_size == -1``); cast the scales to the activation
    dtype before use.
    """
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g != 0:
        raise ValueError(f"group_size: {group_size} does not divide K={k}")
    wg = w.float().reshape(n, k // g, g)
    scales = wg.abs().amax(dim=-1).clamp_min(1e-8) / 7.0  # [N, groups]
    q = torch.clamp(torch.round(wg / scales[..., None]) + 8, 0, 15)
    return q.reshape(n, k).to(torch.uint8), scales.t().contiguous()


def repack_weights(q: torch.Tensor) -> torch.Tensor:
    """``q[N, K]`` (0..15) -> ``packed[N, K // 8]`` int32 in the kernel's layout."""
    n, k = q.shape
    if k % PACK != 0:
        raise ValueError(f"q: K={k} must be a multiple of {PACK}")
    # Per word: (k0, k1, ..., k7) -> nibbles (k0, k2, k4, k6, k1, k3, k5, k7).
    words = q.to(torch.int64).reshape(n, k // PACK, 4, 2).transpose(-1, -2)
    words = words.reshape(n, k // PACK, PACK)
    shifts = torch.arange(PACK, device=q.device, dtype=torch.int64) * 4
    packed = (words << shifts).sum(dim=-1)
    # Two's-complement wrap into int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_weights(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`repack_weights`: ``[N, K // 8]`` int32 -> ``q[N, K]``."""
    n, kw = packed.shape
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    nib = (packed[..., None] >> shifts) & 0xF  # [N, K//8, 8] in nibble order
    return nib.reshape(n, kw, 2, 4).transpose(-1, -2).reshape(n, kw * PACK)


def dequantize_weights(
    q_or_packed: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference ``(q - 8) * scale`` as ``[N, K]`` in ``scales``' dtype.

    Takes ``q[N, K]`` (uint8) or ``packed[N, K // 8]`` (int32).
    """
    q = unpack_weights(q_or_packed) if q_or_packed.dtype == torch.int32 else q_or_packed
    k = q.shape[1]
    g = k if group_size == -1 else group_size
    s = scales.t().float().repeat_interleave(g, dim=1)  # [N, K]
    return ((q.float() - 8.0) * s).to(scales.dtype)
