"""Paged attention in Triton: one kernel for a batch that mixes prefill
chunks and decode tokens (the GPU path; ``torch_paged`` is its oracle).

A program takes ``BLOCK_Q`` consecutive query tokens of one request and all
query heads that share one KV head (grouped-query attention: the K/V tiles
are loaded once for the group), so its rows are (token, head) pairs. It
walks the request's KV tiles through the block table with an online softmax
in fp32, stopping at the causal limit of its last token. Programs are laid
out over the batch's query blocks without padding every request to the
longest: program ``p`` finds its request by a binary search over
``query_start_loc``.

Decode batches with few requests would leave most SMs idle (one program per
request and KV head), so the launcher splits each request's KV range over
``num_splits`` programs that write partial outputs and log-sum-exps, and a
second kernel (:mod:`.split_kv`) combines them. The split count depends
only on host-known sizes (requests, heads, longest query), so a captured
CUDA graph keeps it.
Combining in the last split to finish instead (an atomic counter per token
and KV head) took the kernel from 4.6 to 13.1 us per layer at batch 1 on
the H200 (Qwen3-30B-A3B, CUDA-graph replay), against 2.1 us for the second
kernel.

In a decode batch (one new token per request) the kernel can also take
the queries, keys and values as the q/k/v GEMM left them (``DecodeKV``):
each program normalizes and rotates its group's query heads, and the
program whose split holds a request's last position normalizes and
rotates that token's key, stores the key and value in the cache and adds
them to its softmax itself (the cache slot is not read); with several
splits every non-empty split loads (and rotates) that key and value with
its queries (one round trip after the PDL wait).
That is the work of ``qk_norm_rope_``'s launch, which the step then skips.
Every key such a kernel reads from the cache is then an earlier step's:
the first tile, the rotation's angles and the cache slot load before the
PDL wait, while the q/k/v GEMM finishes. A split past a short context
only marks itself empty for the combine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import check_contiguous
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait
from vllm.model_executor.kernels.common.qk_norm_rope import (
    QKNormRope,
    check_heads,
    check_qk_norm_rope,
    norm_rope_heads,
    rope_cos_sin,
)
from vllm.v1.attention.backends.split_kv import combine_splits, num_kv_splits

_KV_TILE = 64  # tokens per KV tile (several cache blocks)
_PREFILL_ROWS = 64  # (token, head) rows per program in batches with prefill


@dataclass(frozen=True)
class DecodeKV:
    """A decode batch's keys and values [T, kv_heads, head_size] as the
    q/k/v GEMM left them (heads at unit stride), the cache slots [T] int64
    they belong at, and the norm + RoPE that they and the queries still
    need: the attention kernel applies it and stores them."""

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    norm_rope: QKNormRope


@triton.jit
def _find_request(query_start_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include program ``pid``: the last
    ``i`` with ``query_start[i] // BLOCK_Q + i <= pid``."""
    lo = 0
    hi = num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq, tile, cached_len, kv_head, d,
    d_ok, stride_bt, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """KV head ``kv_head``'s keys and values [BLOCK_N, D_PAD] at the
    request's positions of ``tile``, zeros from ``cached_len`` on."""
    kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = kv_pos < cached_len
    block = tl.load(
        block_table_ptr + seq * stride_bt + kv_pos // PAGE, mask=kv_ok, other=0
    )
    offs = (
        block.to(tl.int64)[:, None] * stride_cb
        + (kv_pos % PAGE)[:, None] * stride_cs
        + kv_head * stride_ch
        + d[None, :]
    )
    kv_mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(
    q, k, v, tile, last_cached, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax's state after the keys of ``tile`` up to each
    row's ``last_cached`` position."""
    kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(kv_pos[None, :] <= last_cached[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _new_key_value(k_row, v_row, k_weight_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """A decode token's key of one KV head normed and rotated, and its
    value, each [1, HEAD_DIM]."""
    kv_row = tl.zeros([1, 1], tl.int64)  # one head, as norm_rope_heads takes
    k = norm_rope_heads(
        kv_row + k_row, kv_row == 0, k_weight_ptr, cos, sin, eps, HEAD_DIM
    )
    return k, tl.load(v_row + tl.arange(0, HEAD_DIM)[None, :])


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] (strided), or partials [T, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [T, H, NUM_SPLITS] fp32 (NUM_SPLITS > 1 only)
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, PAGE, KVH, D]
    v_cache_ptr,
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32
    k_ptr,  # [T, KVH, D]: the new keys (NEW_KV)
    v_ptr,  # [T, KVH, D]: the new values (NEW_KV)
    slots_ptr,  # [T] int64 (NEW_KV)
    q_weight_ptr,  # [D] (NEW_KV)
    k_weight_ptr,  # [D] (NEW_KV)
    cos_sin_ptr,  # [2, max_position, D] fp32 (NEW_KV)
    positions_ptr,  # [T] int64 (NEW_KV)
    eps,
    num_seqs,
    qk_scale,  # softmax scale * log2(e): exponentials in base 2
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_sin,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    DECODE: tl.constexpr,  # max_query_len 1 (BLOCK_Q 1): one program per request
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,  # of fp32 dots: "ieee" (as the oracle), not tf32
    NEW_KV: tl.constexpr,  # a decode batch's raw q/k/v (BLOCK_Q == 1)
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata is the host's, written before the step's kernels.
    # (at most one new token per request in DECODE: program p takes request p)
    seq = pid if DECODE else _find_request(query_start_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_block = 0 if DECODE else pid - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    # KV tiles up to the causal limit of this block's last token, this
    # split's share of them; NEW_KV reads the last position from k/v instead.
    kv_len = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)
    cached_len = kv_len - 1 if NEW_KV else kv_len
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    active = q_block * BLOCK_Q < q_len
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if NEW_KV:
        # Every key read from the cache is an earlier step's, and the
        # positions are the host's: the first tile and the rotation stream
        # while the previous kernel finishes.
        k_first, v_first = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq, tile_lo,
            tl.where(active, cached_len, 0), kv_head, d, d_ok, stride_bt,
            stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N,
        )  # fmt: skip
        t_new = q_start.to(tl.int64)
        cos, sin = rope_cos_sin(
            cos_sin_ptr,
            stride_sin,
            tl.load(positions_ptr + t_new, mask=active, other=0),
            q_ptr.dtype.element_ty,
            HEAD_DIM,
        )
        slot = tl.load(slots_ptr + t_new, mask=active, other=0)
    # The queries and the step's keys are the previous kernel's; the wait
    # (which releases the next kernel) comes before any early exit
    pdl_wait(PDL)
    if not active:
        return

    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    t = (q_start + token).to(tl.int64)
    num_heads = GROUP * tl.num_programs(1)
    row = (t * num_heads + head) * NUM_SPLITS + split  # of the partials
    if NUM_SPLITS > 1:  # noqa: SIM102 (Triton: a constexpr test, then a runtime one)
        if tile_lo >= num_tiles:  # a split past a short context: no keys
            no_keys = tl.full([BLOCK_M], float("-inf"), tl.float32)
            tl.store(lse_ptr + row, no_keys, mask=row_ok)
            return
    q_pos = context + token
    q_row = q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    if NEW_KV:  # the request's one token (D_PAD == HEAD_DIM)
        q_ok = row_ok[:, None]
        q = norm_rope_heads(q_row, q_ok, q_weight_ptr, cos, sin, eps, HEAD_DIM)
        if NUM_SPLITS > 1:
            # Latency-bound (few requests): the token's own key and value
            # load with the queries (one round trip) in every split; the one
            # whose tiles hold its position uses them. With one split per
            # request they load after the tiles: held through the KV loop
            # they raised its spills (sm_90, Triton 3.9: 272 bytes of stack
            # against 80; 112 this way), and the kernel lost 3% at 256.
            k_new, v_new = _new_key_value(
                k_ptr + t_new * stride_kt + kv_head * stride_kh,
                v_ptr + t_new * stride_vt + kv_head * stride_vh,
                k_weight_ptr, cos, sin, eps, HEAD_DIM,
            )  # fmt: skip
    else:
        q = tl.load(q_row + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    last_cached = q_pos - 1 if NEW_KV else q_pos  # the last key from the cache
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    first = tile_lo
    if NEW_KV:
        m_i, l_i, acc = _attend_tile(
            q, k_first, v_first, tile_lo, last_cached, m_i, l_i, acc, qk_scale,
            BLOCK_N, PRECISION,
        )  # fmt: skip
        first += 1
    for tile in range(first, tile_hi):
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq, tile, cached_len,
            kv_head, d, d_ok, stride_bt, stride_cb, stride_cs, stride_ch, PAGE,
            BLOCK_N,
        )  # fmt: skip
        m_i, l_i, acc = _attend_tile(
            q, k, v, tile, last_cached, m_i, l_i, acc, qk_scale, BLOCK_N, PRECISION
        )
    if NEW_KV:
        new_tile = (kv_len - 1) // BLOCK_N
        if (tile_lo <= new_tile) & (new_tile < tile_hi):
            # This split holds the token's own position: its key and value.
            if NUM_SPLITS == 1:
                k_new, v_new = _new_key_value(
                    k_ptr + t_new * stride_kt + kv_head * stride_kh,
                    v_ptr + t_new * stride_vt + kv_head * stride_vh,
                    k_weight_ptr, cos, sin, eps, HEAD_DIM,
                )  # fmt: skip
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
            dst += kv_head * stride_ch + d[None, :]
            tl.store(k_cache_ptr + dst, k_new)
            tl.store(v_cache_ptr + dst, v_new)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
            m_new = tl.maximum(m_i, s_new)
            p = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + p
            # p rounded to the values' dtype, as the tiles' dot takes it
            p_v = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
            acc = acc * alpha[:, None] + p_v
            m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row without keys (padding)
    out = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + row, lse, mask=row_ok)


def _check_new_kv(
    new_kv: DecodeKV, q: torch.Tensor, kv_heads: int, max_query_len: int
) -> None:
    """Raise naming the field of ``new_kv`` that does not fit ``q``."""
    if max_query_len != 1:
        raise ValueError(
            f"new_kv: expected a decode batch (max_query_len 1), got "
            f"max_query_len={max_query_len}"
        )
    check_qk_norm_rope(q, new_kv.k, new_kv.norm_rope)
    check_heads("k", new_kv.k, q, kv_heads)
    check_heads("v", new_kv.v, q, kv_heads)
    slots = new_kv.slot_mapping
    check_contiguous("slot_mapping", slots, torch.long, [q.shape[0]], q.device)


def triton_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    new_kv: DecodeKV | None = None,
    prefetch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [T, H, D] (the batch's new tokens, request after
    request) over the paged caches [num_blocks, block_size, KVH, D], whose
    slots for the new tokens are already written, or, with ``new_kv`` (a
    decode batch: ``max_query_len`` 1, a power-of-two head size), whose
    new keys and values it writes itself after normalizing and rotating
    them and ``q`` (left as they were in memory); returns [T, H * D].
    ``max_query_len`` must bound every request's new tokens. ``prefetch``:
    a weight the next kernel reads, which the split combine warms in L2
    while the attention runs (:mod:`~.l2_prefetch`), where it may."""
    tokens, heads, head_dim = q.shape
    _, page, kv_heads, cache_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(
            f"key_cache: expected [blocks, page, kv_heads dividing {heads}, "
            f"{head_dim}], got {tuple(key_cache.shape)}"
        )
    if (
        key_cache.dtype != q.dtype
        or value_cache.dtype != q.dtype
        or value_cache.shape != key_cache.shape
        or value_cache.stride() != key_cache.stride()
        or key_cache.stride(3) != 1
    ):
        raise ValueError(
            f"value_cache/key_cache: expected {q.dtype}, equal shapes and strides "
            f"and contiguous head_size, got "
            f"{key_cache.dtype} {tuple(key_cache.shape)} and {value_cache.dtype} "
            f"{tuple(value_cache.shape)}"
        )
    for name, t, dims in (
        ("block_table", block_table, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if t.dtype != torch.int32 or t.dim() != dims or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous {dims}-D int32 tensor, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError(
            f"query_start_loc/block_table: expected {num_seqs + 1} entries and "
            f">= {num_seqs} rows, got {query_start_loc.shape[0]} and "
            f"{block_table.shape[0]}"
        )
    if max_query_len < 1 or q.stride(2) != 1:
        raise ValueError(
            f"q/max_query_len: expected a contiguous head_size and >= 1, got "
            f"{q.stride()} and {max_query_len}"
        )
    if max_query_len == 1 and tokens > num_seqs:
        raise ValueError(
            f"max_query_len: 1 bounds {num_seqs} requests to {num_seqs} tokens, "
            f"got {tokens}"
        )
    if new_kv is not None:
        _check_new_kv(new_kv, q, kv_heads, max_query_len)
    if prefetch is not None and prefetch.device != q.device:
        raise ValueError(
            f"prefetch: expected a tensor on {q.device}, got {prefetch.device}"
        )
    # A step with prefill may be a CUDA graph padded past its last request:
    # no program writes those rows, and zeros keep them finite (garbage could
    # be NaN, and NaN rows all route to the same experts).
    new = q.new_zeros if max_query_len > 1 else q.new_empty
    out = new(tokens, heads, head_dim)
    if tokens == 0:
        return out.view(0, heads * head_dim)
    group = heads // kv_heads
    block_q = 1 if max_query_len == 1 else max(1, _PREFILL_ROWS // group)
    splits = num_kv_splits(num_seqs, kv_heads, max_query_len, q.device)
    if splits > 1:
        partial = torch.empty(
            tokens, heads, splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q.device)
    else:
        partial, lse = out, out  # lse unused
    # Every request's query blocks fit in T // BLOCK_Q + B programs; a
    # decode batch's in B.
    decode = max_query_len == 1
    grid = (num_seqs if decode else tokens // block_q + num_seqs, kv_heads, splits)
    d_pad = triton.next_power_of_2(head_dim)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    launch_pdl = pdl(q.device)
    if new_kv is None:  # the kernel reads none of these
        k = v = q_weight = k_weight = cos_sin = q
        slots = positions = seq_lens
        eps = 0.0
    else:
        k, v, slots = new_kv.k, new_kv.v, new_kv.slot_mapping
        norm_rope = new_kv.norm_rope
        q_weight, k_weight = norm_rope.q_weight, norm_rope.k_weight
        cos_sin, positions, eps = norm_rope.cos_sin, norm_rope.positions, norm_rope.eps
    _paged_attention_kernel[grid](
        partial,
        lse,
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        k,
        v,
        slots,
        q_weight,
        k_weight,
        cos_sin,
        positions,
        eps,
        num_seqs,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=page,
        BLOCK_Q=block_q,
        DECODE=decode,
        BLOCK_M=block_m,
        BLOCK_N=_KV_TILE,
        NUM_SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NEW_KV=new_kv is not None,
        PDL=launch_pdl,
        launch_pdl=launch_pdl,
    )
    if splits > 1:
        combine_splits(out, partial, lse, prefetch, launch_pdl)
    return out.view(tokens, heads * head_dim)
