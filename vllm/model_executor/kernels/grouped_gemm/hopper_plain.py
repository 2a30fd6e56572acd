"""The plain warp-specialized grouped GEMM for Hopper (Gluon):
``out[r] = (a[r] @ w[e]^T)`` times the row and channel scales for fp8
operands, for the rows ``r`` of expert ``e``. A one-warp loader issues the
A and weight TMA boxes; the consumers' epilogue scales (per row, or per
group of 128 K columns: ``GROUPED``) and stores. Shared pieces and the
design: :mod:`.hopper_common`.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from vllm.model_executor.kernels.common.device_info import persistent_programs
from vllm.model_executor.kernels.grouped_gemm.hopper_common import (
    BLOCK_M,
    BLOCK_N,
    CONSUMER_REGS,
    GROUP,
    LOADER_REGS,
    STAGES,
    SUB,
    _acc_layout,
    _expert_tiles,
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
def _loader(
    a_desc,
    w_desc,
    offsets_ptr,
    N,
    K,
    num_experts,
    a_boxes,
    w_boxes,
    ready,
    empty,
    BLOCK_E: gl.constexpr,
):
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
    experts, starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_E, 1
    )
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    step = 0  # k steps issued: slot step % STAGES, in round step // STAGES
    for tile in range(gl.program_id(0), _total(tiles) * n_tiles, gl.num_programs(0)):
        expert, row_start, _, n_tile = _tile_coords(
            tile, n_tiles, experts, starts, ends, tiles, tiles_end
        )
        for k in range(0, K, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), (step // STAGES) & 1)
            # Boxes past a tensor's end are zero-filled and still count in full.
            mbarrier.expect(
                ready.index(slot),
                BLOCK_M * BLOCK_K * _itemsize(a_boxes.dtype)
                + BLOCK_N * w_boxes.shape[2] * _itemsize(w_boxes.dtype),
            )
            _tma_load(a_desc, [row_start, k], ready.index(slot), a_boxes.index(slot))
            _tma_load(
                w_desc,
                [expert * N + n_tile * BLOCK_N, _w_k(k, a_boxes, w_boxes)],
                ready.index(slot),
                w_boxes.index(slot),
            )
            step += 1


@gluon.jit
def _consumer(
    shared,
    w4,
    HALF: gl.constexpr,
    GROUPED: gl.constexpr,
    W4: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    (
        a_scale_ptr,
        w_scale_ptr,
        w_steps_ptr,
        offsets_ptr,
        out_ptr,
        out_desc,
        N,
        K,
        groups,
        num_experts,
        a_boxes,
        w_boxes,
        ready,
        empty,
    ) = shared
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
    acc_layout: gl.constexpr = _acc_layout(a_boxes.dtype)
    staging = gl.allocate_shared_memory(out_desc.dtype, [SUB, BLOCK_N], out_desc.layout)
    experts, starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_E, 4
    )
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    step = 0
    for tile in range(gl.program_id(0), _total(tiles) * n_tiles, gl.num_programs(0)):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, experts, starts, ends, tiles, tiles_end
        )
        first_row = row_start + HALF * SUB
        # W4: the tile's first column's scale steps, its real columns, N.
        w4_steps = (
            w_steps_ptr + expert * (K // GROUP) * N + n_tile * BLOCK_N,
            N - n_tile * BLOCK_N,
            N,
        )
        if first_row < row_end:
            rows = first_row + gl.arange(0, SUB, layout=gl.SliceLayout(1, acc_layout))
            row_ok = rows < row_end
            cols = n_tile * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)
            )
            if not W4:
                acc, a_scale, step = _mainloop(
                    a_boxes,
                    w_boxes,
                    ready,
                    empty,
                    step,
                    K,
                    a_scale_ptr + rows * groups,
                    row_ok,
                    HALF,
                    False,
                    GROUPED,
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
                    False,
                )
            if _scaled(a_boxes.dtype):
                if not GROUPED:
                    a_scale = gl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
                w_scale = gl.load(
                    w_scale_ptr + expert * N + cols, mask=cols < N, other=0.0
                )
                acc = acc * a_scale[:, None] * w_scale[None, :]
            y = acc.to(out_desc.dtype)
            if row_end - first_row >= SUB:
                tma.store_wait(0)  # the previous tile's store has left staging
                staging.store(y)
                fence_async_shared()
                _tma_store(out_desc, [first_row, n_tile * BLOCK_N], staging)
            else:
                gl.store(
                    out_ptr + rows[:, None].to(gl.int64) * N + cols[None, :],
                    y,
                    mask=row_ok[:, None] & (cols < N)[None, :],
                )
        elif not W4:
            step = _skip(ready, empty, step, K, BLOCK_K)
        else:
            step = w4_skip(w_boxes, ready, empty, step, K, w4, w4_steps, BLOCK_K, HALF)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_warp_specialized_kernel(
    a_desc,
    w_desc,
    a_scale_ptr,
    w_scale_ptr,
    w_steps_ptr,
    offsets_ptr,
    out_ptr,
    out_desc,
    N,
    K,
    groups,
    num_experts,
    GROUPED: gl.constexpr,
    W4: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    a_boxes, w_boxes, ready, empty = _ring(
        a_desc.dtype, gl.constexpr(a_desc.layout), w_desc, 1
    )
    # warp_specialize takes no None: without W4 the tuple is never read.
    w4 = w4_buffers(a_desc.dtype) if W4 else (w_boxes, ready, empty)
    # The consumers' arguments, but for their half (Gluon cannot concatenate
    # tuples in warp_specialize's argument lists).
    shared = (
        a_scale_ptr,
        w_scale_ptr,
        w_steps_ptr,
        offsets_ptr,
        out_ptr,
        out_desc,
        N,
        K,
        groups,
        num_experts,
        a_boxes,
        w_boxes,
        ready,
        empty,
    )
    gl.warp_specialize(
        [
            (_consumer, (shared, w4, 0, GROUPED, W4, BLOCK_E)),
            (_consumer, (shared, w4, 1, GROUPED, W4, BLOCK_E)),
            (
                _loader,
                (
                    a_desc,
                    w_desc,
                    offsets_ptr,
                    N,
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
        [4, 1],  # the second consumer warpgroup, the loader warp
        [CONSUMER_REGS, LOADER_REGS],
    )


def launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    w_steps: torch.Tensor | None = None,
) -> None:
    """Runs the kernel on arguments :func:`~.api.grouped_gemm` (or
    :func:`~.w4a8.grouped_gemm_w4a8`, :func:`~..marlin.gemm.marlin_gemm_grouped`)
    has checked (shapes, dtypes, TMA alignment of ``a`` and ``w``) and
    :func:`~.dispatch.hopper_supports` accepts. fp8 operands come with scales
    (a 2-D ``a_scale`` [R, act_groups(K)] holds per-group row scales), 16-bit
    ones with ``None``. With ``w_steps``, ``w`` [E, N, *] holds packed uint4
    weights (K // 2 bytes a row, in any dtype), and ``w_steps`` are, with fp8
    ``a``, ``w_scale``'s :func:`~.hopper_uint4.w4_scale_steps`, or with
    16-bit ``a`` the Marlin group scales [E, K // 128, N] (no ``w_scale``)."""
    assert (a_scale is None) == (w_scale is None) == (a.element_size() == 2)
    num_experts, n, k = *w.shape[:2], a.shape[1]
    w = w.view(num_experts * n, -1)
    grouped = a_scale is not None and a_scale.dim() == 2
    groups = a_scale.shape[1] if a_scale is not None and grouped else 1
    programs = persistent_programs(
        a.device, a.shape[0], num_experts, BLOCK_M.value, triton.cdiv(n, BLOCK_N.value)
    )
    _grouped_gemm_warp_specialized_kernel[(programs,)](
        k_box(a, BLOCK_M.value),
        k_box(w, BLOCK_N.value)
        if w_steps is None
        else packed_box(w.view(torch.uint8), a),
        out if a_scale is None else a_scale,  # scales are never read for 16 bits
        out if w_scale is None else w_scale,
        out if w_steps is None else w_steps,
        expert_first_token_offset,
        out,
        descriptor(out, [SUB.value, BLOCK_N.value]),
        n,
        k,
        groups,
        num_experts,
        GROUPED=grouped,
        W4=w_steps is not None,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=4,
    )
