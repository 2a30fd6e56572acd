"""FP8 w8a8 grouped GEMMs over expert-contiguous rows (Triton), with
per-row activation scales and per-channel weight scales.

The plain GEMM: ``out[r] = (a[r] @ w[e]^T) * a_scale[r] * w_scale[e]`` for
the rows ``r`` of expert ``e`` (``offsets[e]:offsets[e+1]``, the permute's
``expert_first_token_offset``).

The gated GEMM: the first expert GEMM with the permute and the gated
activation fused in. Row ``r`` reads its token's fp8 row straight from the
unpermuted input (``src_routes[r] // topk``), so no permuted copy of the
activations is written. Its weights are w13 with the gate and up rows
interleaved (:func:`~.layout.interleave_gate_up`), so one 2 x BLOCK_N wide
product tile holds matching gate and up columns and the program writes
``act(gate, up)``: the [R, 2I] intermediate never reaches memory.

Both kernels are persistent: at most one program per SM walks the (row
tile, N tile) pairs, and a flattened loop overlaps one tile's epilogue with
the next tile's loads. The weights (and the plain GEMM's A rows) arrive
through TMA boxes. The grid depends only on the number of rows, never on
the routing, so a launch can be captured in a CUDA graph: each program
reads the offsets once and finds the tile count and each tile's expert by a
prefix sum of the per-expert tile counts. Rows at or past ``offsets[E]`` are
not written.

The launchers take arguments :mod:`.api` has checked, with the tiles
:mod:`.dispatch` chose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.device_info import persistent_programs
from vllm.model_executor.kernels.grouped_gemm.dispatch import GroupedGemmConfig


@triton.jit
def _expert_tiles(
    offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Per-expert row ranges and row-tile counts (loaded once per program):
    (starts, ends, tiles, tiles_end = inclusive prefix sum of tiles)."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    starts = tl.load(offsets_ptr + experts, mask=valid, other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + experts + 1, mask=valid, other=0).to(tl.int32)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    return starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _tile_coords(
    tile,
    n_tiles,
    starts,
    ends,
    tiles,
    tiles_end,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """(expert, first row, row end, N tile) of ``tile`` < the tile count. N
    tiles vary fastest: neighbours share the A rows and the expert's weights
    in L2."""
    m_tile = tile // n_tiles
    # The first expert whose tile range ends after m_tile.
    expert = tl.sum((tiles_end <= m_tile).to(tl.int32))
    mine = tl.arange(0, BLOCK_E) == expert
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0))
    row_end = tl.sum(tl.where(mine, ends, 0))
    row_start = tl.sum(tl.where(mine, starts, 0)) + (m_tile - first_tile) * BLOCK_M
    return expert, row_start, row_end, tile % n_tiles


@triton.jit
def _grouped_gemm_fp8_kernel(
    a_desc,
    a_scale_ptr,
    w_desc,
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
    starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_M, BLOCK_E
    )
    n_tiles = tl.cdiv(N, BLOCK_N)
    # Persistent: the flattened loop overlaps a tile's epilogue with the next
    # tile's loads.
    for tile in tl.range(
        tl.program_id(0), tl.sum(tiles) * n_tiles, tl.num_programs(0), flatten=True
    ):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, starts, ends, tiles, tiles_end, BLOCK_M, BLOCK_E
        )
        # TMA boxes: rows past the expert's end (the next expert's, or zeros
        # past R) and weight rows past N only feed outputs that are not stored.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([row_start, k])
            w = w_desc.load([expert * N + n_tile * BLOCK_N, k])
            acc = tl.dot(a, w.T, acc)

        rows = row_start + tl.arange(0, BLOCK_M)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        col_ok = cols < N
        a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + expert * N + cols, mask=col_ok, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(
            out_ptrs,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _grouped_gemm_fp8_gated_kernel(
    a_ptr,
    a_scale_ptr,
    src_routes_ptr,
    w_desc,
    w_scale_ptr,
    offsets_ptr,
    out_ptr,
    inter,
    K,
    num_experts,
    topk,
    MODE: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_M, BLOCK_E
    )
    n_tiles = tl.cdiv(inter, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0), tl.sum(tiles) * n_tiles, tl.num_programs(0), flatten=True
    ):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, starts, ends, tiles, tiles_end, BLOCK_M, BLOCK_E
        )
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        tokens = tl.load(src_routes_ptr + rows, mask=row_ok, other=0) // topk
        a_ptrs = a_ptr + tokens[:, None].to(tl.int64) * K + ks[None, :]
        # One 2 * BLOCK_N wide TMA box of interleaved w13 rows: gate j, up j, ...
        w_row = expert * 2 * inter + n_tile * 2 * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(
                a_ptrs + k, mask=row_ok[:, None] & (k + ks < K)[None, :], other=0.0
            )
            w = w_desc.load([w_row, k])
            acc = tl.dot(a, w.T, acc)

        w_rows = n_tile * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        w_ok = w_rows < 2 * inter
        a_scale = tl.load(a_scale_ptr + tokens, mask=row_ok, other=0.0)
        w_scale = tl.load(
            w_scale_ptr + expert * 2 * inter + w_rows, mask=w_ok, other=0.0
        )
        acc = acc * a_scale[:, None] * w_scale[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        y = gated_act(gate, up, MODE, ALPHA, LIMIT)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :]
        tl.store(
            out_ptrs,
            y.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols < inter)[None, :],
        )


def launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig,
) -> None:
    """The plain kernel on ``a`` [R, K] fp8 with ``a_scale`` [R] and ``w``
    [E, N, K] fp8 with ``w_scale`` [E, N], into ``out`` [R, N]."""
    num_experts, n, k = w.shape
    programs = persistent_programs(
        a.device,
        a.shape[0],
        num_experts,
        config.block_m,
        triton.cdiv(n, config.block_n),
    )
    _grouped_gemm_fp8_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [config.block_m, config.block_k]),
        a_scale,
        TensorDescriptor.from_tensor(w.view(-1, k), [config.block_n, config.block_k]),
        w_scale,
        expert_first_token_offset,
        out,
        n,
        k,
        num_experts,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def launch_gated(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    config: GroupedGemmConfig,
) -> None:
    """The gated kernel on tokens ``a`` [T, K] fp8 with ``a_scale`` [T],
    gathered through ``src_routes`` [R], and interleaved ``w13`` [E, 2I, K]
    fp8 with ``w13_scale`` [E, 2I], into ``out`` [R, I] (bf16 or fp16)."""
    num_experts, _, k = w13.shape
    rows, inter = out.shape
    programs = persistent_programs(
        a.device, rows, num_experts, config.block_m, triton.cdiv(inter, config.block_n)
    )
    w_box = [2 * config.block_n, config.block_k]
    _grouped_gemm_fp8_gated_kernel[(programs,)](
        a,
        a_scale,
        src_routes,
        TensorDescriptor.from_tensor(w13.view(-1, k), w_box),
        w13_scale,
        expert_first_token_offset,
        out,
        inter,
        k,
        num_experts,
        topk,
        MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA,
        LIMIT=SWIGLU_LIMIT,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
