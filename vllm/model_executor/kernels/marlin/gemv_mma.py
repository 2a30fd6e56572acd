"""The Marlin-style W4A16 GEMM at decode sizes on the tensor cores, with the
weights dequantized in registers (Gluon, NVIDIA sm_80 and later): up to 8
rows of A for the time of one, 16 with a second MMA per weight fragment.

:mod:`.gemv` multiplies on the CUDA cores and is issue-bound (4.2
instructions a weight, docs/marlin.md); here ``mma.sync`` multiplies
weights unpacked in registers, with the K loop of :mod:`.mma_rows` (how
each lane holds its fragment, the unpacking, the step loaded ahead).

A program owns ``16 * ROW_TILES`` weight rows; its ``ROW_TILES x
K_SPLIT`` warps each take 16 of them over every ``K_SPLIT``-th step and sum
across warps at the end; past 8 rows of A a second block of 8 is a second
B operand. Rows past N and M repeat the last ones (not stored). No split-K
across programs: the lock workspace is not touched.
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from vllm.model_executor.kernels.common.gluon_combine import add
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.marlin.config import TILE_K
from vllm.model_executor.kernels.marlin.mma_rows import (
    append,
    check_warp_tiles,
    mma_rows,
    rows_aligned,
    runs_mma,
    warp_tiles,
)

_TILE_K = gl.constexpr(TILE_K)
MMA_GEMV_MAX_M = 16  # two MMAs a weight fragment (n = 8 rows of A each)


@dataclass(frozen=True)
class MmaGemvConfig:
    """16-row weight tiles per program, of them per warp, and warps over
    each tile's K steps."""

    row_tiles: int
    tiles_per_warp: int
    k_split: int

    @property
    def num_warps(self) -> int:
        return self.row_tiles // self.tiles_per_warp * self.k_split


def mma_gemv_applies(m: int, n: int, k: int) -> bool:
    """Whether ``marlin_gemm`` takes this kernel by default (where
    :func:`runs_mma`). Measured on the H200 (benchmarks/RESULTS.md, the
    twenty-fourth and -fifth sessions): at 3-8 rows it beats the tensor-core
    GEMM 1.4-2.8x and the CUDA-core GEMV; at 1-2 rows it wins on large
    weights (8192 x 8192: 13.1 against 16.3 us at one row) and loses on
    small ones (2048 x 4096: 4.8 against 3.9); at 16 rows it wins
    on small ones (2048 x 4096: 7.9 against 16.4 us) and loses from 5120 x
    2048 up (10.1 against 9.1; 8192 x 8192: 32.0 against 22.6)."""
    if m <= 2:
        return n * k >= 1 << 25
    return m <= 8 or (m <= MMA_GEMV_MAX_M and n * k <= 1 << 23)


def default_mma_gemv_config(n: int, m: int = 1) -> MmaGemvConfig:
    """One tile a program and warp, K split over ``65536 / N`` warps (a power
    of two, at most 16; at most 8 for ``m`` past 8 rows, whose two blocks
    double the registers): the fastest or within 5-10% of it on 5120 x
    2048, 2048 x 4096, 8192 x 8192 and 28672 x 4096 at 1-8 rows, and on
    2048 x 4096 at 16 (H200)."""
    most = 16 if m <= 8 else 8
    k_split = 1
    while k_split < most and 2 * k_split * n <= 65536:
        k_split *= 2
    return MmaGemvConfig(1, 1, k_split)


@gluon.jit
def _a_row(a_ptr, row, t, M, stride_am):
    """Int32 pointers to lane t's 64-byte run of A row ``row`` (past M: the
    last row)."""
    a_rows = a_ptr + gl.minimum(row, M - 1) * stride_am
    return a_rows.to(gl.pointer_type(gl.int32), bitcast=True) + t * 16


@gluon.jit
def _mma_gemv_kernel(
    a_ptr,  # [M, K] bf16 / fp16
    b_ptr,  # [N, K // 8] int32, :mod:`.packing`
    s_ptr,  # [K // GROUP_SIZE or 1, N]
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_sg,
    stride_cm,
    GROUP_SIZE: gl.constexpr,  # a multiple of 128, or -1 (per channel)
    ROW_TILES: gl.constexpr,
    TILES_PER_WARP: gl.constexpr,
    K_SPLIT: gl.constexpr,
    A_BLOCKS: gl.constexpr,  # of 8 rows: 1 up to 8 rows of A, else 2
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    layout: gl.constexpr = warp_tiles(K_SPLIT, ROW_TILES, TILES_PER_WARP)
    x_layout: gl.constexpr = gl.SliceLayout(1, layout)
    ks = gl.arange(0, K_SPLIT, layout=gl.SliceLayout(1, x_layout))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, x_layout))[None, :]
    rt = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    rt = rt[None, :, None]
    g = lane // 4
    t = lane % 4

    row_lo = gl.program_id(0) * (16 * ROW_TILES) + rt * 16 + g[:, None, :]
    row_hi = gl.minimum(row_lo + 8, N - 1)  # rows past N repeat the last
    row_lo = gl.minimum(row_lo, N - 1)
    # Rows of A past M repeat the last: they only feed MMA columns not stored.
    x_rows = (_a_row(a_ptr, g, t, M, stride_am),)
    if A_BLOCKS == 2:
        x_rows = append(x_rows, _a_row(a_ptr, g + 8, t, M, stride_am))
    blocks = mma_rows(
        b_ptr + row_lo.to(gl.int64) * stride_bn + t[:, None, :] * 4,
        b_ptr + row_hi.to(gl.int64) * stride_bn + t[:, None, :] * 4,
        s_ptr + row_lo, s_ptr + row_hi, x_rows, ks + gl.zeros_like(lane),
        K // _TILE_K, stride_sg, K_SPLIT, GROUP_SIZE, FP16, PDL,
    )  # fmt: skip

    out_layout: gl.constexpr = gl.SliceLayout(0, layout)
    rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
    lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
    row = gl.program_id(0) * (16 * ROW_TILES) + rt2 * 16 + lane2 // 4
    dtype = c_ptr.dtype.element_ty
    for b in gl.static_range(A_BLOCKS):
        # Sum the K slices; lane (g, t) holds rows g, g + 8 of the block's A
        # rows 2t, 2t + 1.
        acc0, acc1, acc2, acc3 = blocks[b]
        out0 = gl.reduce(acc0, 0, add)
        out1 = gl.reduce(acc1, 0, add)
        out2 = gl.reduce(acc2, 0, add)
        out3 = gl.reduce(acc3, 0, add)
        a_row = 8 * b + 2 * (lane2 % 4)
        c_ptrs = c_ptr + a_row * stride_cm + row
        gl.store(c_ptrs, out0.to(dtype), mask=(row < N) & (a_row < M))
        gl.store(c_ptrs + stride_cm, out1.to(dtype), mask=(row < N) & (a_row + 1 < M))
        gl.store(c_ptrs + 8, out2.to(dtype), mask=(row + 8 < N) & (a_row < M))
        gl.store(
            c_ptrs + stride_cm + 8,
            out3.to(dtype),
            mask=(row + 8 < N) & (a_row + 1 < M),
        )


def launch_mma_gemv(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    group_size: int,
    cfg: MmaGemvConfig,
) -> None:
    """One launch over arguments :func:`~.gemm.marlin_gemm` has checked
    (shapes, dtypes, K and the group size multiples of 128); adds what this
    kernel needs beyond them."""
    m, k = a.shape
    n = out.shape[1]
    if m > MMA_GEMV_MAX_M:
        raise ValueError(
            f"a: at most {MMA_GEMV_MAX_M} rows for an MmaGemvConfig, got {m}"
        )
    check_warp_tiles(cfg, ("row_tiles", "tiles_per_warp", "k_split"))
    # Every thread reads 16-byte runs of A's rows and of the weights.
    for name, t in (("a", a), ("b_packed", b_packed)):
        if not rows_aligned(t):
            raise ValueError(
                f"{name}: an MmaGemvConfig reads 16-byte aligned rows (data "
                f"pointer and row stride), got stride {t.stride()} at "
                f"{t.data_ptr():#x}"
            )
    if not runs_mma(a.device):
        raise ValueError(
            "config: an MmaGemvConfig runs compiled on NVIDIA GPUs of compute "
            f"capability 8.0 or later (mma.sync), not on {a.device}"
        )
    launch_pdl = pdl(a.device)
    _mma_gemv_kernel[(-(-n // (16 * cfg.row_tiles)),)](
        a,
        b_packed,
        scales,
        out,
        m,
        n,
        k,
        a.stride(0),
        b_packed.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        ROW_TILES=cfg.row_tiles,
        TILES_PER_WARP=cfg.tiles_per_warp,
        K_SPLIT=cfg.k_split,
        A_BLOCKS=1 if m <= 8 else 2,
        FP16=a.dtype == torch.float16,
        PDL=launch_pdl,
        num_warps=cfg.num_warps,
        launch_pdl=launch_pdl,
    )
