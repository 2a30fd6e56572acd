"""The uint4 experts of a small batch on the tensor cores, expert by expert:
the sorted routes of each expert multiplied together, so each routed
expert's weights stream once (Gluon, NVIDIA sm_80 and later).

:mod:`.moe_decode_mma` streams an expert once per route: right at a few
tokens, where routes rarely share an expert, and a multiple of the bytes
from 8-16 tokens on (Qwen3-30B-A3B at 16 tokens: 128 routes over ~82
experts; at 64: 512 over ~128). Here the routes come sorted by local
expert (``moe_prepare_scatter``: ``offsets`` [E + 1] and the destination ->
route index ``permuted_idx``), and a program owns one expert's weight
rows, its routes' rows the MMA's n = 8 A rows in the K loop of
:func:`.mma_rows.mma_rows`; an expert with more routes takes them 8 at a
time (the weights then come from L2; 16 a pass, with a second MMA per
fragment, was a third slower at 64 tokens: more registers for rows most
experts do not have).

- GEMM1 (:func:`_grouped_gated_kernel`): one program per (local expert,
  ``8 x ROW_TILES`` intermediate columns); A rows are the routes' tokens
  (``x[permuted_idx[i] // topk]``), and ``act(gate, up)`` goes to ``act``
  row ``i`` (sorted order), the activation applied in registers as in
  :mod:`.moe_decode_mma` (rows g gate, rows g + 8 the matching up rows).
- GEMM2 (:func:`_grouped_down_kernel`): one program per (local expert,
  ``16 x ROW_TILES`` output columns); A rows are ``act`` rows, written to
  the same rows of ``down`` [R, H]. The caller's ``moe_unpermute`` weights
  and sums each token's rows.

Experts without routes exit at once (after the PDL wait); rows at or past
``offsets[-1]`` (routes without a local expert) are never written. Both
packings of :mod:`.moe_decode` are read in place.
"""

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.checks import (
    arg_error,
    check_contiguous,
    check_rows,
)
from vllm.model_executor.kernels.common.gluon_combine import add
from vllm.model_executor.kernels.common.pdl import gluon_pdl_wait, pdl
from vllm.model_executor.kernels.marlin.config import TILE_K
from vllm.model_executor.kernels.marlin.mma_rows import (
    check_warp_tiles,
    mma_rows,
    rows_aligned,
    runs_mma,
    warp_tiles,
)
from vllm.model_executor.kernels.marlin.moe_decode import check_uint4_experts

_TILE_K = gl.constexpr(TILE_K)


@dataclass(frozen=True)
class GroupedMmaConfig:
    """GEMM1's 16-row tiles (8 gate/up column pairs each) per program, of
    them per warp, and warps over K; the same for GEMM2's 16-column
    tiles."""

    gated_row_tiles: int
    gated_tiles_per_warp: int
    gated_k_split: int
    down_row_tiles: int
    down_tiles_per_warp: int
    down_k_split: int


def default_grouped_mma_config() -> GroupedMmaConfig:
    """Within 2% of the fastest of 9 at 16 and 64 tokens, both packings
    (H100, ``benchmark_moe_decode --sweep``): GEMM1 as
    :mod:`.moe_decode_mma`'s from 4 tokens, GEMM2's K (6 steps at
    Qwen3-30B-A3B's 768) over 2 warps."""
    return GroupedMmaConfig(4, 2, 2, 2, 1, 2)


@gluon.jit
def _route_rows(row, end, ptr, perm_ptr, topk, stride, t, GATHER: gl.constexpr):
    """Int32 pointers to lane t's 64-byte run of A row ``row`` (lane g's of
    the pass; past ``end``: the last row, not stored): the row's token of
    ``ptr`` where ``GATHER``, else ``ptr``'s row itself."""
    row = gl.minimum(row, end - 1)
    if GATHER:
        row = gl.load(perm_ptr + row) // topk
    rows = ptr + row.to(gl.int64) * stride
    return rows.to(gl.pointer_type(gl.int32), bitcast=True) + t * 16


@gluon.jit
def _lanes(layout: gl.constexpr, K_SPLIT: gl.constexpr, ROW_TILES: gl.constexpr):
    """A program's [K slice, row tile, lane] coordinates in ``layout``: the
    slices [K_SPLIT, 1] and lanes [1, 32] (of the A-row layout, without the
    tile dimension) and the row tiles [1, ROW_TILES, 1]."""
    x_layout: gl.constexpr = gl.SliceLayout(1, layout)
    ks = gl.arange(0, K_SPLIT, layout=gl.SliceLayout(1, x_layout))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, x_layout))[None, :]
    rt = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    return ks, lane, rt[None, :, None]


@gluon.jit
def _grouped_gated_kernel(
    x_ptr,
    perm_ptr,  # int32 [R]: sorted row -> route (token * topk + slot)
    offsets_ptr,  # int64 [E + 1]: expert e's sorted rows
    w_ptr,  # int32 [E, 2I, K // 8]: gate rows then up rows, or interleaved
    s_ptr,  # [E, K // GROUP_SIZE, 2I] (Marlin) or [E, 2I, K // GROUP_SIZE] (W4A8)
    act_ptr,  # [R, I], sorted order
    K,
    inter,
    topk,
    stride_x,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sg,
    GATE_UP_INTERLEAVED: gl.constexpr,
    NIBBLES_IN_ORDER: gl.constexpr,
    MODE: gl.constexpr,
    ALPHA: gl.constexpr,
    LIMIT: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    ROW_TILES: gl.constexpr,
    TILES_PER_WARP: gl.constexpr,
    K_SPLIT: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    layout: gl.constexpr = warp_tiles(K_SPLIT, ROW_TILES, TILES_PER_WARP)
    gluon_pdl_wait(PDL)  # the sort is the previous kernel's
    expert = gl.program_id(0)
    start = gl.load(offsets_ptr + expert).to(gl.int32)
    end = gl.load(offsets_ptr + expert + 1).to(gl.int32)
    ks, lane, rt = _lanes(layout, K_SPLIT, ROW_TILES)
    g = lane // 4
    t = lane % 4
    # Rows g: gate column c, rows g + 8: its up column; columns past I
    # repeat the last (not stored).
    first_col = gl.program_id(1) * (8 * ROW_TILES) + rt * 8
    col = gl.minimum(first_col + g[:, None, :], inter - 1)
    if GATE_UP_INTERLEAVED:
        gate_row = 2 * col
        up_row = gate_row + 1
    else:
        gate_row = col
        up_row = inter + col
    expert_64 = expert.to(gl.int64)
    w_expert = w_ptr + expert_64 * stride_we + t[:, None, :] * 4
    s_expert = s_ptr + expert_64 * stride_se
    out_layout: gl.constexpr = gl.SliceLayout(0, layout)
    lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
    rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
    cols = gl.program_id(1) * (8 * ROW_TILES) + rt2 * 8 + lane2 // 4
    dtype = act_ptr.dtype.element_ty
    for first in range(start, end, 8):
        x_rows = _route_rows(first + g, end, x_ptr, perm_ptr, topk, stride_x, t, True)
        # Lane (g, t): gate and up of column g for A rows 2t, 2t + 1.
        gate0, gate1, up0, up1 = mma_rows(
            w_expert + gate_row.to(gl.int64) * stride_wn,
            w_expert + up_row.to(gl.int64) * stride_wn,
            s_expert + gate_row * stride_sn, s_expert + up_row * stride_sn,
            (x_rows,), ks + gl.zeros_like(lane), K // _TILE_K, stride_sg, K_SPLIT,
            GROUP_SIZE, FP16, False, NIBBLES_IN_ORDER,
        )[0]  # fmt: skip
        act0 = gated_act(
            gl.reduce(gate0, 0, add), gl.reduce(up0, 0, add), MODE, ALPHA, LIMIT
        )
        act1 = gated_act(
            gl.reduce(gate1, 0, add), gl.reduce(up1, 0, add), MODE, ALPHA, LIMIT
        )
        row = first + 2 * (lane2 % 4)
        ptrs = act_ptr + row.to(gl.int64) * stride_act + cols
        gl.store(ptrs, act0.to(dtype), mask=(cols < inter) & (row < end))
        gl.store(
            ptrs + stride_act, act1.to(dtype), mask=(cols < inter) & (row + 1 < end)
        )


@gluon.jit
def _grouped_down_kernel(
    act_ptr,  # [R, I], sorted order
    offsets_ptr,
    w_ptr,  # int32 [E, H, I // 8]
    s_ptr,  # [E, I // GROUP_SIZE, H] (Marlin) or [E, H, I // GROUP_SIZE] (W4A8)
    down_ptr,  # [R, H], sorted order
    inter,
    hidden,
    stride_act,
    stride_down,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sg,
    NIBBLES_IN_ORDER: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    ROW_TILES: gl.constexpr,
    TILES_PER_WARP: gl.constexpr,
    K_SPLIT: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    layout: gl.constexpr = warp_tiles(K_SPLIT, ROW_TILES, TILES_PER_WARP)
    # The sort is two launches back: read before the PDL wait (pdl.py); the
    # first pass's first weights load before it too (in mma_rows).
    expert = gl.program_id(0)
    start = gl.load(offsets_ptr + expert).to(gl.int32)
    end = gl.load(offsets_ptr + expert + 1).to(gl.int32)
    if start >= end:
        gluon_pdl_wait(PDL)  # release the next kernel, as every program does
    ks, lane, rt = _lanes(layout, K_SPLIT, ROW_TILES)
    g = lane // 4
    t = lane % 4
    # Output columns are the weight rows; past H they repeat the last.
    row_lo = gl.program_id(1) * (16 * ROW_TILES) + rt * 16 + g[:, None, :]
    row_hi = gl.minimum(row_lo + 8, hidden - 1)
    row_lo = gl.minimum(row_lo, hidden - 1)
    w_expert = w_ptr + expert.to(gl.int64) * stride_we + t[:, None, :] * 4
    s_expert = s_ptr + expert.to(gl.int64) * stride_se
    out_layout: gl.constexpr = gl.SliceLayout(0, layout)
    rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
    lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
    col = gl.program_id(1) * (16 * ROW_TILES) + rt2 * 16 + lane2 // 4
    dtype = down_ptr.dtype.element_ty
    for first in range(start, end, 8):
        a_rows = _route_rows(first + g, end, act_ptr, act_ptr, 1, stride_act, t, False)
        # Lane (g, t) holds columns g, g + 8 of A rows 2t, 2t + 1.
        acc0, acc1, acc2, acc3 = mma_rows(
            w_expert + row_lo.to(gl.int64) * stride_wn,
            w_expert + row_hi.to(gl.int64) * stride_wn,
            s_expert + row_lo * stride_sn, s_expert + row_hi * stride_sn,
            (a_rows,), ks + gl.zeros_like(lane), inter // _TILE_K, stride_sg,
            K_SPLIT, GROUP_SIZE, FP16, PDL, NIBBLES_IN_ORDER,
        )[0]  # fmt: skip
        row = first + 2 * (lane2 % 4)
        ptrs = down_ptr + row.to(gl.int64) * stride_down + col
        lo, hi = col < hidden, col + 8 < hidden
        gl.store(ptrs, gl.reduce(acc0, 0, add).to(dtype), mask=lo & (row < end))
        gl.store(
            ptrs + stride_down,
            gl.reduce(acc1, 0, add).to(dtype),
            mask=lo & (row + 1 < end),
        )
        gl.store(ptrs + 8, gl.reduce(acc2, 0, add).to(dtype), mask=hi & (row < end))
        gl.store(
            ptrs + stride_down + 8,
            gl.reduce(acc3, 0, add).to(dtype),
            mask=hi & (row + 1 < end),
        )


def marlin_moe_grouped(
    x: torch.Tensor,
    permuted_idx: torch.Tensor,
    offsets: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    down: torch.Tensor,
    config: GroupedMmaConfig | None = None,
) -> torch.Tensor:
    """``down[i] = expert_e(x[permuted_idx[i] // topk])`` for each sorted row
    ``i`` of local expert ``e`` (``offsets[e] <= i < offsets[e + 1]``), with
    the weights of :func:`.moe_decode.marlin_moe_decode` (either packing);
    ``act`` [>= R, I] is scratch. Returns ``down`` [>= R, H]; rows from
    ``offsets[-1]`` on are not written."""
    check_uint4_experts(x, w13, w13_scales, w2, w2_scales, activation, group_size)
    config = config or default_grouped_mma_config()
    check_grouped_mma(x, permuted_idx, topk, offsets, act, down, w13, w2, config)
    if permuted_idx.shape[0]:
        launch_grouped_mma(
            x, permuted_idx, offsets, topk, w13, w13_scales, w2, w2_scales,
            activation, group_size, act, down, config,
        )  # fmt: skip
    return down


def check_grouped_mma(
    x: torch.Tensor,
    permuted_idx: torch.Tensor,
    topk: int,
    offsets: torch.Tensor,
    act: torch.Tensor,
    down: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: GroupedMmaConfig,
) -> None:
    """Raise naming what this path needs beyond the uint4 experts' checks
    (:func:`.moe_decode.check_uint4_experts`): ``topk``, the sort's index
    tensors of ``R = T * topk`` routes, ``act`` [>= R, I] and ``down`` [>=
    R, H], 16-byte aligned rows, the config and a GPU that runs it."""
    (tokens, hidden), device = x.shape, x.device
    if topk < 1:
        raise arg_error("topk", f">= 1, got {topk}")
    rows = tokens * topk
    check_contiguous("permuted_idx", permuted_idx, torch.int32, (rows,), device)
    check_contiguous("offsets", offsets, torch.int64, (w13.shape[0] + 1,), device)
    check_rows("act", act, rows, w13.shape[1] // 2, (x.dtype,), device)
    check_rows("down", down, rows, hidden, (x.dtype,), device)
    for name, t in (("x", x), ("act", act), ("down", down), ("w13", w13), ("w2", w2)):
        if not rows_aligned(t):
            raise arg_error(
                name, f"16-byte aligned rows (data pointer and row stride), got "
                f"stride {t.stride()} at {t.data_ptr():#x}",
            )  # fmt: skip
    for names in (
        ("gated_row_tiles", "gated_tiles_per_warp", "gated_k_split"),
        ("down_row_tiles", "down_tiles_per_warp", "down_k_split"),
    ):
        check_warp_tiles(config, names)
    if not runs_mma(device):
        raise arg_error(
            "config", "a GroupedMmaConfig runs compiled on NVIDIA GPUs of compute "
            f"capability 8.0 or later (mma.sync), not on {device}",
        )  # fmt: skip


def launch_grouped_mma(
    x: torch.Tensor,
    permuted_idx: torch.Tensor,
    offsets: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    down: torch.Tensor,
    config: GroupedMmaConfig,
) -> None:
    """Both kernels over checked arguments (:func:`check_grouped_mma`)."""
    hidden = x.shape[1]
    inter, experts = w13.shape[1] // 2, w13.shape[0]
    launch_pdl, fp16 = pdl(x.device), x.dtype == torch.float16
    w4a8 = w13.dtype == torch.uint8
    # Scales per (row, group): [E, groups, N] (Marlin) or [E, N, groups] (W4A8).
    row_dim, group_dim = (1, 2) if w4a8 else (2, 1)
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # packed words
    grid1 = (experts, triton.cdiv(inter, 8 * config.gated_row_tiles))
    _grouped_gated_kernel[grid1](
        x, permuted_idx, offsets, w13, w13_scales, act, hidden, inter, topk,
        x.stride(0), act.stride(0), w13.stride(0), w13.stride(1),
        w13_scales.stride(0), w13_scales.stride(row_dim), w13_scales.stride(group_dim),
        GATE_UP_INTERLEAVED=w4a8, NIBBLES_IN_ORDER=w4a8, MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT, GROUP_SIZE=group_size,
        ROW_TILES=config.gated_row_tiles, TILES_PER_WARP=config.gated_tiles_per_warp,
        K_SPLIT=config.gated_k_split, FP16=fp16,
        PDL=launch_pdl,
        num_warps=config.gated_row_tiles // config.gated_tiles_per_warp
        * config.gated_k_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
    grid2 = (experts, triton.cdiv(hidden, 16 * config.down_row_tiles))
    _grouped_down_kernel[grid2](
        act, offsets, w2, w2_scales, down, inter, hidden, act.stride(0),
        down.stride(0), w2.stride(0), w2.stride(1), w2_scales.stride(0),
        w2_scales.stride(row_dim), w2_scales.stride(group_dim),
        NIBBLES_IN_ORDER=w4a8, GROUP_SIZE=group_size,
        ROW_TILES=config.down_row_tiles, TILES_PER_WARP=config.down_tiles_per_warp,
        K_SPLIT=config.down_k_split, FP16=fp16,
        PDL=launch_pdl,
        num_warps=config.down_row_tiles // config.down_tiles_per_warp
        * config.down_k_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
