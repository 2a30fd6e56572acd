"""The gated warp-specialized grouped GEMM for Hopper (Gluon): the first
expert GEMM with the permute and the gated activation fused in. Row ``r``
gathers its token's row (``src_routes[r] // topk``) from the unpermuted
input by ``cp.async`` while the weights (w13, gate and up rows interleaved)
arrive by TMA; the epilogue writes ``act(gate, up)``, or that as fp8 with one
scale per row and 128 columns (``QUANT``). Shared pieces and the design:
:mod:`.hopper_common`.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
)

from vllm.model_executor.kernels.common.activation_quant import (
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
)
from vllm.model_executor.kernels.common.device_info import persistent_programs
from vllm.model_executor.kernels.common.gluon_combine import maximum
from vllm.model_executor.kernels.grouped_gemm.hopper_common import (
    _FP8_MAX,
    _MIN_SCALE,
    BLOCK_M,
    BLOCK_N,
    CONSUMER_REGS,
    GATHER_WARPS,
    GROUP,
    K_BYTES,
    LOADER_REGS,
    STAGES,
    SUB,
    _acc_layout,
    _cp_async,
    _expert_tiles,
    _gated_act,
    _itemsize,
    _mainloop,
    _ring,
    _scaled,
    _skip,
    _tile_coords,
    _tma_load,
    _tma_store,
    _total,
    _w_k,
    descriptor,
    k_box,
)
from vllm.model_executor.kernels.grouped_gemm.hopper_uint4 import (
    packed_box,
    w4_buffers,
    w4_mainloop,
    w4_skip,
)


@gluon.jit
def _gather_loader(
    a_ptr,
    src_routes_ptr,
    topk,
    w_desc,
    offsets_ptr,
    W_N,
    K,
    num_experts,
    a_boxes,
    w_boxes,
    ready,
    empty,
    BLOCK_E: gl.constexpr,
):
    """The gated GEMM's loader: each row's token from the unpermuted input by
    cp.async (rows past the expert's end and K read as zeros), the weight
    rows by TMA; the slot is ready when both have landed."""
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
    # 16 bytes per thread, 8 threads per 128-byte row.
    layout: gl.constexpr = gl.BlockedLayout(
        [1, BLOCK_K // 8], [4, 8], [GATHER_WARPS, 1], [1, 0]
    )
    experts, starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_E, GATHER_WARPS
    )
    n_tiles = (W_N + BLOCK_N - 1) // BLOCK_N
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    step = 0
    for tile in range(gl.program_id(0), _total(tiles) * n_tiles, gl.num_programs(0)):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, experts, starts, ends, tiles, tiles_end
        )
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        row_ok = rows < row_end
        tokens = gl.load(src_routes_ptr + rows, mask=row_ok, other=0) // topk
        a_rows = a_ptr + tokens[:, None].to(gl.int64) * K + cols[None, :]
        for k in range(0, K, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), (step // STAGES) & 1)
            _cp_async(
                a_boxes.index(slot),
                a_rows + k,
                mask=row_ok[:, None] & (cols + k < K)[None, :],
            )
            # Each thread's arrival waits for its copies (one of the
            # GATHER_WARPS * 32 + 1 arrivals the slot expects).
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            mbarrier.expect(
                ready.index(slot),
                BLOCK_N * w_boxes.shape[2] * _itemsize(w_boxes.dtype),
            )
            _tma_load(
                w_desc,
                [expert * W_N + n_tile * BLOCK_N, _w_k(k, a_boxes, w_boxes)],
                ready.index(slot),
                w_boxes.index(slot),
            )
            step += 1


@gluon.jit
def _gated_consumer(
    shared,
    w4,
    HALF: gl.constexpr,
    MODE: gl.constexpr,
    ALPHA: gl.constexpr,
    LIMIT: gl.constexpr,
    QUANT: gl.constexpr,
    W4: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    (
        a_scale_ptr,
        src_routes_ptr,
        topk,
        w_scale_ptr,
        w_steps_ptr,
        offsets_ptr,
        out_ptr,
        out_desc,
        out_scale_ptr,
        inter,
        K,
        num_experts,
        a_boxes,
        w_boxes,
        ready,
        empty,
    ) = shared
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
    OUT_N: gl.constexpr = BLOCK_N // 2  # gate and up columns interleaved
    acc_layout: gl.constexpr = _acc_layout(a_boxes.dtype)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    staging = gl.allocate_shared_memory(out_desc.dtype, [SUB, OUT_N], out_desc.layout)
    experts, starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_E, 4
    )
    n_tiles = (2 * inter + BLOCK_N - 1) // BLOCK_N
    step = 0
    for tile in range(gl.program_id(0), _total(tiles) * n_tiles, gl.num_programs(0)):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, experts, starts, ends, tiles, tiles_end
        )
        first_row = row_start + HALF * SUB
        # W4: the tile's first column's scale steps, its real columns, 2 * inter.
        w4_steps = (
            w_steps_ptr + expert * (K // GROUP) * 2 * inter + n_tile * BLOCK_N,
            2 * inter - n_tile * BLOCK_N,
            2 * inter,
        )
        if first_row < row_end:
            w_rows = n_tile * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)
            )
            if not W4:
                acc, _, step = _mainloop(
                    a_boxes,
                    w_boxes,
                    ready,
                    empty,
                    step,
                    K,
                    None,
                    None,
                    HALF,
                    True,
                    False,
                )
            else:
                acc, step = w4_mainloop(
                    a_boxes,
                    w_boxes,
                    ready,
                    empty,
                    step,
                    K,
                    w4,
                    w4_steps,
                    HALF,
                    True,
                )
            if _scaled(a_boxes.dtype):
                rows = first_row + gl.arange(
                    0, SUB, layout=gl.SliceLayout(1, acc_layout)
                )
                row_ok = rows < row_end
                tokens = gl.load(src_routes_ptr + rows, mask=row_ok, other=0) // topk
                a_scale = gl.load(a_scale_ptr + tokens, mask=row_ok, other=0.0)
                w_scale = gl.load(
                    w_scale_ptr + expert * 2 * inter + w_rows,
                    mask=w_rows < 2 * inter,
                    other=0.0,
                )
                acc = acc * a_scale[:, None] * w_scale[None, :]
            gate, up = gl.split(gl.reshape(acc, (SUB, OUT_N, 2)))
            y = _gated_act(gate, up, MODE, ALPHA, LIMIT)
            if QUANT:  # fp8 with one scale per row of this tile's GROUP columns
                amax = gl.reduce(gl.abs(y), 1, maximum)
                scale = gl.maximum(amax, _MIN_SCALE) / _FP8_MAX
                # |y| / scale <= FP8_MAX up to rounding: no clamp needed.
                y = y * (1.0 / scale)[:, None]
                scale_rows = first_row + gl.arange(0, SUB, layout=scale.type.layout)
                gl.store(
                    out_scale_ptr + scale_rows * n_tiles + n_tile,
                    scale,
                    mask=scale_rows < row_end,
                )
            y = gl.convert_layout(y.to(out_desc.dtype), out_layout)
            if row_end - first_row >= SUB:
                tma.store_wait(0)  # the previous tile's store has left staging
                staging.store(y)
                fence_async_shared()
                _tma_store(out_desc, [first_row, n_tile * OUT_N], staging)
            else:
                out_rows = first_row + gl.arange(
                    0, SUB, layout=gl.SliceLayout(1, out_layout)
                )
                out_cols = n_tile * OUT_N + gl.arange(
                    0, OUT_N, layout=gl.SliceLayout(0, out_layout)
                )
                gl.store(
                    out_ptr
                    + out_rows[:, None].to(gl.int64) * inter
                    + out_cols[None, :],
                    y,
                    mask=(out_rows < row_end)[:, None] & (out_cols < inter)[None, :],
                )
        elif not W4:
            step = _skip(ready, empty, step, K, BLOCK_K)
        else:
            step = w4_skip(w_boxes, ready, empty, step, K, w4, w4_steps, BLOCK_K, HALF)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_gated_warp_specialized_kernel(
    a_ptr,
    a_scale_ptr,
    src_routes_ptr,
    w_desc,
    w_scale_ptr,
    w_steps_ptr,
    offsets_ptr,
    out_ptr,
    out_desc,
    out_scale_ptr,
    inter,
    K,
    num_experts,
    topk,
    MODE: gl.constexpr,
    ALPHA: gl.constexpr,
    LIMIT: gl.constexpr,
    QUANT: gl.constexpr,
    W4: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    a_dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, K_BYTES // _itemsize(a_dtype)], a_dtype
    )
    # A slot is ready once every gathering thread's copies and the weights'
    # TMA box have landed.
    a_boxes, w_boxes, ready, empty = _ring(
        a_dtype, a_layout, w_desc, GATHER_WARPS * 32 + 1
    )
    # warp_specialize takes no None: without W4 the tuple is never read.
    w4 = w4_buffers(a_dtype) if W4 else (w_boxes, ready, empty)
    shared = (  # the consumers' arguments, but for their half
        a_scale_ptr,
        src_routes_ptr,
        topk,
        w_scale_ptr,
        w_steps_ptr,
        offsets_ptr,
        out_ptr,
        out_desc,
        out_scale_ptr,
        inter,
        K,
        num_experts,
        a_boxes,
        w_boxes,
        ready,
        empty,
    )
    gl.warp_specialize(
        [
            (_gated_consumer, (shared, w4, 0, MODE, ALPHA, LIMIT, QUANT, W4, BLOCK_E)),
            (_gated_consumer, (shared, w4, 1, MODE, ALPHA, LIMIT, QUANT, W4, BLOCK_E)),
            (
                _gather_loader,
                (
                    a_ptr,
                    src_routes_ptr,
                    topk,
                    w_desc,
                    offsets_ptr,
                    2 * inter,
                    K,
                    num_experts,
                    a_boxes,
                    w_boxes,
                    ready,
                    empty,
                    BLOCK_E,
                ),
            ),
        ],
        [4, GATHER_WARPS],
        [CONSUMER_REGS, LOADER_REGS],
    )


def launch_gated(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
    w13_steps: torch.Tensor | None = None,
) -> None:
    """Runs the gated kernel on arguments :func:`~.api.grouped_gemm_gated`
    (or :func:`~.w4a8.grouped_gemm_w4a8_gated`) has checked (shapes, dtypes,
    TMA alignment of ``w13``) and :func:`~.dispatch.hopper_supports_gated`
    accepts; scales and packed uint4 weights (``w13_steps``) as in
    :func:`~.hopper_plain.launch`, and an fp8 ``out`` takes per-group row
    scales ``out_scale`` [R, act_groups(I)]."""
    assert (a_scale is None) == (w13_scale is None) == (a.element_size() == 2)
    num_experts, w_n, k = *w13.shape[:2], a.shape[1]
    rows, inter = out.shape
    programs = persistent_programs(
        a.device, rows, num_experts, BLOCK_M.value, triton.cdiv(w_n, BLOCK_N.value)
    )
    _grouped_gemm_gated_warp_specialized_kernel[(programs,)](
        a,
        out if a_scale is None else a_scale,  # scales are never read for 16 bits
        src_routes,
        packed_box(w13.view(num_experts * w_n, -1), a)
        if w13_steps is not None
        else k_box(w13.view(num_experts * w_n, -1), BLOCK_N.value),
        out if w13_scale is None else w13_scale,
        out if w13_steps is None else w13_steps,
        expert_first_token_offset,
        out,
        descriptor(out, [SUB.value, BLOCK_N.value // 2]),
        out if out_scale is None else out_scale,  # never read without QUANT
        inter,
        k,
        num_experts,
        topk,
        MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA,
        LIMIT=SWIGLU_LIMIT,
        QUANT=out_scale is not None,
        W4=w13_steps is not None,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=4,
    )
