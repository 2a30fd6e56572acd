"""Softmax over experts, top-k and renormalization in one kernel (Triton).

A MoE layer's routing in plain PyTorch is seven kernels (cast, softmax,
top-k's select and sort, sum, divide, id cast): some 20 us per layer at
decode sizes, more than the layer's expert GEMMs take at one token. One
program routes one token: the softmax in fp32 in registers, then every
expert's rank from all pairwise comparisons at once (ties go to the lower
expert id); the top ``k`` store their weight and id at their rank. ``k``
rounds of max-and-remove, the first version, were 2k block reductions in
series: 3.4 us per call at one token on the H200.

:func:`top_routes` routes one token inside another kernel (the MoE decode
GEMMs route from the router's logits themselves): there the logits are
16-bit values, so each expert's logit and id fit in one int32 key and a
round of max-and-remove is one block reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error, check_rows
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait


@triton.jit
def route_token(
    row,  # one token's logits
    weights_out,  # [K] fp32
    ids_out,  # [K] int32
    num_experts,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,  # experts compared at once (BLOCK_E x CHUNK pairs)
):
    """Softmax, top-k and renormalization of the token whose logits are at
    ``row``; loads go through L2 (``router_topk`` routes from logits that
    other programs of its launch wrote)."""
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(row + e, mask=valid, other=float("-inf"), cache_modifier=".cg")
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    # Softmax keeps the logits' order: an expert's rank is the number of
    # experts with a larger logit, or an equal one and a lower id. NaN and
    # the lanes past the experts sort last, so a NaN row still routes to
    # ids in range.
    key = tl.where(x == x, x, float("-inf"))
    rank = tl.zeros([BLOCK_E], tl.int32)
    for start in tl.static_range(0, BLOCK_E, CHUNK):
        other = start + tl.arange(0, CHUNK)
        x_other = tl.load(
            row + other,
            mask=other < num_experts,
            other=float("-inf"),
            cache_modifier=".cg",
        ).to(tl.float32)
        k_other = tl.where(x_other == x_other, x_other, float("-inf"))[None, :]
        beats = (k_other > key[:, None]) | (
            (k_other == key[:, None]) & (other[None, :] < e[:, None])
        )
        rank += tl.sum(beats.to(tl.int32), 1)
    chosen = rank < K
    weights = tl.where(p == p, p, -1.0)  # NaN: a weight below every probability
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(chosen, weights, 0.0), 0)
    tl.store(weights_out + rank, weights, mask=chosen)
    tl.store(ids_out + rank, e, mask=chosen)


# top_routes' keys: a 16-bit logit in fp32 leaves the low 13 bits zero, so
# they hold the expert id (inverted: ties go to the lower id).
TOP_ROUTES_MAX_EXPERTS = 1 << 10
ROUTE_ID_MASK: tl.constexpr = tl.constexpr(TOP_ROUTES_MAX_EXPERTS - 1)
ROUTE_LOGIT_MASK: tl.constexpr = tl.constexpr(-TOP_ROUTES_MAX_EXPERTS)  # ~ROUTE_ID_MASK
ROUTE_TAKEN: tl.constexpr = tl.constexpr(-(2**31) + 1)  # below every key


@triton.jit
def route_keys(x, e):
    """:func:`top_routes`' int32 key of each expert ``e``: its fp32 logit
    ``x`` (a 16-bit value, NaN as -inf) in the high bits, its id inverted
    in the low ones (ties go to the lower id)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 ties with 0.0
    # Signed order of the keys is the logits' order: flip negatives' magnitude.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) & ROUTE_LOGIT_MASK
    return key | (ROUTE_ID_MASK - e)


@triton.jit
def route_key_logit(key):
    """The fp32 logit of a :func:`top_routes` key (its id bits cleared)."""
    high = key & ROUTE_LOGIT_MASK
    bits = tl.where(high < 0, (high ^ 0x7FFFFFFF) & ROUTE_LOGIT_MASK, high)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def top_routes(
    row,  # one token's logits, 16-bit values
    num_experts,  # <= TOP_ROUTES_MAX_EXPERTS
    topk,
    RENORMALIZE: tl.constexpr,
    WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # >= num_experts
    BLOCK_R: tl.constexpr,  # >= topk
):
    """``(ids int32 [BLOCK_R], weights fp32 [BLOCK_R])`` of the token whose
    logits are at ``row``: its ``topk`` experts, largest logit first, ties
    to the lower id, NaN last (a NaN row still routes to ids in range);
    the softmax weights (renormalized over the chosen) with ``WEIGHTS``,
    else zeros. Lanes past ``topk``: id 0, weight 0 (NaN where no logit
    is finite, as the reference's)."""
    e = tl.arange(0, BLOCK_E)
    x = tl.load(row + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))
    key = route_keys(x, e)
    slots = tl.arange(0, BLOCK_R)
    ids = tl.zeros([BLOCK_R], dtype=tl.int32)
    top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for i in range(topk):
        best = tl.max(key, 0)
        key = tl.where(key == best, ROUTE_TAKEN, key)
        ids = tl.where(slots == i, ROUTE_ID_MASK - (best & ROUTE_ID_MASK), ids)
        if WEIGHTS:
            top = tl.where(slots == i, route_key_logit(best), top)
    weights = tl.zeros([BLOCK_R], dtype=tl.float32)
    if WEIGHTS:
        largest = tl.max(x, 0)
        weights = tl.exp(top - largest)  # zero past topk
        if RENORMALIZE:
            weights = weights / tl.sum(weights, 0)
        else:
            weights = weights / tl.sum(tl.exp(x - largest), 0)
    return ids, weights


@triton.jit
def route_expert(row, num_experts, slot, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
    """The expert id of route ``slot`` of :func:`top_routes` (its first
    ``slot + 1`` rounds only)."""
    ids, _ = top_routes(row, num_experts, slot + 1, False, False, BLOCK_E, BLOCK_R)
    return tl.sum(tl.where(tl.arange(0, BLOCK_R) == slot, ids, 0), 0)


@dataclass(frozen=True)
class DecodeRouting:
    """A decode batch's routing as the MoE decode kernels take it: top-k ids
    and weights, or the router's 16-bit logits from which the kernels route
    each token themselves (``routed``, :func:`top_routes`). A kernel reads
    one of the two; the other's pointers are placeholders."""

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    routed: bool
    renormalize: bool

    @classmethod
    def by_ids(cls, ids: torch.Tensor, weights: torch.Tensor) -> DecodeRouting:
        return cls(ids, weights, ids, False, False)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, renormalize: bool) -> DecodeRouting:
        return cls(logits, logits, logits, True, renormalize)


def check_router_logits(
    logits: torch.Tensor,
    tokens: int,
    topk: int,
    num_ids: int,
    device: torch.device,
    ids_name: str,
) -> None:
    """Raise naming the argument unless kernels routing by
    :func:`top_routes` take ``logits`` [tokens, num_ids] and ``topk``;
    ``ids_name``: the argument that sets ``num_ids`` (the weights or the
    expert map)."""
    if num_ids > TOP_ROUTES_MAX_EXPERTS:
        raise arg_error(
            ids_name, f"at most {TOP_ROUTES_MAX_EXPERTS} experts to route among, "
            f"got {num_ids}",
        )  # fmt: skip
    if logits.dim() != 2 or logits.shape[0] != tokens:
        raise arg_error(
            "logits", f"[{tokens}, {num_ids}] (tokens, experts), got "
            f"{tuple(logits.shape)}",
        )  # fmt: skip
    # 16-bit logits: top_routes packs each with its expert id in an int32.
    dtypes = (torch.bfloat16, torch.float16)
    check_rows("logits", logits, tokens, num_ids, dtypes, device)
    if not 1 <= topk <= num_ids:
        raise arg_error("topk", f"1..{num_ids}, got {topk}")


def top_routes_reference(
    logits: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_routes` of every row of ``logits`` [T, E] in PyTorch:
    ``(weights fp32 [T, topk], ids int32 [T, topk])``, ties to the lower id
    (a stable sort), NaN last."""
    x = logits.float()
    x = torch.where(x.isnan(), float("-inf"), x)
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :topk]
    probs = torch.softmax(x, dim=-1).gather(-1, ids)
    if renormalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids.to(torch.int32)


def route_block_sizes(num_experts: int) -> tuple[int, int]:
    """``(BLOCK_E, CHUNK)`` of :func:`route_token` for ``num_experts``."""
    block_e = triton.next_power_of_2(num_experts)
    return block_e, min(block_e, max(16, 8192 // block_e))


@triton.jit
def _topk_softmax_kernel(
    weights_ptr,  # [T, K] fp32
    ids_ptr,  # [T, K] int32
    logits_ptr,  # [T, E]
    num_experts,
    stride_logits,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # the logits are the previous kernel's
    token = tl.program_id(0).to(tl.int64)
    route_token(
        logits_ptr + token * stride_logits,
        weights_ptr + token * K,
        ids_ptr + token * K,
        num_experts,
        K,
        RENORMALIZE,
        BLOCK_E,
        CHUNK,
    )


def topk_softmax(
    gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, topk], ids int32 [T, topk])`` of ``gating_output``
    [T, E] (unit stride over experts), largest first."""
    tokens, num_experts = gating_output.shape
    if gating_output.stride(1) != 1 or not 1 <= topk <= num_experts:
        raise ValueError(
            f"gating_output/topk: expected unit stride over experts and topk in "
            f"1..{num_experts}, got strides {gating_output.stride()} and {topk}"
        )
    device = gating_output.device
    weights = torch.empty(tokens, topk, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    if tokens:
        block_e, chunk = route_block_sizes(num_experts)
        launch_pdl = pdl(device)
        _topk_softmax_kernel[(tokens,)](
            weights,
            ids,
            gating_output,
            num_experts,
            gating_output.stride(0),
            K=topk,
            RENORMALIZE=renormalize,
            BLOCK_E=block_e,
            CHUNK=chunk,
            PDL=launch_pdl,
            launch_pdl=launch_pdl,
        )
    return weights, ids
