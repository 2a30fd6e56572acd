"""A MoE router at one token in one kernel: ``x @ gate.T``, softmax over
experts, top-k and renormalization (Triton).

At one token, the router's GEMM (Qwen3-30B-A3B: 128 x 2048, 0.5 MB)
and the routing are each a launch of a few microseconds on the H200 (2.6
and 3.4 us per layer under CUDA-graph replay), most of it fixed cost. Here
the GEMM's programs (:func:`~.skinny_gemm.skinny_tile`) each write their
experts' logits and count themselves done on an atomic counter; the last
one routes the token from all logits (:func:`~.topk_softmax.route_token`)
and zeroes the counter for the next launch. The counter must be zero before
the first launch and belongs to one stream at a time (the layer takes a
lock buffer of the workspace manager, per slot and stream). The logits are
rounded to the input's dtype, as the unfused path's GEMM output is, so that
a token routes alike at every batch size; :func:`router_topk_reference` is
the oracle.

Two weight rows x 2048 K per program (64 programs for Qwen3-30B-A3B): 2.2
us against 2.8 at ``skinny_gemm``'s 8 x 1024 (H200, one token, the GEMM
alone; ``benchmarks/tuning/tune_skinny_gemm.py``). One token only: at
two, the last program's two routings in series lost to ``skinny_gemm``
then ``topk_softmax`` (one program per token), 48.7 against 47.0 us for
the whole bf16 layer (``benchmark_moe_decode``).

``rms_norm_router_topk`` routes ``rms_norm(x + residual)`` with the add and
the norm in the GEMM's prologue (:func:`~.skinny_gemm.skinny_tile`);
program 0 writes the sum and the normalized row, which the experts read.
``rms_norm_router_logits`` is that launch without the routing: the MoE
decode kernels route from its logits themselves
(:func:`~.grouped_gemm.decode.moe_decode_routed`), with no last program to
wait for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error, check_norm_operands
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.skinny_gemm import (
    check_skinny_operands,
    skinny_tile,
)
from vllm.model_executor.kernels.common.topk_softmax import (
    route_block_sizes,
    route_token,
)

ROUTER_MAX_EXPERTS = 1024  # every expert's rank in one program's registers
_BLOCK_N, _BLOCK_K = 2, 2048


def router_topk_applies(rows: int, num_experts: int, dtype: torch.dtype) -> bool:
    """Whether ``router_topk`` takes a router of ``num_experts`` at ``rows``."""
    return (
        rows == 1
        and num_experts <= ROUTER_MAX_EXPERTS
        and dtype in (torch.bfloat16, torch.float16)
    )


@triton.jit
def _router_topk_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [E, K]
    logits_ptr,  # [E] fp32 (ROUTE) or x's dtype
    counter_ptr,  # [1] int32, zero
    weights_ptr,  # [TOPK] fp32
    ids_ptr,  # [TOPK] int32
    res_ptr,  # NORM: [1, K] residual
    norm_w_ptr,  # NORM: [K]
    sum_ptr,  # NORM: [1, K] out, x + residual
    normed_ptr,  # NORM: [1, K] out, rms_norm(x + residual), the routed row
    num_experts,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    eps,
    NORM: tl.constexpr,
    TOPK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    ROUTE: tl.constexpr,  # else only the logits, in x's dtype
    WHOLE_K: tl.constexpr,  # K <= BLOCK_K
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = skinny_tile(
        x_ptr, w_ptr, 1, num_experts, K, stride_xm, stride_wn, cols,
        1, BLOCK_N, BLOCK_K, PDL,
        res_ptr, norm_w_ptr, sum_ptr, normed_ptr, stride_rm, eps, NORM, NORM, NORM,
        WHOLE_K,
    )  # fmt: skip
    tl.store(
        logits_ptr + cols[None, :],
        logits.to(x_ptr.dtype.element_ty).to(logits_ptr.dtype.element_ty),
        mask=(cols < num_experts)[None, :],
    )
    if ROUTE:
        # Every thread's stores precede the count; the last program's acquire
        # makes all programs' logits visible to its loads.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(counter_ptr, 0)
            route_token(
                logits_ptr, weights_ptr, ids_ptr, num_experts, TOPK, RENORMALIZE,
                BLOCK_E, CHUNK,
            )  # fmt: skip


def router_topk(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    counter: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [M, topk], ids int32 [M, topk])`` of the token ``x``
    [M <= 1, K] (16-bit) under the router ``gate_weight`` [E, K], largest
    first; ``counter``: an int32 zero on ``x``'s device, left zero."""
    _check(x, gate_weight)
    return _route(x, gate_weight, topk, renormalize, counter, None)


def rms_norm_router_topk(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    counter: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`router_topk` of ``rms_norm(x + residual)`` with the residual
    add and the norm in the same launch (every program normalizes the row
    itself): ``(weights, ids, the normalized row, x + residual)``."""
    _check(x, gate_weight)
    normed, total, norm = _norm_outputs(x, residual, norm_weight, eps)
    weights, ids = _route(x, gate_weight, topk, renormalize, counter, norm)
    return weights, ids, normed, total


def rms_norm_router_logits(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's GEMM of :func:`rms_norm_router_topk` without the
    routing, for kernels that route from the logits themselves: ``(logits
    [M, E] in x's dtype, the normalized row, x + residual)``."""
    _check(x, gate_weight)
    normed, total, norm = _norm_outputs(x, residual, norm_weight, eps)
    m, num_experts = x.shape[0], gate_weight.shape[0]
    logits = torch.empty(m, num_experts, dtype=x.dtype, device=x.device)
    if m:
        _launch(x, gate_weight, logits, None, norm)
    return logits, normed, total


_Norm = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def _check(x: torch.Tensor, gate_weight: torch.Tensor) -> None:
    if x.dim() == 2 and x.shape[0] > 1:
        raise arg_error("x", f"at most one row, got {x.shape[0]}")
    check_skinny_operands(x, gate_weight, "gate_weight")
    num_experts = gate_weight.shape[0]
    if not router_topk_applies(1, num_experts, x.dtype):
        raise arg_error(
            "gate_weight", f"at most {ROUTER_MAX_EXPERTS} experts, got {num_experts}"
        )


def _norm_outputs(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, _Norm]:
    check_norm_operands(x, residual, norm_weight)
    normed = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(normed)
    return normed, total, (residual, norm_weight, total, normed, eps)


def _route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    counter: torch.Tensor,
    norm: _Norm | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = gate_weight.shape[0]
    if not 1 <= topk <= num_experts:
        raise arg_error("topk", f"1..{num_experts}, got {topk}")
    good_counter = counter.dtype == torch.int32 and counter.device == x.device
    if not good_counter or not counter.numel():
        raise arg_error(
            "counter", f"int32 zeros on {x.device}, got {counter.dtype} "
            f"{list(counter.shape)} on {counter.device}",
        )  # fmt: skip
    m = x.shape[0]
    weights = torch.empty(m, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, topk, dtype=torch.int32, device=x.device)
    if m:
        logits = torch.empty(num_experts, dtype=torch.float32, device=x.device)
        route = (topk, renormalize, counter, weights, ids)
        _launch(x, gate_weight, logits, route, norm)
    return weights, ids


def _launch(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    logits: torch.Tensor,
    route: tuple[int, bool, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    norm: _Norm | None,
) -> None:
    """``route``: (topk, renormalize, counter, weights, ids), or None for the
    logits alone."""
    num_experts = gate_weight.shape[0]
    residual, norm_weight, total, normed, eps = norm or (None, None, None, None, 0.0)
    topk, renormalize, counter, weights, ids = route or (
        1,
        False,
        logits,
        logits,
        logits,
    )
    block_e, chunk = route_block_sizes(num_experts)
    launch_pdl = pdl(x.device)
    _router_topk_kernel[(triton.cdiv(num_experts, _BLOCK_N),)](
        x, gate_weight, logits, counter, weights, ids,
        residual, norm_weight, total, normed,
        num_experts, x.shape[1], x.stride(0), gate_weight.stride(0),
        0 if residual is None else residual.stride(0), eps, NORM=norm is not None,
        TOPK=topk, RENORMALIZE=renormalize, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        BLOCK_E=block_e, CHUNK=chunk, PDL=launch_pdl, ROUTE=route is not None,
        WHOLE_K=x.shape[1] <= _BLOCK_K, num_warps=4, launch_pdl=launch_pdl,
    )  # fmt: skip


def router_topk_reference(
    x: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in ``x``'s dtype, then softmax in fp32, top-k and
    renormalization, in PyTorch."""
    logits = (x.float() @ gate_weight.float().T).to(x.dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
