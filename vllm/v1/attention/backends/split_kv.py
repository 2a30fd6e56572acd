"""Split-KV decode attention's second kernel: each (token, head) row's
partial outputs and log-sum-exps, one per split of its KV range, combined
into the output (:mod:`.triton_paged` writes them), and how many splits a
decode batch takes.

The combine's programs start while the attention runs (PDL), so before
their wait they warm the next kernel's weight in L2 (:mod:`~.l2_prefetch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.device_info import num_sms
from vllm.model_executor.kernels.common.l2_prefetch import (
    l2_prefetch,
    prefetch_share,
    prefetchable,
)
from vllm.model_executor.kernels.common.pdl import pdl_wait

_MAX_SPLITS = 32


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [T, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [T, H, NUM_SPLITS] fp32, base 2
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
    prefetch_ptr,  # PREFETCH: the bytes of a weight the next kernel reads
    prefetch_bytes,
    prefetch_per_program,
    PREFETCH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if PREFETCH:  # while the attention runs (see :mod:`~.l2_prefetch`)
        start = (t * num_heads + h) * prefetch_per_program
        l2_prefetch(prefetch_ptr, prefetch_bytes, start, prefetch_per_program)
    pdl_wait(PDL)
    row = (t * num_heads + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + row + s)
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits: exp2(-inf) = 0
    # (their partials are never written; loading every split's with the
    # log-sum-exps instead, one round trip, cost 3.95 against 2.44 us a
    # layer on the H100: the bytes of 32 splits)
    part = tl.load(
        partial_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :],
        mask=(weight > 0.0)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, device: torch.device
) -> int:
    """Split-KV programs per (request, KV head): enough to give every SM a
    program in decode batches; none once prefill blocks fill the GPU."""
    if max_query_len > 1:
        return 1
    wanted = -(-num_sms(device) // (num_seqs * num_kv_heads))
    return min(_MAX_SPLITS, 1 << (wanted - 1).bit_length())


def combine_splits(
    out: torch.Tensor,
    partial: torch.Tensor,
    lse: torch.Tensor,
    prefetch: torch.Tensor | None,
    launch_pdl: bool,
) -> None:
    """``out`` [T, H, D] from ``partial`` [T, H, S, D] and ``lse`` [T, H, S]
    (fp32, base 2; -inf for a split without keys, whose partial is not
    read); ``prefetch``: a weight warmed in L2 meanwhile, where it may."""
    tokens, heads, splits, head_dim = partial.shape
    warm = prefetch if prefetch is not None and prefetchable(prefetch) else None
    warm_bytes = (out if warm is None else warm).view(-1).view(torch.uint8)
    per_program = 0
    if warm is not None:
        per_program = prefetch_share(len(warm_bytes), tokens * heads)
    _combine_splits_kernel[(tokens, heads)](
        out,
        partial,
        lse,
        out.stride(0),
        out.stride(1),
        heads,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        NUM_SPLITS=splits,
        PDL=launch_pdl,
        prefetch_ptr=warm_bytes,
        prefetch_bytes=len(warm_bytes),
        prefetch_per_program=per_program,
        PREFETCH=warm is not None,
        launch_pdl=launch_pdl,
    )
