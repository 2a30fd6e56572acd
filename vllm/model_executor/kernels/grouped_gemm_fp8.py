"""FP8 w8a8 grouped GEMMs over expert-contiguous rows (Triton).

``grouped_gemm_fp8``: ``out[r] = (a[r] @ w[e]^T) * a_scale[r] * w_scale[e]``
for the rows ``r`` of expert ``e`` (``offsets[e]:offsets[e+1]``, the
permute's ``expert_first_token_offset``).

``grouped_gemm_fp8_gated``: the first expert GEMM with the permute and the
gated activation fused in. Row ``r`` reads its token's fp8 row straight from
the unpermuted input (``src_routes[r] // topk``), so no permuted copy of the
activations is written. Its weights are w13 with the gate and up rows
interleaved (``interleave_gate_up``), so one 2 x BLOCK_N wide product tile
holds matching gate and up columns and the program writes ``act(gate, up)``:
the [R, 2I] intermediate never reaches memory.

On Hopper the gated GEMM can also quantize its output (fp8, one scale per
row and group of 128 columns, which a product tile holds whole) and the
plain one take those group scales: then no pass over the activation is left
between the GEMMs.

Both kernels are persistent: at most one program per SM walks the (row
tile, N tile) pairs, and a flattened loop overlaps one tile's epilogue with
the next tile's loads. The weights (and ``grouped_gemm_fp8``'s A rows)
arrive through TMA boxes. The grid depends only on the number of rows,
never on the routing, so a launch can be captured in a CUDA graph: each
program reads the offsets once and finds the tile count and each tile's
expert by a prefix sum of the per-expert tile counts. Rows at or past
``offsets[E]`` are not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm.model_executor.kernels import grouped_gemm_ws as gluon_ws
from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.checks import check_contiguous, check_tma_rows
from vllm.model_executor.kernels.common.device_info import persistent_programs
from vllm.model_executor.kernels.common.fp8 import (
    per_token_group_quant_fp8,
)

FP8_DTYPE = torch.float8_e4m3fn


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


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[..., 2I, ...] gate rows then up rows -> rows gate 0, up 0, gate 1, ...
    (dimension 1: w13 [E, 2I, K] or its scales [E, 2I])."""
    e, n = w13.shape[:2]
    return w13.view(e, 2, n // 2, *w13.shape[2:]).transpose(1, 2).reshape(w13.shape)


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_gate_up`, along dimension 1."""
    e, n = w13.shape[:2]
    return w13.view(e, n // 2, 2, *w13.shape[2:]).transpose(1, 2).reshape(w13.shape)


@dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int
    block_n: int  # the gated GEMM: output columns (a 2 x block_n product tile)
    block_k: int
    num_warps: int
    num_stages: int


def default_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The fastest checked tiles on the H200 (benchmark_grouped_gemm_fp8
    --sweep): short row groups waste less of a 64-row tile; above 64 rows
    per expert, 128 x 256 tiles halve the A re-reads."""
    if rows <= 64 * num_experts:
        return GroupedGemmConfig(64, 256, 128, 4, 4)
    return GroupedGemmConfig(128, 256, 128, 8, 4)


def default_gated_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The fastest checked on the H200 (benchmark_grouped_gemm_fp8 --sweep):
    below a row per expert (decode) 64 x 128 product tiles spread the weight
    reads over more SMs; 64 x 256 up to 32 rows per expert, 128 x 256
    above."""
    if rows < num_experts:
        return GroupedGemmConfig(64, 64, 128, 4, 4)
    if rows <= 32 * num_experts:
        return GroupedGemmConfig(64, 128, 128, 4, 4)
    return GroupedGemmConfig(128, 128, 128, 8, 4)


def _gluon_tiles(config: GroupedGemmConfig | None, default: GroupedGemmConfig) -> bool:
    # The Gluon kernels replace the default 128-row tiles, never a config.
    return config is None and default.block_m == gluon_ws.BLOCK_M.value


def takes_gluon(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
) -> bool:
    """Whether :func:`grouped_gemm_fp8` runs the Hopper Gluon kernel here:
    no explicit ``config``, 128-row default tiles, a call it supports."""
    return _gluon_tiles(
        config, default_config(a.shape[0], w.shape[0])
    ) and gluon_ws.supports(a.device, w.shape[1], out)


def takes_gluon_gated(
    a: torch.Tensor,
    w13: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
) -> bool:
    """:func:`takes_gluon` for :func:`grouped_gemm_fp8_gated`."""
    return _gluon_tiles(
        config, default_gated_config(out.shape[0], w13.shape[0])
    ) and gluon_ws.supports_gated(a, out.shape[1], out)


def takes_gluon_groups(
    a: torch.Tensor,
    w13: torch.Tensor,
    act_q: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Whether both GEMMs of an expert layer run the Hopper kernels here, so
    that GEMM1 (tokens ``a``, ``w13``) can write its activation ``act_q``
    (fp8 [R, I]) quantized in groups for GEMM2 (``w2``, into ``out``)."""
    return takes_gluon_gated(a, w13, act_q) and takes_gluon(act_q, w2, out)


def _off_hopper(
    what: str, predicate: str, a: torch.Tensor, config: GroupedGemmConfig | None
) -> ValueError:
    """The error for a group-quantized call the Triton kernels would get."""
    return ValueError(
        f"{what} the Hopper kernel ({predicate}), which this call does not take "
        f"(device {a.device}, config {config})"
    )


def act_groups(cols: int) -> int:
    """Scales per row of a group-quantized activation of ``cols`` columns."""
    return triton.cdiv(cols, gluon_ws.GROUP.value)


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
    a_scale_shape = [rows, act_groups(k)] if a_scale.dim() == 2 else [rows]
    for name, tensor, dtype, shape in (
        ("a", a, FP8_DTYPE, [rows, k]),
        ("a_scale", a_scale, torch.float32, a_scale_shape),
        ("w", w, FP8_DTYPE, [num_experts, n, k]),
        ("w_scale", w_scale, torch.float32, [num_experts, n]),
        ("expert_first_token_offset", offsets, torch.int64, [num_experts + 1]),
        ("out", out, out.dtype, [rows, n]),
    ):
        check_contiguous(name, tensor, dtype, shape, w.device)


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
    A 2-D ``a_scale`` [R, act_groups(K)] scales each row's columns in groups
    of 128 (as the gated GEMM's fp8 output writes them; they must be positive
    and finite, since the kernel divides by them); only the Hopper kernel
    takes it.

    The offsets (int64 [E + 1], the permute's) must ascend from 0 to at most
    R: they live on the device and are not checked, so that the call needs no
    host sync and no allocation (CUDA-graph capturable).

    Without a ``config``, 128-row tiles on Hopper run the warp-specialized
    kernel (:mod:`grouped_gemm_ws`, :func:`takes_gluon`), which halves
    the cost of half-empty tiles at expert boundaries; a ``config`` always
    runs this module's."""
    _check(a, a_scale, w, w_scale, expert_first_token_offset, out)
    if a.shape[0] == 0 or w.shape[0] == 0:  # no rows or no experts: nothing to write
        return out
    check_tma_rows("a", a)
    check_tma_rows("w", w)
    num_experts, n, k = w.shape
    rows = a.shape[0]
    if takes_gluon(a, w, out, config):
        gluon_ws.launch(a, a_scale, w, w_scale, expert_first_token_offset, out)
        return out
    if a_scale.dim() == 2:
        raise _off_hopper("a_scale: per-group scales need", "takes_gluon", a, config)
    cfg = config or default_config(rows, num_experts)
    programs = persistent_programs(
        a.device, rows, num_experts, cfg.block_m, triton.cdiv(n, cfg.block_n)
    )
    _grouped_gemm_fp8_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
        a_scale,
        TensorDescriptor.from_tensor(w.view(-1, k), [cfg.block_n, cfg.block_k]),
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


def _check_gated(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    out_scale: torch.Tensor | None,
) -> None:
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2 * I, K], got shape {list(w13.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected [T, K], got shape {list(a.shape)}")
    if out.dim() != 2 or out.dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        raise ValueError(
            f"out: expected a bfloat16, float16 or float8_e4m3fn [R, I], got "
            f"{list(out.shape)} {out.dtype}"
        )
    if (out_scale is None) != (out.dtype != FP8_DTYPE):
        raise ValueError(
            f"out_scale: required for (and only for) an fp8 out; got "
            f"{None if out_scale is None else 'a tensor'} for a {out.dtype} out"
        )
    if activation not in ("silu", "swiglu"):
        raise ValueError(f"activation: expected 'silu' or 'swiglu', got {activation!r}")
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    num_experts, n, k = w13.shape
    tokens, rows = a.shape[0], out.shape[0]
    for name, tensor, dtype, shape in (
        ("a", a, FP8_DTYPE, [tokens, k]),
        ("a_scale", a_scale, torch.float32, [tokens]),
        ("src_routes", src_routes, torch.int32, [rows]),
        ("w13", w13, FP8_DTYPE, [num_experts, n, k]),
        ("w13_scale", w13_scale, torch.float32, [num_experts, n]),
        ("expert_first_token_offset", offsets, torch.int64, [num_experts + 1]),
        ("out", out, out.dtype, [rows, n // 2]),
    ):
        check_contiguous(name, tensor, dtype, shape, w13.device)
    if out_scale is not None:
        shape = [rows, act_groups(n // 2)]
        check_contiguous("out_scale", out_scale, torch.float32, shape, w13.device)


def grouped_gemm_fp8_gated(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = act(gate, up)`` where ``[gate | up]`` is the deinterleaved
    ``(a[t] @ w13[e]^T) * a_scale[t] * w13_scale[e]``, for each row ``r`` below
    ``expert_first_token_offset[-1]``, of expert ``e``, with
    ``t = src_routes[r] // topk``; returns ``out``.

    ``a`` [T, K] fp8 with per-token ``a_scale`` [T]; ``src_routes`` int32
    [R] (the permute's destination -> route index, each < T * topk);
    ``w13`` [E, 2I, K] fp8 with its gate and up rows interleaved
    (:func:`interleave_gate_up`) and ``w13_scale`` [E, 2I] likewise;
    ``out`` [R, I] bf16/fp16, or fp8 quantized per row in groups of 128
    columns with ``out_scale`` [R, act_groups(I)] (``out * out_scale``
    restores the values; only the Hopper kernel writes it, and
    :func:`grouped_gemm_fp8` takes it as ``a``, ``a_scale``). The offsets
    (int64 [E + 1]) must ascend from 0 to at most R; offsets and routes live
    on the device and are not checked (no host sync, CUDA-graph capturable).
    Kernel choice as in :func:`grouped_gemm_fp8`."""
    _check_gated(
        a,
        a_scale,
        src_routes,
        topk,
        w13,
        w13_scale,
        expert_first_token_offset,
        activation,
        out,
        out_scale,
    )
    rows, inter = out.shape
    if rows == 0 or w13.shape[0] == 0:  # no rows or no experts: nothing to write
        return out
    check_tma_rows("w13", w13)
    num_experts, _, k = w13.shape
    if takes_gluon_gated(a, w13, out, config):
        gluon_ws.launch_gated(
            a,
            a_scale,
            src_routes,
            topk,
            w13,
            w13_scale,
            expert_first_token_offset,
            activation,
            out,
            out_scale,
        )
        return out
    if out_scale is not None:
        raise _off_hopper("out: an fp8 out needs", "takes_gluon_gated", a, config)
    cfg = config or default_gated_config(rows, num_experts)
    programs = persistent_programs(
        a.device, rows, num_experts, cfg.block_m, triton.cdiv(inter, cfg.block_n)
    )
    _grouped_gemm_fp8_gated_kernel[(programs,)](
        a,
        a_scale,
        src_routes,
        TensorDescriptor.from_tensor(w13.view(-1, k), [2 * cfg.block_n, cfg.block_k]),
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
            product = dequantize_rows(a[lo:hi], a_scale[lo:hi]) @ w[e].float().t()
            out[lo:hi] = (product * w_scale[e]).to(out.dtype)
    return out


def grouped_gemm_fp8_gated_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch, fp32 per expert: the oracle in tests."""
    _check_gated(
        a,
        a_scale,
        src_routes,
        topk,
        w13,
        w13_scale,
        expert_first_token_offset,
        activation,
        out,
        out_scale,
    )
    bounds = expert_first_token_offset.tolist()
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            tokens = src_routes[lo:hi].long() // topk
            product = a[tokens].float() @ w13[e].float().t()
            product *= a_scale[tokens, None] * w13_scale[e]
            y = gated_act_reference(activation, deinterleave_gate_up(product))
            if out_scale is None:
                out[lo:hi] = y.to(out.dtype)
            else:
                out[lo:hi], out_scale[lo:hi] = quantize_groups_reference(y)
    return out


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 rows ``q`` [R, C] with per-row scales [R] or
    per-group scales [R, act_groups(C)]."""
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(gluon_ws.GROUP.value, 1)[:, : q.shape[1]]


def quantize_groups_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows of ``y`` [R, C] with one scale per row and group of 128
    columns (the gated GEMM's fp8 output; a partial last group is padded
    with zeros), in plain PyTorch."""
    cols, group = y.shape[1], gluon_ws.GROUP.value
    padded = torch.nn.functional.pad(y, (0, act_groups(cols) * group - cols))
    q, scale = per_token_group_quant_fp8(padded, group)
    return q[:, :cols].contiguous(), scale
