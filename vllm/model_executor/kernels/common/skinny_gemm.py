"""``x @ weight.T`` for a few rows of ``x`` (decode steps), in Triton.

At decode a dense layer's GEMM streams its weight once for one to a few
tokens: the time is the weight's bytes over HBM bandwidth, if the whole GPU
pulls at once. cuBLAS picks tiles made for more rows: on the H200 at one
token Qwen3-30B-A3B's q/k/v projection (5120 x 2048) reached 2.7 TB/s, its
router (128 x 2048) ran on 2 thread blocks (4.9 us for 0.5 MB), and its
output projection took a split-K kernel plus a reduction. Here every
program streams ``BLOCK_N`` weight rows (over a ``1 / split_k`` slice of K),
many programs small enough to be resident at once; with ``split_k > 1``
each slice writes fp32 partials that a second kernel sums in slice order
(deterministic: no atomics). ``skinny_gemm_reference`` is the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error
from vllm.model_executor.kernels.common.device_info import num_sms

SKINNY_MAX_ROWS = 16
"""Rows up to which ``skinny_gemm`` applies (one ``tl.dot`` tile of rows)."""


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@functools.cache  # asked on every call
def default_skinny_config(n: int, k: int, sms: int) -> SkinnyConfig:
    """Split K while fewer than two programs per SM would stream (fewer
    leave bandwidth unused), down to slices of one ``block_k`` step."""
    config = SkinnyConfig()
    programs, split = triton.cdiv(n, config.block_n), 1
    while programs * split < 2 * sms and k // (split * 2) >= config.block_k:
        split *= 2
    return SkinnyConfig(split_k=split)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N], or [SPLIT_K, M, N] fp32 partials
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # between partial slices
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    # The interpreter does integer math on bf16 (kept as uint16), tl.dot too
    F32_MATH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        in_k = (offs_k + k < K)[None, :]
        x = tl.load(x_ptrs + k, mask=(rows < M)[:, None] & in_k, other=0.0)
        w = tl.load(w_ptrs + k, mask=(cols < N)[:, None] & in_k, other=0.0)
        if F32_MATH:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(
        out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)
    )


@triton.jit
def _sum_splits_kernel(
    partials_ptr,  # [SPLIT_K, M * N] fp32
    out_ptr,  # [M * N]
    numel,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(partials_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partials_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """``x`` [M <= SKINNY_MAX_ROWS, K] @ ``weight`` [N, K].T in ``x``'s
    dtype (fp32 accumulation), both 16-bit with unit stride along K."""
    if (
        x.dim() != 2
        or x.shape[0] > SKINNY_MAX_ROWS
        or x.stride(1) != 1
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        raise arg_error(
            "x", f"16-bit [M <= {SKINNY_MAX_ROWS}, K] with unit stride along K, got "
            f"{x.dtype} {list(x.shape)} (strides {x.stride()})",
        )  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    if (
        weight.dim() != 2
        or weight.shape[1] != k
        or weight.stride(1) != 1
        or weight.dtype != x.dtype
        or weight.device != x.device
    ):
        raise arg_error(
            "weight", f"[N, {k}] {x.dtype} on {x.device} with unit stride along K, "
            f"got {weight.dtype} {list(weight.shape)} on {weight.device}",
        )  # fmt: skip
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m * n:
        return out
    config = config or default_skinny_config(n, k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k)
    k_per_split *= config.block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else x.new_empty(split, m, n, dtype=torch.float32)
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split)](
        x,
        weight,
        target,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        m * n,
        K_PER_SPLIT=k_per_split,
        BLOCK_M=SKINNY_MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        F32_MATH=not x.is_cuda,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=split, BLOCK=block
        )
    return out


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.float() @ weight.float().T).to(x.dtype)
