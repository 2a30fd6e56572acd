"""A MoE router at decode sizes in one kernel: ``x @ gate.T``, softmax over
experts, top-k and renormalization (Triton).

At a token or two, the router's GEMM (Qwen3-30B-A3B: 128 x 2048, 0.5 MB)
and the routing are each a launch of a few microseconds on the H200 (2.6
and 3.4 us per layer under CUDA-graph replay), most of it fixed cost. Here
the GEMM's programs (:func:`~.skinny_gemm.skinny_tile`) each write their
experts' logits and count themselves done on an atomic counter; the last
one routes every token from all logits (:func:`~.topk_softmax.route_token`)
and zeroes the counter for the next launch. The counter must be zero before
the first launch and belongs to one stream at a time (the layer takes a
lock buffer of the workspace manager, per slot and stream). The logits are
rounded to the input's dtype, as the unfused path's GEMM output is, so that
a token routes alike at every batch size; :func:`router_topk_reference` is
the oracle.

Two weight rows x 2048 K per program (64 programs for Qwen3-30B-A3B): 2.2
us against 2.8 at ``skinny_gemm``'s 8 x 1024 (H200, one token, the GEMM
alone; ``benchmarks/tuning/tune_skinny_gemm.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.skinny_gemm import (
    SKINNY_MAX_ROWS,
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
        0 < rows <= SKINNY_MAX_ROWS
        and num_experts <= ROUTER_MAX_EXPERTS
        and dtype in (torch.bfloat16, torch.float16)
    )


@triton.jit
def _router_topk_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [E, K]
    logits_ptr,  # [M, E] fp32
    counter_ptr,  # [1] int32, zero
    weights_ptr,  # [M, TOPK] fp32
    ids_ptr,  # [M, TOPK] int32
    M,
    num_experts,
    K,
    stride_xm,
    stride_wn,
    TOPK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = skinny_tile(
        x_ptr, w_ptr, M, num_experts, K, stride_xm, stride_wn, cols,
        BLOCK_M, BLOCK_N, BLOCK_K, PDL,
    )  # fmt: skip
    tl.store(
        logits_ptr + rows[:, None] * num_experts + cols[None, :],
        logits.to(x_ptr.dtype.element_ty).to(tl.float32),
        mask=(rows < M)[:, None] & (cols < num_experts),
    )
    # Every thread's stores precede the count; the last program's acquire
    # makes all programs' logits visible to its loads.
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        for m in range(M):
            route_token(
                logits_ptr + m * num_experts,
                weights_ptr + m * TOPK,
                ids_ptr + m * TOPK,
                num_experts,
                TOPK,
                RENORMALIZE,
                BLOCK_E,
                CHUNK,
            )


def router_topk(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    counter: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [M, topk], ids int32 [M, topk])`` of the tokens ``x``
    [M <= 2, K] (16-bit) under the router ``gate_weight`` [E, K], largest
    first; ``counter``: an int32 zero on ``x``'s device, left zero."""
    check_skinny_operands(x, gate_weight, "gate_weight")
    (m, k), num_experts = x.shape, gate_weight.shape[0]
    if not router_topk_applies(max(m, 1), num_experts, x.dtype):
        raise arg_error(
            "gate_weight", f"at most {ROUTER_MAX_EXPERTS} experts, got {num_experts}"
        )
    if not 1 <= topk <= num_experts:
        raise arg_error("topk", f"1..{num_experts}, got {topk}")
    good_counter = counter.dtype == torch.int32 and counter.device == x.device
    if not good_counter or not counter.numel():
        raise arg_error(
            "counter", f"int32 zeros on {x.device}, got {counter.dtype} "
            f"{list(counter.shape)} on {counter.device}",
        )  # fmt: skip
    weights = torch.empty(m, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, topk, dtype=torch.int32, device=x.device)
    if m:
        logits = torch.empty(m, num_experts, dtype=torch.float32, device=x.device)
        block_e, chunk = route_block_sizes(num_experts)
        launch_pdl = pdl(x.device)
        _router_topk_kernel[(triton.cdiv(num_experts, _BLOCK_N),)](
            x, gate_weight, logits, counter, weights, ids,
            m, num_experts, k, x.stride(0), gate_weight.stride(0),
            TOPK=topk, RENORMALIZE=renormalize,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
            BLOCK_E=block_e, CHUNK=chunk, PDL=launch_pdl, num_warps=4,
            launch_pdl=launch_pdl,
        )  # fmt: skip
    return weights, ids


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
