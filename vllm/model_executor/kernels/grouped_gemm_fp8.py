"""FP8 w8a8 grouped GEMM over expert-contiguous rows (Triton).

``out[r] = (a[r] @ w[e]^T) * a_scale[r] * w_scale[e]`` for the rows ``r`` of
expert ``e`` (``offsets[e]:offsets[e+1]``, the permute's
``expert_first_token_offset``). One program computes one BLOCK_M x BLOCK_N
tile of one expert. The grid is a static upper bound on the number of row
tiles (``cdiv(R, BLOCK_M) + min(E, R)``), so it never depends on the routing
and the launch can be captured in a CUDA graph; each program finds its expert
by a prefix sum of the per-expert tile counts and surplus programs exit. Rows
at or past ``offsets[E]`` are not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.checks import check_contiguous

FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _grouped_gemm_fp8_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    offsets_ptr,
    out_ptr,
    N,
    K,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # N tiles vary fastest: neighbours share the A rows and the expert's weights.
    m_tile = pid // n_tiles
    n_tile = pid % n_tiles

    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    starts = tl.load(offsets_ptr + experts, mask=valid, other=0)
    ends = tl.load(offsets_ptr + experts + 1, mask=valid, other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles_end = tl.cumsum(tiles, 0)
    if m_tile >= tl.sum(tiles):
        return
    # The expert whose tile range holds m_tile, and the tile's first row.
    expert = tl.sum((tiles_end <= m_tile).to(tl.int32))
    first_tile = tl.sum(tl.where(experts == expert, tiles_end - tiles, 0))
    row_start = tl.sum(tl.where(experts == expert, starts, 0))
    row_end = tl.sum(tl.where(experts == expert, ends, 0))
    row_start += (m_tile - first_tile) * BLOCK_M

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * N * K
    w_ptrs = w_base + cols[None, :].to(tl.int64) * K + ks[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + ks < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + expert * N + cols, mask=col_ok, other=0.0)
    acc = acc * a_scale[:, None] * w_scale[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _check(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, N, K], got shape {list(w.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected [R, K], got shape {list(a.shape)}")
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out: expected bfloat16 or float16, got {out.dtype}")
    num_experts, n, k = w.shape
    rows = a.shape[0]
    for name, tensor, dtype, shape in (
        ("a", a, FP8_DTYPE, [rows, k]),
        ("a_scale", a_scale, torch.float32, [rows]),
        ("w", w, FP8_DTYPE, [num_experts, n, k]),
        ("w_scale", w_scale, torch.float32, [num_experts, n]),
        ("expert_first_token_offset", offsets, torch.int64, [num_experts + 1]),
        ("out", out, out.dtype, [rows, n]),
    ):
        check_contiguous(name, tensor, dtype, shape, w.device)


@dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The fastest checked tiles on the H200 (benchmark_grouped_gemm_fp8
    --sweep): short row groups waste less of a 64-row tile; from 64 rows per
    expert on, wide 128x256 tiles halve the A re-reads."""
    if rows <= 64 * num_experts:
        return GroupedGemmConfig(64, 128, 128, 4, 4)
    return GroupedGemmConfig(128, 256, 128, 8, 3)


def grouped_gemm_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """Writes the rows below ``expert_first_token_offset[-1]`` of ``out``
    [R, N] from ``a`` [R, K] fp8 with per-row ``a_scale`` [R] and ``w``
    [E, N, K] fp8 with per-channel ``w_scale`` [E, N]; returns ``out``.

    The offsets (int64 [E + 1], the permute's) must ascend from 0 to at most
    R: they live on the device and are not checked, so that the call needs no
    host sync and no allocation (CUDA-graph capturable)."""
    _check(a, a_scale, w, w_scale, expert_first_token_offset, out)
    if a.shape[0] == 0:
        return out
    num_experts, n, k = w.shape
    cfg = config or default_config(a.shape[0], num_experts)
    # At most min(E, R) experts have rows, each with one partial tile.
    max_tiles = triton.cdiv(a.shape[0], cfg.block_m) + min(num_experts, a.shape[0])
    grid = (max_tiles * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_fp8_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        expert_first_token_offset,
        out,
        n,
        k,
        num_experts,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def grouped_gemm_fp8_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Plain PyTorch, fp32 per expert: the oracle in tests."""
    _check(a, a_scale, w, w_scale, expert_first_token_offset, out)
    bounds = expert_first_token_offset.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            product = a[lo:hi].float() @ w[e].float().t()
            out[lo:hi] = (product * a_scale[lo:hi, None] * w_scale[e]).to(out.dtype)
    return out
