"""The uint4 experts of a decode batch on the tensor cores: the two kernels
of :mod:`.moe_decode` with the K loop of :func:`.gemv_mma.mma_rows`
(``mma.sync`` on weights unpacked into each lane's fragment) instead of the
CUDA-core products. Both packings :mod:`.moe_decode` reads (MarlinExperts';
TritonExpertsW4A8's, its activations paired to its nibbles' column order),
routing by ids; opt-in through an :class:`MmaMoeDecodeConfig` until
measured.

At decode each route multiplies one row (its token's hidden state, or its
activation row), so every lane of a warp loads the same A row: the MMA's 8
columns are equal, and lanes ``t = 0`` store.

- GEMM1 (:func:`_gated_mma_kernel`): one program per (route, ``8 x
  ROW_TILES`` intermediate columns). A 16-row tile pairs columns: rows ``g``
  are gate rows, rows ``g + 8`` the matching up rows (after all gate rows,
  or interleaved with them), so a lane holds both halves of its column and
  applies the activation in registers. The warps
  split K; the routing is the previous kernel's, read after the PDL wait.
- GEMM2 with the sum over routes (:func:`_down_sum_mma_kernel`): one
  program per (token, ``16 x ROW_TILES`` output columns); its
  ``ROUTE_SPLIT`` warp slices take the token's routes in turn, each route's
  sum weighted in registers, and the slices meet in one reduction. The
  routing is two launches back (readable before the wait, :mod:`~.pdl`):
  the first route's weights stream while GEMM1 finishes.

A route whose id is outside [0, E) or, under ``expert_map``, not local adds
nothing and its ``act`` row is never written (GEMM2 reads expert 0's rows
for it and drops them with a select).
"""

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from vllm import envs
from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.checks import arg_error
from vllm.model_executor.kernels.common.device_info import capability
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.marlin.config import TILE_K
from vllm.model_executor.kernels.marlin.gemv_mma import check_warp_tiles, mma_rows

_TILE_K = gl.constexpr(TILE_K)


@dataclass(frozen=True)
class MmaMoeDecodeConfig:
    """GEMM1's 16-row tiles (8 gate/up column pairs each) per program, of
    them per warp, and warps over K; GEMM2's 16-column tiles per program,
    of them per warp, and warps over the token's routes."""

    gated_row_tiles: int
    gated_tiles_per_warp: int
    gated_k_split: int
    down_row_tiles: int
    down_tiles_per_warp: int
    down_route_split: int


def default_mma_moe_decode_config() -> MmaMoeDecodeConfig:
    """Not yet measured: GEMM1 2 tiles over 4 warps of K (hidden 2048: 4
    steps a warp), GEMM2 one tile over 8 warps of routes (top-8: one each)."""
    return MmaMoeDecodeConfig(2, 2, 4, 1, 1, 8)


@gluon.jit
def _wait():
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.b32 $0, 0;",
        "=r", [], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _local_expert(ids_ptr, map_ptr, num_ids, num_local, HAS_MAP: gl.constexpr):
    """The local expert of the route whose id ``ids_ptr`` points at, or -1:
    ids outside [0, num_ids) and, under the map, remote experts."""
    route_id = gl.load(ids_ptr)  # int32 or int64: compared before narrowing
    valid = (route_id >= 0) & (route_id < num_ids)
    expert = gl.where(valid, route_id, 0).to(gl.int32)
    if HAS_MAP:
        expert = gl.load(map_ptr + expert).to(gl.int32)
    return gl.where(valid & (expert >= 0) & (expert < num_local), expert, -1)


@gluon.jit
def _gated_mma_kernel(
    x_ptr,
    ids_ptr,
    map_ptr,
    w_ptr,  # int32 [E, 2I, K // 8]: gate rows then up rows, or interleaved
    s_ptr,  # [E, K // GROUP_SIZE, 2I] (Marlin) or [E, 2I, K // GROUP_SIZE] (W4A8)
    act_ptr,
    K,
    inter,
    topk,
    num_ids,
    num_local,
    stride_x,
    stride_ids,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sg,
    HAS_MAP: gl.constexpr,
    GATE_UP_INTERLEAVED: gl.constexpr,  # rows gate 0, up 0, ... (W4A8's w13)
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
    if PDL:
        _wait()  # the routing is the previous kernel's
    route = gl.program_id(0)
    token = route // topk
    expert = _local_expert(
        ids_ptr + token * stride_ids + route % topk, map_ptr, num_ids, num_local,
        HAS_MAP,
    )  # fmt: skip
    if expert >= 0:
        layout: gl.constexpr = gl.BlockedLayout(
            [1, TILES_PER_WARP, 1],
            [1, 1, 32],
            [K_SPLIT, ROW_TILES // TILES_PER_WARP, 1],
            [2, 1, 0],
        )
        x_layout: gl.constexpr = gl.SliceLayout(1, layout)
        ks = gl.arange(0, K_SPLIT, layout=gl.SliceLayout(1, x_layout))[:, None]
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, x_layout))[None, :]
        rt = gl.arange(
            0, ROW_TILES, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout))
        )[None, :, None]
        t = lane % 4
        # Rows g: gate column c, rows g + 8: its up column; columns past I
        # repeat the last (not stored).
        first_col = gl.program_id(1) * (8 * ROW_TILES) + rt * 8
        col = gl.minimum(first_col + (lane // 4)[:, None, :], inter - 1)
        if GATE_UP_INTERLEAVED:
            gate_row = 2 * col
            up_row = gate_row + 1
        else:
            gate_row = col
            up_row = inter + col
        expert_64 = expert.to(gl.int64)
        w_expert = w_ptr + expert_64 * stride_we + t[:, None, :] * 4
        s_expert = s_ptr + expert_64 * stride_se
        x_row = (x_ptr + token * stride_x).to(gl.pointer_type(gl.int32), bitcast=True)
        gate, _, up, _ = mma_rows(
            w_expert + gate_row.to(gl.int64) * stride_wn,
            w_expert + up_row.to(gl.int64) * stride_wn,
            s_expert + gate_row * stride_sn, s_expert + up_row * stride_sn,
            x_row + t * 16 + gl.zeros_like(ks), ks + gl.zeros_like(lane),
            K // _TILE_K, stride_sg, K_SPLIT, GROUP_SIZE, FP16, False,
            NIBBLES_IN_ORDER,
        )  # fmt: skip
        gate = gl.reduce(gate, 0, _add)
        up = gl.reduce(up, 0, _add)
        act = gated_act(gate, up, MODE, ALPHA, LIMIT)
        out_layout: gl.constexpr = gl.SliceLayout(0, layout)
        lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
        rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
        cols = gl.program_id(1) * (8 * ROW_TILES) + rt2 * 8 + lane2 // 4
        gl.store(
            act_ptr + route * stride_act + cols,
            act.to(act_ptr.dtype.element_ty),
            mask=(cols < inter) & (lane2 % 4 == 0),  # lanes t hold equal columns
        )


@gluon.jit
def _route_sums(
    act_ptr,
    ids_ptr,
    map_ptr,
    weights_ptr,
    w_rows_lo,  # [1, R, 32] int32 pointers into expert 0, lane t's first word
    w_rows_hi,
    s_rows_lo,  # [1, R, 32] scale pointers into expert 0
    s_rows_hi,
    t,  # [1, 32] the lanes' t
    slot,  # [S, 1] the slices' routes of this turn
    token,
    inter,
    topk,
    num_ids,
    num_local,
    stride_act,
    stride_ids,
    stride_weights,
    stride_we,
    stride_se,
    stride_sg,
    HAS_MAP: gl.constexpr,
    NIBBLES_IN_ORDER: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    """One turn of GEMM2: each slice's route ``slot`` (past topk: none),
    its weighted sums of rows g and g + 8 ([S, R, 32] x 2)."""
    in_range = slot < topk
    slot = gl.minimum(slot, topk - 1)
    expert = _local_expert(
        ids_ptr + token * stride_ids + slot, map_ptr, num_ids, num_local, HAS_MAP
    )
    local = in_range & (expert >= 0)
    # Routes without a local expert read expert 0's rows and are dropped; a
    # slice past topk repeats route topk - 1 (its rows, likely in cache).
    expert_64 = gl.where(expert >= 0, expert, 0).to(gl.int64)[:, None, :]
    route = token * topk + slot
    act_row = (act_ptr + route * stride_act).to(gl.pointer_type(gl.int32), bitcast=True)
    lo, _, hi, _ = mma_rows(
        w_rows_lo + expert_64 * stride_we, w_rows_hi + expert_64 * stride_we,
        s_rows_lo + expert_64 * stride_se, s_rows_hi + expert_64 * stride_se,
        act_row + t * 16, gl.zeros_like(slot + t), inter // _TILE_K, stride_sg, 1,
        GROUP_SIZE, FP16, PDL, NIBBLES_IN_ORDER,
    )  # fmt: skip
    weight = gl.load(weights_ptr + token * stride_weights + slot)[:, None, :]
    # A select, not a product: act rows of routes without an expert are
    # never written (they may hold anything, NaN included).
    keep = local[:, None, :]
    return gl.where(keep, lo * weight, 0.0), gl.where(keep, hi * weight, 0.0)


@gluon.jit
def _down_sum_mma_kernel(
    act_ptr,
    ids_ptr,
    map_ptr,
    weights_ptr,
    w_ptr,  # int32 [E, H, I // 8]
    s_ptr,  # [E, I // GROUP_SIZE, H] (Marlin) or [E, H, I // GROUP_SIZE] (W4A8)
    out_ptr,
    inter,
    hidden,
    topk,
    num_ids,
    num_local,
    stride_act,
    stride_ids,
    stride_weights,
    stride_out,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sg,
    HAS_MAP: gl.constexpr,
    NIBBLES_IN_ORDER: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    ROW_TILES: gl.constexpr,
    TILES_PER_WARP: gl.constexpr,
    ROUTE_SPLIT: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    token = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout(
        [1, TILES_PER_WARP, 1],
        [1, 1, 32],
        [ROUTE_SPLIT, ROW_TILES // TILES_PER_WARP, 1],
        [2, 1, 0],
    )
    x_layout: gl.constexpr = gl.SliceLayout(1, layout)
    rs = gl.arange(0, ROUTE_SPLIT, layout=gl.SliceLayout(1, x_layout))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, x_layout))[None, :]
    rt = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    rt = rt[None, :, None]
    t = lane % 4
    # Output columns are the weight rows; past H they repeat the last.
    row_lo = gl.program_id(1) * (16 * ROW_TILES) + rt * 16 + (lane // 4)[:, None, :]
    row_hi = gl.minimum(row_lo + 8, hidden - 1)
    row_lo = gl.minimum(row_lo, hidden - 1)
    w_lo = w_ptr + row_lo.to(gl.int64) * stride_wn + t[:, None, :] * 4
    w_hi = w_ptr + row_hi.to(gl.int64) * stride_wn + t[:, None, :] * 4
    s_lo = s_ptr + row_lo * stride_sn
    s_hi = s_ptr + row_hi * stride_sn
    total_lo, total_hi = _route_sums(
        act_ptr, ids_ptr, map_ptr, weights_ptr, w_lo, w_hi, s_lo, s_hi, t, rs,
        token, inter, topk, num_ids, num_local, stride_act, stride_ids,
        stride_weights, stride_we, stride_se, stride_sg, HAS_MAP, NIBBLES_IN_ORDER,
        GROUP_SIZE, FP16, PDL,
    )  # fmt: skip
    for turn in range(1, gl.cdiv(topk, ROUTE_SPLIT)):
        lo, hi = _route_sums(
            act_ptr, ids_ptr, map_ptr, weights_ptr, w_lo, w_hi, s_lo, s_hi, t,
            rs + turn * ROUTE_SPLIT, token, inter, topk, num_ids, num_local,
            stride_act, stride_ids, stride_weights, stride_we, stride_se, stride_sg,
            HAS_MAP, NIBBLES_IN_ORDER, GROUP_SIZE, FP16, False,
        )  # fmt: skip
        total_lo += lo
        total_hi += hi
    out_lo = gl.reduce(total_lo, 0, _add)
    out_hi = gl.reduce(total_hi, 0, _add)
    out_layout: gl.constexpr = gl.SliceLayout(0, layout)
    lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
    rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
    cols = gl.program_id(1) * (16 * ROW_TILES) + rt2 * 16 + lane2 // 4
    dtype = out_ptr.dtype.element_ty
    first = lane2 % 4 == 0  # lanes t hold equal columns
    out_row = out_ptr + token * stride_out
    gl.store(out_row + cols, out_lo.to(dtype), mask=first & (cols < hidden))
    gl.store(out_row + cols + 8, out_hi.to(dtype), mask=first & (cols + 8 < hidden))


@gluon.jit
def _add(a, b):
    return a + b


def _check_aligned(name: str, t: torch.Tensor) -> None:
    """16-byte loads of ``t``'s rows: aligned base and row stride."""
    if t.data_ptr() % 16 or (t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16):
        raise arg_error(
            name, f"16-byte aligned rows for an MmaMoeDecodeConfig (data pointer "
            f"and row stride), got stride {t.stride()} at {t.data_ptr():#x}",
        )  # fmt: skip


def launch_mma_moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_ids: int,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
    config: MmaMoeDecodeConfig,
) -> None:
    """Both kernels over arguments :mod:`.moe_decode` has checked (shapes,
    dtypes, the group size a multiple of 128 dividing H and I)."""
    for names in (
        ("gated_row_tiles", "gated_tiles_per_warp", "gated_k_split"),
        ("down_row_tiles", "down_tiles_per_warp", "down_route_split"),
    ):
        check_warp_tiles(config, names)
    for name, t in (("x", x), ("act", act), ("w13", w13), ("w2", w2)):
        _check_aligned(name, t)
    cap = capability(x.device)
    if torch.version.hip or envs.triton_interpret() or cap is None or cap < (8, 0):
        raise ValueError(
            "config: an MmaMoeDecodeConfig runs compiled on NVIDIA GPUs of "
            f"compute capability 8.0 or later (mma.sync), not on {x.device}"
        )
    tokens, hidden = x.shape
    topk, inter, experts = topk_ids.shape[1], w13.shape[1] // 2, w13.shape[0]
    map_arg = expert_map if expert_map is not None else topk_ids
    launch_pdl, fp16 = pdl(x.device), x.dtype == torch.float16
    w4a8 = w13.dtype == torch.uint8
    # Scales per (row, group): [E, groups, N] (Marlin) or [E, N, groups] (W4A8).
    row_dim, group_dim = (1, 2) if w4a8 else (2, 1)
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # packed words
    grid1 = (tokens * topk, triton.cdiv(inter, 8 * config.gated_row_tiles))
    _gated_mma_kernel[grid1](
        x, topk_ids, map_arg, w13, w13_scales, act, hidden, inter, topk, num_ids,
        experts, x.stride(0), topk_ids.stride(0), act.stride(0), w13.stride(0),
        w13.stride(1), w13_scales.stride(0), w13_scales.stride(row_dim),
        w13_scales.stride(group_dim), HAS_MAP=expert_map is not None,
        GATE_UP_INTERLEAVED=w4a8, NIBBLES_IN_ORDER=w4a8, MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA,
        LIMIT=SWIGLU_LIMIT, GROUP_SIZE=group_size,
        ROW_TILES=config.gated_row_tiles,
        TILES_PER_WARP=config.gated_tiles_per_warp, K_SPLIT=config.gated_k_split,
        FP16=fp16, PDL=launch_pdl,
        num_warps=config.gated_row_tiles // config.gated_tiles_per_warp
        * config.gated_k_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
    grid2 = (tokens, triton.cdiv(hidden, 16 * config.down_row_tiles))
    _down_sum_mma_kernel[grid2](
        act, topk_ids, map_arg, topk_weights, w2, w2_scales, out, inter, hidden,
        topk, num_ids, experts, act.stride(0), topk_ids.stride(0),
        topk_weights.stride(0), out.stride(0), w2.stride(0), w2.stride(1),
        w2_scales.stride(0), w2_scales.stride(row_dim), w2_scales.stride(group_dim),
        HAS_MAP=expert_map is not None, NIBBLES_IN_ORDER=w4a8, GROUP_SIZE=group_size,
        ROW_TILES=config.down_row_tiles, TILES_PER_WARP=config.down_tiles_per_warp,
        ROUTE_SPLIT=config.down_route_split, FP16=fp16, PDL=launch_pdl,
        num_warps=config.down_row_tiles // config.down_tiles_per_warp
        * config.down_route_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
