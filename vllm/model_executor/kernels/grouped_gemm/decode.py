"""The expert GEMMs of a decode batch, route by route: no sort, no permute.

At a few tokens each routed expert sees one row, so the layer is two skinny
matrix-vector products that only have to stream the routed experts'
weights once. The sorted path (:mod:`.api`) spends launches on the sort and
the unpermute there, and its 64/128-row tiles leave most SMs idle. Here:

- GEMM1 (:func:`_decode_gated_kernel`): one program per (route, BLOCK_N
  gate/up pairs of w13's interleaved rows) writes ``act(x[t] @ w13[e]^T)``
  into row ``t * topk + k`` of ``act`` [T * topk, I].
- GEMM2 and the unpermute (:func:`_decode_down_kernel`): one program per
  (token, BLOCK_N output columns) loads the token's routes' weight tiles
  together and sums ``topk_weights[t, k] * act[t*topk+k] @ w2[e]^T`` over
  them (deterministic, no atomics), writing the output row.

Each program streams its weight rows in 16-byte loads along K; with a few
hundred programs the GPU keeps enough loads in flight to run at the memory
bound. Weights are bf16/fp16 or fp8 with one fp32 scale per output
channel ([E, N]); activations stay in the input dtype (an fp8 layer's
decode runs w8a16: no activation quantization pass); uint4 weights have
their own (``marlin/moe_decode.py``). A route whose expert id is outside
[0, E) or, under ``expert_map``, not local, adds nothing (its ``act`` row
is not written); a token without local routes gets zeros. The grids depend
only on the token count: the launches can be captured in a CUDA graph.
:func:`moe_decode_routed` takes the router's 16-bit logits instead of ids
and weights: GEMM1's programs each find their route's expert
(:func:`~.common.topk_softmax.route_expert`) after the PDL wait, GEMM2's
the token's routes and weights (:func:`~.common.topk_softmax.top_routes`)
before it, so the routing costs no launch of its own.
Both launch with programmatic dependent launch (:mod:`~.common.pdl`):
GEMM2's first weight tiles stream while GEMM1 finishes.

:func:`moe_decode_reference` is the plain-PyTorch oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.activation_quant import (
    ACTIVATIONS,
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.checks import (
    arg_error,
    check_contiguous,
    check_index,
    check_rows,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait
from vllm.model_executor.kernels.common.topk_softmax import (
    DecodeRouting,
    check_router_logits,
    route_expert,
    top_routes,
    top_routes_reference,
)
from vllm.model_executor.kernels.grouped_gemm.layout import deinterleave_gate_up
from vllm.model_executor.kernels.moe_permute.sort import local_expert, route_bucket

# Up to this many tokens the expert layers take these kernels: per-route
# weight reads cost little while few tokens share an expert (top-8 of 128:
# ~7% re-read at 4 tokens); above it the sorted path reads each expert once.
DECODE_MAX_TOKENS = 8


@triton.jit
def _decode_gated_kernel(
    x_ptr,
    ids_ptr,
    map_ptr,
    w_ptr,
    w_scale_ptr,
    act_ptr,
    K,
    inter,
    topk,
    num_experts,
    num_local,
    stride_x,
    stride_ids,
    stride_act,
    logits_ptr,  # ROUTED: [T, num_experts] 16-bit
    stride_logits,
    HAS_MAP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MODE: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pdl_wait(PDL)  # the routing (or the router's logits) is the previous kernel's
    route = tl.program_id(0)
    token = route // topk
    # The route's local expert; num_local for an invalid or remote one.
    if ROUTED:
        chosen = route_expert(
            logits_ptr + token * stride_logits, num_experts, route % topk, BLOCK_E,
            BLOCK_R,
        )  # fmt: skip
        expert = local_expert(
            chosen, route < tl.num_programs(0), map_ptr, num_experts, num_local,
            HAS_MAP,
        )  # fmt: skip
    else:
        expert = route_bucket(
            ids_ptr, map_ptr, token * stride_ids + route % topk,
            route < tl.num_programs(0), num_experts, num_local, HAS_MAP,
        )  # fmt: skip
    if expert < num_local:
        # 2 x BLOCK_N interleaved rows: gate 0, up 0, gate 1, ...
        rows = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        row_ok = rows < 2 * inter
        w_row = expert.to(tl.int64) * 2 * inter + rows
        w_rows = w_ptr + w_row[:, None] * K
        acc = tl.zeros((2 * BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_x + cols, mask=cols < K, other=0.0)
            mask = row_ok[:, None] & (cols < K)[None, :]
            w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        product = tl.sum(acc, axis=1)
        if HAS_SCALE:
            scale_ptrs = w_scale_ptr + expert.to(tl.int64) * 2 * inter + rows
            product *= tl.load(scale_ptrs, mask=row_ok, other=0.0)
        gate, up = tl.split(tl.reshape(product, (BLOCK_N, 2)))
        act = gated_act(gate, up, MODE, ALPHA, LIMIT)
        cols_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(
            act_ptr + route * stride_act + cols_out,
            act.to(act_ptr.dtype.element_ty),
            mask=cols_out < inter,
        )


@triton.jit
def _decode_down_kernel(
    act_ptr,
    ids_ptr,
    map_ptr,
    topk_weights_ptr,
    w_ptr,
    w_scale_ptr,
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
    logits_ptr,  # ROUTED: [T, num_experts] 16-bit
    stride_logits,
    HAS_MAP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    ROUTED: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # All of the token's routes at once: each K step loads BLOCK_R weight
    # tiles together (one round trip, not one per route).
    token = tl.program_id(0)
    k_routes = tl.arange(0, BLOCK_R)
    if ROUTED:
        # The logits are two launches back: complete before this one starts.
        ids, weights = top_routes(
            logits_ptr + token * stride_logits, num_experts, topk, RENORMALIZE,
            True, BLOCK_E, BLOCK_R,
        )  # fmt: skip
        experts = local_expert(
            ids, k_routes < topk, map_ptr, num_experts, num_local, HAS_MAP
        )
        valid = experts < num_local
        weights = tl.where(valid, weights, 0.0)
    else:
        experts = route_bucket(
            ids_ptr, map_ptr, token * stride_ids + k_routes, k_routes < topk,
            num_experts, num_local, HAS_MAP,
        )  # fmt: skip
        valid = experts < num_local
        weights = tl.load(
            topk_weights_ptr + token * stride_weights + k_routes, mask=valid, other=0.0
        )
    routes = token * topk + k_routes
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    # [BLOCK_R, BLOCK_N] rows of the flattened [E * hidden, inter] weights
    w_row = tl.where(valid, experts, 0).to(tl.int64)[:, None] * hidden + rows[None, :]
    tile_ok = valid[:, None, None] & row_ok[None, :, None]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    # Each step loads the next step's weights (masked off past inter): the
    # first tile streams while GEMM1 finishes
    w_rows = w_ptr + w_row[:, :, None] * inter
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(
        w_rows + cols[None, None, :],
        mask=tile_ok & (cols < inter)[None, None, :],
        other=0.0,
    )
    pdl_wait(PDL)  # act is the previous kernel's
    for k in range(0, inter, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        a = tl.load(
            act_ptr + routes[:, None] * stride_act + cols[None, :],
            mask=valid[:, None] & (cols < inter)[None, :],
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
        w = tl.load(
            w_rows + BLOCK_K + cols[None, None, :],
            mask=tile_ok & (cols + BLOCK_K < inter)[None, None, :],
            other=0.0,
        )
    if HAS_SCALE:
        scale_ptrs = (
            w_scale_ptr
            + tl.where(valid, experts, 0).to(tl.int64)[:, None] * hidden
            + rows[None, :]
        )
        acc *= tl.load(scale_ptrs, mask=valid[:, None] & row_ok[None, :], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0)
    tl.store(
        out_ptr + token * stride_out + rows,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok,
    )


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two kernels (GEMM1's block_n counts gate/up pairs)."""

    gated_block_n: int
    gated_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int = 4


def default_decode_config(tokens: int, weight_dtype: torch.dtype) -> DecodeConfig:
    """The fastest checked on the H200 (benchmark_moe_decode --sweep, bf16
    and fp8 weights; K tiles up to 2048, 8 warps and GEMM1 loading a tile
    ahead did not help, benchmarks/RESULTS.md): one token splits both GEMMs
    finest (more programs) and streams GEMM2 in long rows; more tokens have
    programs enough, but fp8 at two still gains from the finer split
    (27.4-28.7 against 29.1-30.6 us in two sweeps; bf16 lost there)."""
    if tokens == 1:
        return DecodeConfig(8, 256, 4, 256)
    if tokens == 2 and weight_dtype == FP8_DTYPE:
        return DecodeConfig(8, 256, 4, 128)
    return DecodeConfig(16, 256, 8, 128)


def _check(
    x: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise naming the first argument that does not fit (messages are built
    only on failure: this runs on every call)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise arg_error(
            "x", f"a [T, K] bfloat16, float16 or float32 tensor, got {x.dtype} "
            f"{tuple(x.shape)}",
        )  # fmt: skip
    (tokens, hidden), device = x.shape, x.device
    check_rows("x", x, tokens, hidden, (x.dtype,), device)
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.dtype not in (x.dtype, FP8_DTYPE):
        raise arg_error(
            "w13", f"[E, 2I, {hidden}] {x.dtype} or fp8 weights, got {w13.dtype} "
            f"{tuple(w13.shape)}",
        )  # fmt: skip
    experts, two_inter = w13.shape[:2]
    inter = two_inter // 2
    check_contiguous("w13", w13, w13.dtype, (experts, two_inter, hidden), device)
    check_contiguous("w2", w2, w13.dtype, (experts, hidden, inter), device)
    scaled = w13.dtype != x.dtype
    for name, scale, shape in (
        ("w13_scale", w13_scale, (experts, two_inter)),
        ("w2_scale", w2_scale, (experts, hidden)),
    ):
        if scale is not None and scaled:
            check_contiguous(name, scale, torch.float32, shape, device)
        elif (scale is None) == scaled:
            got = "None" if scale is None else "a tensor"
            raise arg_error(name, f"fp32 [E, N] for fp8 weights, else None, got {got}")
    if expert_map is not None:
        check_index("expert_map", expert_map, 1, device)
    if activation not in ACTIVATIONS:
        raise arg_error("activation", f"one of {ACTIVATIONS}, got {activation!r}")
    check_rows("act", act, tokens * topk, inter, (x.dtype,), device)
    if out.shape[0] != tokens:
        raise arg_error("out", f"{tokens} rows, got {out.shape[0]}")
    check_rows("out", out, tokens, hidden, (x.dtype,), device)


def _check_routing(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> None:
    tokens, device = x.shape[0], x.device
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise arg_error("topk_ids", f"[{tokens}, topk], got {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    check_rows("topk_ids", topk_ids, tokens, topk, (torch.int32, torch.int64), device)
    if topk_weights.shape[0] != tokens:
        raise arg_error("topk_weights", f"{tokens} rows, got {topk_weights.shape[0]}")
    check_rows("topk_weights", topk_weights, tokens, topk, (torch.float32,), device)


def moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])`` with
    w13 [E, 2I, K] (gate and up rows interleaved) and w2 [E, K, I]; ``act``
    [>= T * topk, I] is the scratch between the two GEMMs. Returns ``out``."""
    _check_routing(x, topk_ids, topk_weights)
    topk = topk_ids.shape[1]
    _check(x, topk, w13, w13_scale, w2, w2_scale, expert_map, activation, act, out)
    routing = DecodeRouting.by_ids(topk_ids, topk_weights)
    return _launch(x, topk, routing, w13, w13_scale, w2, w2_scale, expert_map,
                   activation, act, out, config)  # fmt: skip


def moe_decode_routed(
    x: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
    renormalize: bool,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """:func:`moe_decode` of the softmax top-``topk`` routing of the router's
    ``logits`` [T, E] (16-bit, unit stride over experts), which both
    kernels compute themselves (:func:`~.common.topk_softmax.top_routes`):
    the routing costs no launch and no round trip of ids."""
    check_router_logits(
        logits, x.shape[0], topk, _num_ids(w13, expert_map), x.device,
        "w13" if expert_map is None else "expert_map",
    )  # fmt: skip
    _check(x, topk, w13, w13_scale, w2, w2_scale, expert_map, activation, act, out)
    routing = DecodeRouting.from_logits(logits, renormalize)
    return _launch(x, topk, routing, w13, w13_scale, w2, w2_scale, expert_map,
                   activation, act, out, config)  # fmt: skip


def _launch(
    x: torch.Tensor,
    topk: int,
    routing: DecodeRouting,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
    config: DecodeConfig | None,
) -> torch.Tensor:
    ids, weights, logits = routing.ids, routing.weights, routing.logits
    tokens, hidden = x.shape
    config = config or default_decode_config(tokens, w13.dtype)
    inter, num_ids = w13.shape[1] // 2, _num_ids(w13, expert_map)
    if tokens == 0:
        return out
    map_arg = expert_map if expert_map is not None else ids
    block_r, block_e = triton.next_power_of_2(topk), triton.next_power_of_2(num_ids)
    launch_pdl = pdl(x.device)
    _decode_gated_kernel[(tokens * topk, triton.cdiv(inter, config.gated_block_n))](
        x, ids, map_arg, w13, w13_scale if w13_scale is not None else w13,
        act, hidden, inter, topk, num_ids, w13.shape[0], x.stride(0),
        ids.stride(0), act.stride(0), logits, logits.stride(0),
        HAS_MAP=expert_map is not None,
        HAS_SCALE=w13_scale is not None, MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT,
        BLOCK_N=config.gated_block_n, BLOCK_K=config.gated_block_k,
        PDL=launch_pdl, ROUTED=routing.routed, BLOCK_E=block_e, BLOCK_R=block_r,
        num_warps=config.num_warps, launch_pdl=launch_pdl,
    )  # fmt: skip
    _decode_down_kernel[(tokens, triton.cdiv(hidden, config.down_block_n))](
        act, ids, map_arg, weights, w2,
        w2_scale if w2_scale is not None else w2, out, inter, hidden, topk,
        num_ids, w13.shape[0], act.stride(0), ids.stride(0),
        weights.stride(0), out.stride(0), logits, logits.stride(0),
        HAS_MAP=expert_map is not None,
        HAS_SCALE=w2_scale is not None, BLOCK_R=block_r,
        BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k, PDL=launch_pdl,
        ROUTED=routing.routed, RENORMALIZE=routing.renormalize, BLOCK_E=block_e,
        num_warps=config.num_warps, launch_pdl=launch_pdl,
    )  # fmt: skip
    return out


def _num_ids(w13: torch.Tensor, expert_map: torch.Tensor | None) -> int:
    """The expert ids a route may name: global under an expert map."""
    return len(w13) if expert_map is None else len(expert_map)


def moe_decode_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`moe_decode` in plain PyTorch (fp32 math; ``act`` untouched)."""
    _check_routing(x, topk_ids, topk_weights)
    _check(x, topk_ids.shape[1], w13, w13_scale, w2, w2_scale, expert_map,
           activation, act, out)  # fmt: skip
    gate_up, down = (
        w.float() if scale is None else w.float() * scale[..., None]
        for w, scale in ((w13, w13_scale), (w2, w2_scale))
    )
    gate_up = deinterleave_gate_up(gate_up)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < _num_ids(w13, expert_map))
    if expert_map is not None:
        ids = torch.where(
            valid, expert_map.long()[ids.clamp(0, len(expert_map) - 1)], -1
        )
        valid = ids >= 0
    result = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for t, k in valid.nonzero().tolist():
        e = int(ids[t, k])
        h = gated_act_reference(activation, gate_up[e] @ x[t].float())
        h = h.to(x.dtype).float()  # act is stored in the input dtype
        result[t] += topk_weights[t, k] * (down[e] @ h)
    return out.copy_(result)


def moe_decode_routed_reference(
    x: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
    renormalize: bool,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    act: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`moe_decode_routed` in plain PyTorch."""
    check_router_logits(
        logits, x.shape[0], topk, _num_ids(w13, expert_map), x.device,
        "w13" if expert_map is None else "expert_map",
    )  # fmt: skip
    weights, ids = top_routes_reference(logits, topk, renormalize)
    return moe_decode_reference(x, ids, weights, w13, w13_scale, w2, w2_scale,
                                expert_map, activation, act, out)  # fmt: skip
