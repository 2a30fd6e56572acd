"""The uint4 experts of a decode batch, route by route: no sort, no permute,
on the CUDA-core products of :func:`.gemv.dot_rows`.

Two packings of the same uint4 values (``(q - 8) * scale``, groups along K)
are read in place: :class:`MarlinExperts`' (int32 words, nibbles in pair
order, w13 gate rows then up rows, scales [E, groups, N] in the
activations' dtype) and :class:`TritonExpertsW4A8`'s (uint8 pairs read as
words, nibbles in column order, gate and up rows interleaved, fp32 scales
[E, N, K / 128]). Either way the tokens stay 16-bit (w4a16).

At a few tokens each routed expert sees one row, so the sorted path
(permute -> grouped GEMMs -> unpermute) pays launches and 16-row tensor-core
tiles for what is two matrix-vector products per route:

- GEMM1 (:func:`_gated_kernel`): one program per (route, ``BLOCK_N``
  intermediate columns) takes the expert's ``BLOCK_N`` gate rows and the
  matching up rows (w13 holds gate rows, then up rows), multiplies them by
  the token's hidden state and writes ``act(gate, up)`` into row ``route`` of
  ``act`` [T * topk, I].
- GEMM2 with the sum over routes (:func:`_down_sum_kernel`): one program
  per (token, ``BLOCK_N`` output columns) takes those columns' rows of each
  of the token's ``topk`` experts (``topk x BLOCK_N`` weight rows, each with
  its route's ``act`` row), weights each route's products and adds them in
  registers: the output in one pass, in order (deterministic, no atomics,
  no per-route scratch, no separate sum).

:func:`marlin_moe_decode_routed` takes the router's 16-bit logits instead
of ids and weights, both kernels routing the tokens themselves
(:func:`~.common.topk_softmax.top_routes`, as the 16-bit decode kernels
do). A route whose expert id is outside [0, E) or, under ``expert_map``, not
local adds nothing. The grids depend only on the token count: capturable in
a CUDA graph. Both kernels launch with programmatic dependent launch
(:mod:`~.common.pdl`): GEMM2's first weights stream while GEMM1 finishes.
:mod:`.moe_decode_reference` holds the plain-PyTorch oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.activation_quant import (
    ACTIVATIONS,
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.checks import arg_error, check_index, check_rows
from vllm.model_executor.kernels.common.device_info import inline_ptx
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait
from vllm.model_executor.kernels.common.topk_softmax import (
    DecodeRouting,
    check_router_logits,
    route_expert,
    top_routes,
)
from vllm.model_executor.kernels.grouped_gemm.w4a8 import W4_GROUP
from vllm.model_executor.kernels.marlin.config import (
    MAX_DOWN_ROWS,
    MarlinDecodeConfig,
    default_marlin_decode_config,
)
from vllm.model_executor.kernels.marlin.gemv import check_tile, dot_rows
from vllm.model_executor.kernels.marlin.mma_rows import rows_aligned, runs_mma
from vllm.model_executor.kernels.marlin.moe_decode_mma import (
    MmaMoeDecodeConfig,
    default_mma_moe_decode_config,
    launch_mma_moe_decode,
    mma_operands,
)
from vllm.model_executor.kernels.moe_permute.sort import local_expert, route_bucket


@triton.jit(do_not_specialize=["stride_wn", "stride_sn"])
def _gated_kernel(
    x_ptr,
    ids_ptr,
    map_ptr,
    w_ptr,  # int32 [E, 2I, K // 8]
    s_ptr,  # [E, K // GROUP_SIZE, 2I] (Marlin) or [E, 2I, K // GROUP_SIZE] (W4A8)
    act_ptr,
    K,
    inter,
    topk,
    num_experts,
    num_local,
    stride_x,
    stride_ids,
    stride_act,
    stride_we,
    stride_wn,  # K // 8, unspecialized (see dot_rows)
    stride_se,
    stride_sn,  # unspecialized (see dot_rows)
    stride_sg,  # from one group's scales to the next
    logits_ptr,  # ROUTED: [T, num_experts] 16-bit
    stride_logits,
    HAS_MAP: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,  # rows gate 0, up 0, ... (W4A8's w13)
    NIBBLES_IN_ORDER: tl.constexpr,
    MODE: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pdl_wait(PDL)  # the routing (or the router's logits) is the previous kernel's
    route = tl.program_id(0)
    token = route // topk
    if ROUTED:
        chosen = route_expert(
            logits_ptr + token * stride_logits, num_experts, route % topk, BLOCK_E,
            BLOCK_R,
        )  # fmt: skip
        expert = local_expert(
            chosen, route >= 0, map_ptr, num_experts, num_local, HAS_MAP
        )
    else:
        expert = route_bucket(
            ids_ptr, map_ptr, token * stride_ids + route % topk, route >= 0,
            num_experts, num_local, HAS_MAP,
        )  # fmt: skip
    if expert < num_local:
        pair = tl.arange(0, 2 * BLOCK_N)
        # Columns past I repeat the last (not stored).
        cols = tl.minimum(tl.program_id(1) * BLOCK_N + pair % BLOCK_N, inter - 1)
        if GATE_UP_INTERLEAVED:
            rows = 2 * cols + (pair >= BLOCK_N)
        else:
            rows = tl.where(pair < BLOCK_N, cols, inter + cols)  # gate rows, up rows
        expert_64 = expert.to(tl.int64)
        product, _, _, _ = dot_rows(
            w_ptr + expert_64 * stride_we + rows.to(tl.int64) * stride_wn,
            s_ptr + expert_64 * stride_se + rows * stride_sn,
            x_ptr + token * stride_x, 0, 1, K, stride_sg,
            GROUP_SIZE, 1, 2 * BLOCK_N, BLOCK_K, EVEN_K, ASM, False,
            NIBBLES_IN_ORDER=NIBBLES_IN_ORDER,
        )  # fmt: skip
        gate, up = tl.split(tl.reshape(product, (2, BLOCK_N)).T)
        act = gated_act(gate, up, MODE, ALPHA, LIMIT)
        cols_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(
            act_ptr + route * stride_act + cols_out,
            act.to(act_ptr.dtype.element_ty),
            mask=cols_out < inter,
        )


@triton.jit(do_not_specialize=["stride_wn", "stride_sn"])
def _down_sum_kernel(
    act_ptr,
    ids_ptr,
    map_ptr,
    topk_weights_ptr,
    w_ptr,  # int32 [E, H, I // 8]
    s_ptr,  # [E, I // GROUP_SIZE, H] (Marlin) or [E, H, I // GROUP_SIZE] (W4A8)
    out_ptr,
    inter,
    hidden,
    topk,
    num_experts,
    num_local,
    stride_act,
    stride_ids,
    stride_weights,
    stride_out,
    stride_we,
    stride_wn,  # I // 8, unspecialized (see dot_rows)
    stride_se,
    stride_sn,  # unspecialized (see dot_rows)
    stride_sg,  # from one group's scales to the next
    logits_ptr,  # ROUTED: [T, num_experts] 16-bit
    stride_logits,
    HAS_MAP: tl.constexpr,
    NIBBLES_IN_ORDER: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK: tl.constexpr,  # topk rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
    ROUTED: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Weight row r of the program: the token's route r // BLOCK_N, output
    # column r % BLOCK_N. The routing is two launches back (readable before
    # the wait, see pdl); act is the previous kernel's: dot_rows waits
    # before reading it.
    token = tl.program_id(0)
    r = tl.arange(0, TOPK * BLOCK_N)
    slot = r // BLOCK_N
    cols = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    if ROUTED:
        # The token's routes, then each spread over its BLOCK_N rows.
        ids, weights = top_routes(
            logits_ptr + token * stride_logits, num_experts, topk, RENORMALIZE,
            True, BLOCK_E, TOPK,
        )  # fmt: skip
        ids = tl.reshape(
            tl.broadcast_to(ids[:, None], (TOPK, BLOCK_N)), (TOPK * BLOCK_N,)
        )
        route_weights = tl.reshape(
            tl.broadcast_to(weights[:, None], (TOPK, BLOCK_N)), (TOPK * BLOCK_N,)
        )
        expert = local_expert(
            ids, slot < topk, map_ptr, num_experts, num_local, HAS_MAP
        )
    else:
        expert = route_bucket(
            ids_ptr, map_ptr, token * stride_ids + slot, slot < topk, num_experts,
            num_local, HAS_MAP,
        )  # fmt: skip
    local = expert < num_local
    # Rows of routes without a local expert read expert 0's rows (one copy
    # for all of them: same addresses) and are dropped below; columns past
    # H repeat the last.
    expert_64 = tl.where(local, expert, 0).to(tl.int64)
    w_rows = tl.minimum(cols, hidden - 1)
    route = token * topk + tl.minimum(slot, topk - 1)
    product, _, _, _ = dot_rows(
        w_ptr + expert_64 * stride_we + w_rows.to(tl.int64) * stride_wn,
        s_ptr + expert_64 * stride_se + w_rows * stride_sn,
        act_ptr + route * stride_act, 0, 1, inter, stride_sg,
        GROUP_SIZE, 1, TOPK * BLOCK_N, BLOCK_K, EVEN_K, ASM, PDL, X_PER_ROW=True,
        NIBBLES_IN_ORDER=NIBBLES_IN_ORDER,
    )  # fmt: skip
    if ROUTED:
        weight = route_weights
    else:
        weight = tl.load(topk_weights_ptr + token * stride_weights + slot, mask=local)
    # A select, not a product: act rows of routes without an expert are
    # never written (they may hold anything, NaN included).
    weighted = tl.where(local, product * weight, 0.0)
    total = tl.sum(tl.reshape(weighted, (TOPK, BLOCK_N)), axis=0)
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(
        out_ptr + token * stride_out + out_cols,
        total.to(out_ptr.dtype.element_ty),
        mask=out_cols < hidden,
    )


def check_uint4_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    activation: str,
    group_size: int,
) -> None:
    """Raise naming the first of the tokens, the weights in either packing,
    the group size and the activation that does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or not x.shape[1]:
        raise arg_error(
            "x", f"a [T, H > 0] bf16 or fp16 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    (tokens, hidden), device = x.shape, x.device
    check_rows("x", x, tokens, hidden, (x.dtype,), device)
    w4a8 = w13.dtype == torch.uint8
    if (
        w13.dim() != 3
        or w13.dtype not in (torch.int32, torch.uint8)
        or w13.shape[2] * (2 if w4a8 else 8) != hidden
    ):
        raise arg_error(
            "w13", f"int32 [E, 2I, {hidden // 8}] (Marlin) or uint8 [E, 2I, "
            f"{hidden // 2}] (W4A8), got {w13.dtype} {tuple(w13.shape)}",
        )  # fmt: skip
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if not experts or not inter:  # the kernels read expert 0's rows for any route
        raise arg_error(
            "w13", f"at least one expert and one gate/up pair, got {tuple(w13.shape)}"
        )
    if w4a8 and group_size != W4_GROUP:
        raise arg_error("group_size", f"{W4_GROUP} for W4A8 weights, got {group_size}")
    if group_size <= 0 or hidden % group_size or inter % group_size or group_size % 128:
        raise arg_error(
            "group_size", f"a multiple of 128 dividing {hidden} and {inter}, got "
            f"{group_size}",
        )  # fmt: skip
    groups13, groups2 = hidden // group_size, inter // group_size
    for name, t, shape, dtype in (
        (
            ("w13", w13, (experts, 2 * inter, hidden // 2), torch.uint8),
            ("w13_scales", w13_scales, (experts, 2 * inter, groups13), torch.float32),
            ("w2", w2, (experts, hidden, inter // 2), torch.uint8),
            ("w2_scales", w2_scales, (experts, hidden, groups2), torch.float32),
        )
        if w4a8
        else (
            ("w13", w13, (experts, 2 * inter, hidden // 8), torch.int32),
            ("w13_scales", w13_scales, (experts, groups13, 2 * inter), x.dtype),
            ("w2", w2, (experts, hidden, inter // 8), torch.int32),
            ("w2_scales", w2_scales, (experts, groups2, hidden), x.dtype),
        )
    ):
        if t.shape != shape or t.dtype != dtype or t.device != device:
            raise arg_error(
                name, f"{dtype} {list(shape)} on {device}, got {t.dtype} "
                f"{list(t.shape)} on {t.device}",
            )  # fmt: skip
        if not t.is_contiguous():
            raise arg_error(name, "a contiguous tensor")
    for name, t in (("w13", w13), ("w2", w2)):
        offset = t.storage_offset() * t.element_size()
        if offset % 4:  # read as 4-byte words
            raise arg_error(
                name, f"a tensor at a 4-byte boundary, got offset {offset} bytes"
            )
    if activation not in ACTIVATIONS:
        raise arg_error("activation", f"one of {ACTIVATIONS}, got {activation!r}")


def check_decode_args(
    x: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise naming the first argument that does not fit."""
    check_uint4_experts(x, w13, w13_scales, w2, w2_scales, activation, group_size)
    (tokens, hidden), device = x.shape, x.device
    if expert_map is not None:
        check_index("expert_map", expert_map, 1, device)
    check_rows("act", act, tokens * topk, w13.shape[1] // 2, (x.dtype,), device)
    check_rows("out", out, tokens, hidden, (x.dtype,), device)
    if out.shape[0] != tokens:
        raise arg_error("out", f"{tokens} rows (one per token), got {out.shape[0]}")


def check_decode_routing(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> None:
    tokens, device = x.shape[0], x.device
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or not topk_ids.shape[1]:
        raise arg_error(
            "topk_ids", f"[{tokens}, topk > 0], got {tuple(topk_ids.shape)}"
        )
    topk = topk_ids.shape[1]
    check_rows("topk_ids", topk_ids, tokens, topk, (torch.int32, torch.int64), device)
    check_rows("topk_weights", topk_weights, tokens, topk, (torch.float32,), device)


def _num_ids(w13: torch.Tensor, expert_map: torch.Tensor | None) -> int:
    """The expert ids a route may name: global under an expert map."""
    return len(w13) if expert_map is None else len(expert_map)


def _check_config(config: MarlinDecodeConfig, topk: int) -> None:
    check_tile(config.gated_block_n, config.gated_block_k, config.gated_warps, config)
    down_rows = triton.next_power_of_2(topk) * config.down_block_n
    check_tile(down_rows, config.down_block_k, config.down_warps, config)
    if down_rows > MAX_DOWN_ROWS:
        raise ValueError(
            f"config: down_block_n x topk (rounded up to a power of two) must be "
            f"at most {MAX_DOWN_ROWS} weight rows, got {down_rows}: {config}"
        )


def marlin_moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
    config: MarlinDecodeConfig | MmaMoeDecodeConfig | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])`` with
    :class:`MarlinExperts`' weights (int32 w13 [E, 2I, H // 8] gate rows then
    up rows, w2 [E, H, I // 8], scales [E, groups, N] in ``x``'s dtype) or
    :class:`TritonExpertsW4A8`'s (uint8 w13 [E, 2I, H // 2] interleaved, w2
    [E, H, I // 2], fp32 scales [E, N, groups], ``group_size`` 128); ``act``
    [>= T * topk, I] is scratch. Returns ``out``. An
    :class:`~.moe_decode_mma.MmaMoeDecodeConfig` runs the tensor-core kernels,
    the default from 2 tokens on NVIDIA GPUs (sm_80+) where the rows of
    ``x``, ``act`` and the weights are 16-byte aligned."""
    check_decode_routing(x, topk_ids, topk_weights)
    topk = topk_ids.shape[1]
    check_decode_args(x, topk, w13, w13_scales, w2, w2_scales, expert_map, activation,
           group_size, act, out)  # fmt: skip
    routing = DecodeRouting.by_ids(topk_ids, topk_weights)
    return _launch(x, topk, routing, w13, w13_scales, w2, w2_scales, expert_map,
                   activation, group_size, act, out, config)  # fmt: skip


def marlin_moe_decode_routed(
    x: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
    renormalize: bool,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
    config: MarlinDecodeConfig | MmaMoeDecodeConfig | None = None,
) -> torch.Tensor:
    """:func:`marlin_moe_decode` of the softmax top-``topk`` routing of the
    router's ``logits`` [T, E] (16-bit), which both kernels compute
    themselves (:func:`~.common.topk_softmax.top_routes`)."""
    ids_name = "w13" if expert_map is None else "expert_map"
    check_router_logits(
        logits, x.shape[0], topk, _num_ids(w13, expert_map), x.device, ids_name
    )
    check_decode_args(x, topk, w13, w13_scales, w2, w2_scales, expert_map, activation,
           group_size, act, out)  # fmt: skip
    routing = DecodeRouting.from_logits(logits, renormalize)
    return _launch(x, topk, routing, w13, w13_scales, w2, w2_scales, expert_map,
                   activation, group_size, act, out, config)  # fmt: skip


def _launch(
    x: torch.Tensor,
    topk: int,
    routing: DecodeRouting,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
    config: MarlinDecodeConfig | MmaMoeDecodeConfig | None,
) -> torch.Tensor:
    if (
        config is None
        and x.shape[0] >= 2
        and runs_mma(x.device)
        and all(rows_aligned(t) for _, t in mma_operands(x, act, w13, w2))
    ):
        config = default_mma_moe_decode_config(x.shape[0])
    if isinstance(config, MmaMoeDecodeConfig):
        if x.shape[0]:
            launch_mma_moe_decode(
                x, topk, routing, w13, w13_scales, w2, w2_scales, expert_map,
                _num_ids(w13, expert_map), activation, group_size, act, out, config,
            )  # fmt: skip
        return out
    config = config or default_marlin_decode_config()
    _check_config(config, topk)
    tokens, hidden = x.shape
    inter, experts = w13.shape[1] // 2, w13.shape[0]
    if tokens == 0:
        return out
    ids, weights, logits = routing.ids, routing.weights, routing.logits
    num_ids = _num_ids(w13, expert_map)
    map_arg = expert_map if expert_map is not None else ids
    routes, block_r = tokens * topk, triton.next_power_of_2(topk)
    block_e = triton.next_power_of_2(num_ids)
    launch_pdl, asm = pdl(x.device), inline_ptx(x.device, _gated_kernel)
    w4a8 = w13.dtype == torch.uint8
    # Scales per (row, group): [E, groups, N] (Marlin) or [E, N, groups] (W4A8).
    row_dim, group_dim = (1, 2) if w4a8 else (2, 1)
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # packed words
    _gated_kernel[(routes, triton.cdiv(inter, config.gated_block_n))](
        x, ids, map_arg, w13, w13_scales, act, hidden, inter, topk, num_ids,
        experts, x.stride(0), ids.stride(0), act.stride(0), w13.stride(0),
        w13.stride(1), w13_scales.stride(0), w13_scales.stride(row_dim),
        w13_scales.stride(group_dim), logits, logits.stride(0),
        HAS_MAP=expert_map is not None,
        GATE_UP_INTERLEAVED=w4a8, NIBBLES_IN_ORDER=w4a8, MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT, GROUP_SIZE=group_size,
        BLOCK_N=config.gated_block_n,
        BLOCK_K=config.gated_block_k, EVEN_K=hidden % config.gated_block_k == 0,
        ASM=asm, PDL=launch_pdl, ROUTED=routing.routed, BLOCK_E=block_e,
        BLOCK_R=block_r, num_warps=config.gated_warps, launch_pdl=launch_pdl,
    )  # fmt: skip
    _down_sum_kernel[(tokens, triton.cdiv(hidden, config.down_block_n))](
        act, ids, map_arg, weights, w2, w2_scales, out, inter, hidden,
        topk, num_ids, experts, act.stride(0), ids.stride(0),
        weights.stride(0), out.stride(0), w2.stride(0), w2.stride(1),
        w2_scales.stride(0), w2_scales.stride(row_dim), w2_scales.stride(group_dim),
        logits, logits.stride(0),
        HAS_MAP=expert_map is not None, NIBBLES_IN_ORDER=w4a8, GROUP_SIZE=group_size,
        TOPK=block_r, BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, EVEN_K=inter % config.down_block_k == 0,
        ASM=asm, PDL=launch_pdl, ROUTED=routing.routed, RENORMALIZE=routing.renormalize,
        BLOCK_E=block_e, num_warps=config.down_warps, launch_pdl=launch_pdl,
    )  # fmt: skip
    return out
