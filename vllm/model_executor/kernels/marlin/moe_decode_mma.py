"""The uint4 experts of a decode batch on the tensor cores: the two kernels
of :mod:`.moe_decode` with the K loop of :func:`.mma_rows.mma_rows`
(``mma.sync`` on weights unpacked into each lane's fragment) instead of the
CUDA-core products. Both packings :mod:`.moe_decode` reads (MarlinExperts';
TritonExpertsW4A8's, its activations paired to its nibbles' column order),
routing by ids or from the router's logits (each kernel routes the tokens
itself, as :mod:`.moe_decode`'s do). :mod:`.moe_decode` takes them by
default from 2 tokens on NVIDIA GPUs (at one token the CUDA-core kernels
are faster: 15.4 against 16.7 us; at 2 tokens 19.5 against 28.3, at 4
28.6 against 51.1, H200).

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

from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.checks import arg_error
from vllm.model_executor.kernels.common.gluon_combine import add, maximum
from vllm.model_executor.kernels.common.pdl import gluon_pdl_wait, pdl
from vllm.model_executor.kernels.common.topk_softmax import (
    ROUTE_ID_MASK,
    ROUTE_TAKEN,
    DecodeRouting,
    route_key_logit,
    route_keys,
)
from vllm.model_executor.kernels.marlin.config import TILE_K
from vllm.model_executor.kernels.marlin.mma_rows import (
    check_warp_tiles,
    mma_rows,
    rows_aligned,
    runs_mma,
    warp_tiles,
)

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


def default_mma_moe_decode_config(tokens: int = 2) -> MmaMoeDecodeConfig:
    """The fastest of 24 on the H200 (``benchmark_moe_decode --sweep``,
    Qwen3-30B-A3B's experts, both packings): at 2 tokens GEMM1 2 tiles over
    4 warps of K, GEMM2 one tile over 8 warps of routes; from 4 tokens 4
    tiles over 2 and 2 tiles a warp over 8."""
    if tokens < 4:
        return MmaMoeDecodeConfig(2, 2, 4, 1, 1, 8)
    return MmaMoeDecodeConfig(4, 2, 2, 2, 2, 8)


@gluon.jit
def _local_expert(route_id, map_ptr, num_ids, num_local, HAS_MAP: gl.constexpr):
    """The local expert of a route's id, or -1: ids outside [0, num_ids)
    and, under the map, remote experts. ``route_id`` int32 or int64 (it is
    compared before narrowing)."""
    valid = (route_id >= 0) & (route_id < num_ids)
    expert = gl.where(valid, route_id, 0).to(gl.int32)
    if HAS_MAP:
        expert = gl.load(map_ptr + expert).to(gl.int32)
    return gl.where(valid & (expert >= 0) & (expert < num_local), expert, -1)


@gluon.jit
def _router_keys(row, num_ids, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """A token's :func:`~.topk_softmax.top_routes` keys and fp32 logits, [1,
    BLOCK_E] in the 2-D ``layout`` whose lanes run along its second
    dimension: every warp holds all experts, so a round's max stays in the
    warp."""
    e = gl.arange(0, BLOCK_E, layout=gl.SliceLayout(0, layout))[None, :]
    x = gl.load(row + e, mask=e < num_ids, other=float("-inf")).to(gl.float32)
    x = gl.where(x == x, x, float("-inf"))
    return route_keys(x, e), x


@gluon.jit
def _routed_id(row, num_ids, slot, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    """The expert id of route ``slot`` of the token's logits at ``row``
    (:func:`~.topk_softmax.route_expert`: ``slot + 1`` rounds)."""
    keys, _ = _router_keys(row, num_ids, BLOCK_E, layout)
    best = gl.reduce(keys, 1, maximum)[:, None]
    for _ in range(slot):
        keys = gl.where(keys == best, ROUTE_TAKEN, keys)
        best = gl.reduce(keys, 1, maximum)[:, None]
    return gl.reduce(
        gl.reduce(ROUTE_ID_MASK - (best & ROUTE_ID_MASK), 1, maximum), 0, maximum
    )


@gluon.jit
def _routes(
    row,
    num_ids,
    topk,
    RENORMALIZE: gl.constexpr,
    BLOCK_E: gl.constexpr,
    BLOCK_R: gl.constexpr,
    layout: gl.constexpr,
):
    """:func:`~.topk_softmax.top_routes` of the token's logits at ``row``:
    ids and weights [1, BLOCK_R] in ``layout`` (as :func:`_router_keys`)."""
    keys, x = _router_keys(row, num_ids, BLOCK_E, layout)
    r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, layout))[None, :]
    ids = gl.zeros_like(r)
    top = gl.full(r.shape, float("-inf"), gl.float32, layout)
    for i in range(topk):
        best = gl.reduce(keys, 1, maximum)[:, None]
        keys = gl.where(keys == best, ROUTE_TAKEN, keys)
        ids = gl.where(r == i, ROUTE_ID_MASK - (best & ROUTE_ID_MASK), ids)
        top = gl.where(r == i, route_key_logit(best), top)
    largest = gl.reduce(x, 1, maximum)[:, None]
    weights = gl.exp(top - largest)  # zero past topk
    if RENORMALIZE:
        weights = weights / gl.reduce(weights, 1, add)[:, None]
    else:
        weights = weights / gl.reduce(gl.exp(x - largest), 1, add)[:, None]
    return ids, weights


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
    logits_ptr,  # ROUTED: [T, num_ids] 16-bit
    stride_logits,
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
    ROUTED: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    layout: gl.constexpr = warp_tiles(K_SPLIT, ROW_TILES, TILES_PER_WARP)
    x_layout: gl.constexpr = gl.SliceLayout(1, layout)
    gluon_pdl_wait(PDL)  # the routing (or the router's logits) is the previous kernel's
    route = gl.program_id(0)
    token = route // topk
    if ROUTED:
        route_id = _routed_id(
            logits_ptr + token * stride_logits, num_ids, route % topk, BLOCK_E,
            x_layout,
        )  # fmt: skip
    else:
        route_id = gl.load(ids_ptr + token * stride_ids + route % topk)
    expert = _local_expert(route_id, map_ptr, num_ids, num_local, HAS_MAP)
    if expert >= 0:
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
            (x_row + t * 16 + gl.zeros_like(ks),), ks + gl.zeros_like(lane),
            K // _TILE_K, stride_sg, K_SPLIT, GROUP_SIZE, FP16, False,
            NIBBLES_IN_ORDER,
        )[0]  # fmt: skip
        gate = gl.reduce(gate, 0, add)
        up = gl.reduce(up, 0, add)
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
    expert,  # [S, 1] each slice's local expert this turn, or -1
    weight,  # [S, 1] its route's weight
    slot,  # [S, 1] its route (past topk: the last, dropped)
    in_range,  # [S, 1] slot < topk
    w_rows_lo,  # [1, R, 32] int32 pointers into expert 0, lane t's first word
    w_rows_hi,
    s_rows_lo,  # [1, R, 32] scale pointers into expert 0
    s_rows_hi,
    t,  # [1, 32] the lanes' t
    token,
    inter,
    topk,
    stride_act,
    stride_we,
    stride_se,
    stride_sg,
    NIBBLES_IN_ORDER: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
):
    """One turn of GEMM2: each slice's weighted sums of rows g and g + 8
    ([S, R, 32] x 2) for its route of the turn."""
    # Routes without a local expert read expert 0's rows and are dropped; a
    # slice past topk repeats route topk - 1 (its rows, likely in cache).
    expert_64 = gl.where(expert >= 0, expert, 0).to(gl.int64)[:, None, :]
    route = token * topk + slot
    act_row = (act_ptr + route * stride_act).to(gl.pointer_type(gl.int32), bitcast=True)
    lo, _, hi, _ = mma_rows(
        w_rows_lo + expert_64 * stride_we, w_rows_hi + expert_64 * stride_we,
        s_rows_lo + expert_64 * stride_se, s_rows_hi + expert_64 * stride_se,
        (act_row + t * 16,), gl.zeros_like(slot + t), inter // _TILE_K, stride_sg, 1,
        GROUP_SIZE, FP16, PDL, NIBBLES_IN_ORDER,
    )[0]  # fmt: skip
    # A select, not a product: act rows of routes without an expert are
    # never written (they may hold anything, NaN included).
    keep = (in_range & (expert >= 0))[:, None, :]
    weight = weight[:, None, :]
    return gl.where(keep, lo * weight, 0.0), gl.where(keep, hi * weight, 0.0)


@gluon.jit
def _turn_routes(
    slot,  # [S, 1] the slices' routes this turn
    ids_ptr,
    weights_ptr,
    map_ptr,
    route_ids,  # ROUTED: [1, BLOCK_R] the token's routes
    route_weights,
    token,
    topk,
    num_ids,
    num_local,
    stride_ids,
    stride_weights,
    HAS_MAP: gl.constexpr,
    ROUTED: gl.constexpr,
):
    """(local expert or -1, weight, clamped slot, slot < topk) of each
    slice's route ``slot``."""
    in_range = slot < topk
    slot = gl.minimum(slot, topk - 1)
    if ROUTED:
        r = gl.arange(0, route_ids.shape[1], layout=gl.SliceLayout(0, slot.type.layout))
        pick = r[None, :] == slot
        route_id = gl.reduce(gl.where(pick, route_ids, 0), 1, add)[:, None]
        weight = gl.reduce(gl.where(pick, route_weights, 0.0), 1, add)[:, None]
    else:
        route_id = gl.load(ids_ptr + token * stride_ids + slot)
        weight = gl.load(weights_ptr + token * stride_weights + slot)
    expert = _local_expert(route_id, map_ptr, num_ids, num_local, HAS_MAP)
    return expert, weight, slot, in_range


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
    logits_ptr,  # ROUTED: [T, num_ids] 16-bit
    stride_logits,
    HAS_MAP: gl.constexpr,
    NIBBLES_IN_ORDER: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    ROW_TILES: gl.constexpr,
    TILES_PER_WARP: gl.constexpr,
    ROUTE_SPLIT: gl.constexpr,
    FP16: gl.constexpr,
    PDL: gl.constexpr,
    ROUTED: gl.constexpr,
    RENORMALIZE: gl.constexpr,
    BLOCK_E: gl.constexpr,
    BLOCK_R: gl.constexpr,  # topk rounded up to a power of two
):
    token = gl.program_id(0)
    layout: gl.constexpr = warp_tiles(ROUTE_SPLIT, ROW_TILES, TILES_PER_WARP)
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
    # The routing is two launches back: read before the PDL wait (pdl.py).
    route_ids = gl.zeros([1, BLOCK_R], gl.int32, x_layout)
    route_weights = gl.zeros([1, BLOCK_R], gl.float32, x_layout)
    if ROUTED:
        route_ids, route_weights = _routes(
            logits_ptr + token * stride_logits, num_ids, topk, RENORMALIZE, BLOCK_E,
            BLOCK_R, x_layout,
        )  # fmt: skip
    expert, weight, slot, in_range = _turn_routes(
        rs, ids_ptr, weights_ptr, map_ptr, route_ids, route_weights, token, topk,
        num_ids, num_local, stride_ids, stride_weights, HAS_MAP, ROUTED,
    )  # fmt: skip
    total_lo, total_hi = _route_sums(
        act_ptr, expert, weight, slot, in_range, w_lo, w_hi, s_lo, s_hi, t, token,
        inter, topk, stride_act, stride_we, stride_se, stride_sg, NIBBLES_IN_ORDER,
        GROUP_SIZE, FP16, PDL,
    )  # fmt: skip
    for turn in range(1, gl.cdiv(topk, ROUTE_SPLIT)):
        expert, weight, slot, in_range = _turn_routes(
            rs + turn * ROUTE_SPLIT, ids_ptr, weights_ptr, map_ptr, route_ids,
            route_weights, token, topk, num_ids, num_local, stride_ids,
            stride_weights, HAS_MAP, ROUTED,
        )  # fmt: skip
        lo, hi = _route_sums(
            act_ptr, expert, weight, slot, in_range, w_lo, w_hi, s_lo, s_hi, t,
            token, inter, topk, stride_act, stride_we, stride_se, stride_sg,
            NIBBLES_IN_ORDER, GROUP_SIZE, FP16, False,
        )  # fmt: skip
        total_lo += lo
        total_hi += hi
    out_lo = gl.reduce(total_lo, 0, add)
    out_hi = gl.reduce(total_hi, 0, add)
    out_layout: gl.constexpr = gl.SliceLayout(0, layout)
    lane2 = gl.arange(0, 32, layout=gl.SliceLayout(0, out_layout))[None, :]
    rt2 = gl.arange(0, ROW_TILES, layout=gl.SliceLayout(1, out_layout))[:, None]
    cols = gl.program_id(1) * (16 * ROW_TILES) + rt2 * 16 + lane2 // 4
    dtype = out_ptr.dtype.element_ty
    first = lane2 % 4 == 0  # lanes t hold equal columns
    out_row = out_ptr + token * stride_out
    gl.store(out_row + cols, out_lo.to(dtype), mask=first & (cols < hidden))
    gl.store(out_row + cols + 8, out_hi.to(dtype), mask=first & (cols + 8 < hidden))


def mma_operands(
    x: torch.Tensor, act: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[tuple[str, torch.Tensor], ...]:
    """The tensors whose rows the kernels read in 16-byte runs."""
    return (("x", x), ("act", act), ("w13", w13), ("w2", w2))


def launch_mma_moe_decode(
    x: torch.Tensor,
    topk: int,
    routing: DecodeRouting,
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
    dtypes, the routing, the group size a multiple of 128 dividing H and
    I)."""
    for names in (
        ("gated_row_tiles", "gated_tiles_per_warp", "gated_k_split"),
        ("down_row_tiles", "down_tiles_per_warp", "down_route_split"),
    ):
        check_warp_tiles(config, names)
    for name, t in mma_operands(x, act, w13, w2):
        if not rows_aligned(t):
            raise arg_error(
                name, f"16-byte aligned rows for an MmaMoeDecodeConfig (data "
                f"pointer and row stride), got stride {t.stride()} at "
                f"{t.data_ptr():#x}",
            )  # fmt: skip
    if not runs_mma(x.device):
        raise ValueError(
            "config: an MmaMoeDecodeConfig runs compiled on NVIDIA GPUs of "
            f"compute capability 8.0 or later (mma.sync), not on {x.device}"
        )
    tokens, hidden = x.shape
    inter, experts = w13.shape[1] // 2, w13.shape[0]
    ids, weights, logits = routing.ids, routing.weights, routing.logits
    map_arg = expert_map if expert_map is not None else ids
    launch_pdl, fp16 = pdl(x.device), x.dtype == torch.float16
    w4a8 = w13.dtype == torch.uint8
    # Scales per (row, group): [E, groups, N] (Marlin) or [E, N, groups] (W4A8).
    row_dim, group_dim = (1, 2) if w4a8 else (2, 1)
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # packed words
    # Only a routing kernel depends on these: 1 otherwise (no recompiles).
    routed = routing.routed
    block_e = triton.next_power_of_2(num_ids) if routed else 1
    block_r = triton.next_power_of_2(topk) if routed else 1
    grid1 = (tokens * topk, triton.cdiv(inter, 8 * config.gated_row_tiles))
    _gated_mma_kernel[grid1](
        x, ids, map_arg, w13, w13_scales, act, hidden, inter, topk, num_ids,
        experts, x.stride(0), ids.stride(0), act.stride(0), w13.stride(0),
        w13.stride(1), w13_scales.stride(0), w13_scales.stride(row_dim),
        w13_scales.stride(group_dim), logits, logits.stride(0),
        HAS_MAP=expert_map is not None, GATE_UP_INTERLEAVED=w4a8,
        NIBBLES_IN_ORDER=w4a8, MODE=MODES[activation], ALPHA=SWIGLU_ALPHA,
        LIMIT=SWIGLU_LIMIT, GROUP_SIZE=group_size, ROW_TILES=config.gated_row_tiles,
        TILES_PER_WARP=config.gated_tiles_per_warp, K_SPLIT=config.gated_k_split,
        FP16=fp16, PDL=launch_pdl, ROUTED=routed, BLOCK_E=block_e,
        num_warps=config.gated_row_tiles // config.gated_tiles_per_warp
        * config.gated_k_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
    grid2 = (tokens, triton.cdiv(hidden, 16 * config.down_row_tiles))
    _down_sum_mma_kernel[grid2](
        act, ids, map_arg, weights, w2, w2_scales, out, inter, hidden, topk,
        num_ids, experts, act.stride(0), ids.stride(0), weights.stride(0),
        out.stride(0), w2.stride(0), w2.stride(1), w2_scales.stride(0),
        w2_scales.stride(row_dim), w2_scales.stride(group_dim), logits,
        logits.stride(0), HAS_MAP=expert_map is not None, NIBBLES_IN_ORDER=w4a8,
        GROUP_SIZE=group_size, ROW_TILES=config.down_row_tiles,
        TILES_PER_WARP=config.down_tiles_per_warp,
        ROUTE_SPLIT=config.down_route_split, FP16=fp16, PDL=launch_pdl,
        ROUTED=routed, RENORMALIZE=routed and routing.renormalize, BLOCK_E=block_e,
        BLOCK_R=block_r,
        num_warps=config.down_row_tiles // config.down_tiles_per_warp
        * config.down_route_split,
        launch_pdl=launch_pdl,
    )  # fmt: skip
