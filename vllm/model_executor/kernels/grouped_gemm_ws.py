"""Warp-specialized grouped GEMMs for Hopper (Gluon): the sm90 path of
:func:`~vllm.model_executor.kernels.grouped_gemm_fp8.grouped_gemm_fp8` and
``grouped_gemm_fp8_gated`` for 128-row tiles, and the only path of their
16-bit counterparts in :mod:`grouped_gemm_bf16`.

Same contracts as the Triton kernels (fp8 with per-row and per-channel
scales, or bf16/fp16 without; the permute's expert offsets, rows at or past
``offsets[E]`` never written), plus the activation quantized in groups
(below), laid out with explicit warp roles, which Triton's ``tl.dot``
pipeline cannot express:

- a loader partition fills a ring of ``STAGES`` slots (a ready and an empty
  mbarrier each): one warp issuing TMA boxes for A rows and weight rows, or
  for the gated GEMM four warps gathering each row's token with 16-byte
  ``cp.async`` copies beside the weights' TMA box;
- two 4-warp consumer warpgroups each own 64 rows of the 128-row tile and
  share its weight box. The second skips its MMAs when its rows lie past the
  expert's end, so the last tile of an expert costs half when it is at most
  half full (random routing leaves ~13% of 128-row tiles padding);
- a consumer stores a full 64-row half through a TMA box from shared memory
  and moves on while the store drains; a partial half takes masked stores.

The gated kernel can write its activation as fp8 with one scale per row of
each 128-column output tile (``QUANT``), and the plain kernel take such
per-group scales (``GROUPED``): it carries its accumulator in units of the
current K step's row scales, rescaling it between steps.

Persistent like the Triton kernel: each program walks the same (row tile,
N tile) order, and all three partitions derive it from the offsets.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vllm.model_executor.kernels.common.activation_quant import (
    FP8_MAX,
    MIN_SCALE,
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
)
from vllm.model_executor.kernels.common.device_info import (
    is_hopper,
    persistent_programs,
)

# Triton 3.6 (the H200 here) names the TMA copies async_copy_*; later
# versions call them async_load / async_store and make the old names raise.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cp_async = (
    getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
)

BLOCK_M = gl.constexpr(128)  # two consumer warpgroups x 64 rows
BLOCK_N = gl.constexpr(256)
# Bytes of K per ring step: one 128-byte swizzled row of each box (fp8 128
# columns, 16-bit 64), so both dtypes move the same bytes per step.
K_BYTES = gl.constexpr(128)
# 3 x 48 KiB of boxes + store staging (2 x 32 KiB; gated 2 x 16 KiB, or
# 2 x 8 KiB for its fp8 output).
STAGES = gl.constexpr(3)
SUB = gl.constexpr(64)  # rows per consumer warpgroup
# Registers per thread: the consumers hold their accumulator (128) and
# epilogue; the loaders the per-expert tile table. ptxas -v (Triton 3.6):
# no spills in the plain kernel at 128 experts (fp8 4 bytes at 256); 64-80
# bytes in the fp8 gated one (bf16: 16-52), on the once-per-tile path
# (other splits spill more).
CONSUMER_REGS = gl.constexpr(232)
LOADER_REGS = gl.constexpr(40)
GATHER_WARPS = gl.constexpr(4)  # the gated GEMM's loader: 16 bytes per thread
# Columns per scale of a group-quantized activation: the gated GEMM's output
# tile quantizes itself, and the plain GEMM takes one group per K step.
GROUP = gl.constexpr(128)
# One fp8 K step (K_BYTES one-byte columns) and half a gated output tile.
assert GROUP.value == K_BYTES.value == BLOCK_N.value // 2
_FP8_MAX = gl.constexpr(FP8_MAX)
_MIN_SCALE = gl.constexpr(MIN_SCALE)

_GL_DTYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
}


# The activation as the Triton GEMMs apply it, compiled as Gluon.
_gated_act = gluon.jit(gated_act.fn)


@gluon.constexpr_function
def _itemsize(dtype: gl.dtype) -> int:
    return dtype.primitive_bitwidth // 8


@gluon.constexpr_function
def _scaled(dtype: gl.dtype) -> bool:
    """fp8 operands carry scales; 16-bit ones do not."""
    return dtype.primitive_bitwidth == 8


@gluon.constexpr_function
def _acc_layout(dtype: gl.dtype) -> gl.NVMMADistributedLayout:
    """A consumer's 64 x BLOCK_N fp32 accumulator, one wgmma warpgroup whose
    instruction K is 32 bytes of the operand dtype."""
    instr_k = 256 // dtype.primitive_bitwidth
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N.value, instr_k]
    )


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _maximum(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _total(x):
    # gl.reduce, not gl.sum: gl.sum wraps a Triton jit function, which
    # TRITON_INTERPRET (the CPU tests) turns into one Gluon cannot compile.
    return gl.reduce(x, 0, _add)


@gluon.jit
def _expert_tiles(offsets_ptr, num_experts, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
    """(experts, starts, ends, row tiles, inclusive prefix sum of the tiles)
    in a layout of the calling partition's ``WARPS`` warps."""
    experts = gl.arange(0, BLOCK_E, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    valid = experts < num_experts
    starts = gl.load(offsets_ptr + experts, mask=valid, other=0).to(gl.int32)
    ends = gl.load(offsets_ptr + experts + 1, mask=valid, other=0).to(gl.int32)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return experts, starts, ends, tiles, gl.associative_scan(tiles, 0, _add)


@gluon.jit
def _tile_coords(tile, n_tiles, experts, starts, ends, tiles, tiles_end):
    """(expert, first row, row end, N tile) of ``tile``; N tiles vary
    fastest, as in the Triton kernel."""
    m_tile = tile // n_tiles
    expert = _total((tiles_end <= m_tile).to(gl.int32))
    mine = experts == expert
    first_tile = _total(gl.where(mine, tiles_end - tiles, 0))
    row_end = _total(gl.where(mine, ends, 0))
    first_row = _total(gl.where(mine, starts, 0))
    return expert, first_row + (m_tile - first_tile) * BLOCK_M, row_end, tile % n_tiles


@gluon.jit
def _mainloop(
    a_boxes,
    w_boxes,
    ready,
    empty,
    step,
    K,
    group_scales,
    row_ok,
    HALF: gl.constexpr,
    GATHERED: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """This warpgroup's 64 x BLOCK_N accumulator over K, from the ring slots
    ``step``, ``step + 1``, ...; returns it, its rows' scales and the next
    step.

    GROUPED: A's K step ``g`` (one GROUP) holds values in units of its own
    row scales (``group_scales + g``). The accumulator is carried in units
    of the current step's scales: rescaled by old / new before each step's
    MMA, which needs the previous MMA finished. It is returned with the last
    step's scales. Otherwise the scales are ones."""
    BLOCK_K: gl.constexpr = w_boxes.shape[2]
    acc_layout: gl.constexpr = _acc_layout(w_boxes.dtype)
    acc = gl.zeros((SUB, BLOCK_N), gl.float32, acc_layout)
    scale = gl.full((SUB,), 1.0, gl.float32, gl.SliceLayout(1, acc_layout))
    prev_slot = 0
    for k in range(0, K, BLOCK_K):
        slot = step % STAGES
        if GROUPED:  # issued before the waits, which hide its latency
            next_scale = gl.load(group_scales + k // GROUP, mask=row_ok, other=1.0)
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if GATHERED:  # cp.async wrote the A rows: order them before the MMA's reads
            fence_async_shared()
        if GROUPED:
            if k > 0:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc = acc * (scale / next_scale)[:, None]
            scale = next_scale
        acc = warpgroup_mma(
            a_boxes.index(slot).slice(HALF * SUB, SUB, dim=0),
            w_boxes.index(slot).permute((1, 0)),
            acc,
            is_async=True,
        )
        # One MMA in flight: the previous one is done with its slot.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:
            mbarrier.arrive(empty.index(prev_slot), count=1)
        prev_slot = slot
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(prev_slot), count=1)
    return acc, scale, step


@gluon.jit
def _skip(ready, empty, step, K, BLOCK_K: gl.constexpr):
    """No rows in this warpgroup's half: release the slots the loader fills."""
    for _ in range(0, K, BLOCK_K):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        mbarrier.arrive(empty.index(slot), count=1)
        step += 1
    return step


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
    BLOCK_K: gl.constexpr = w_boxes.shape[2]
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
                (BLOCK_M + BLOCK_N) * BLOCK_K * _itemsize(w_boxes.dtype),
            )
            _tma_load(a_desc, [row_start, k], ready.index(slot), a_boxes.index(slot))
            _tma_load(
                w_desc,
                [expert * N + n_tile * BLOCK_N, k],
                ready.index(slot),
                w_boxes.index(slot),
            )
            step += 1


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, GROUPED: gl.constexpr, BLOCK_E: gl.constexpr):
    (
        a_scale_ptr,
        w_scale_ptr,
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
    acc_layout: gl.constexpr = _acc_layout(w_boxes.dtype)
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
        if first_row < row_end:
            rows = first_row + gl.arange(0, SUB, layout=gl.SliceLayout(1, acc_layout))
            row_ok = rows < row_end
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
            cols = n_tile * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)
            )
            if _scaled(w_boxes.dtype):
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
        else:
            step = _skip(ready, empty, step, K, w_boxes.shape[2])
    tma.store_wait(0)


@gluon.jit
def _ring(
    a_dtype: gl.constexpr,
    a_layout: gl.constexpr,
    w_desc,
    READY_ARRIVALS: gl.constexpr,
):
    """The loader's ring of STAGES slots: A boxes (BLOCK_M rows), weight
    boxes (BLOCK_N rows), both of the host's K box, and per slot a ready
    barrier (``READY_ARRIVALS`` arrivals) and an empty one that both
    consumers release; every slot starts free."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    a_boxes = gl.allocate_shared_memory(a_dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_boxes = gl.allocate_shared_memory(
        w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=2)
        mbarrier.arrive(empty.index(i), count=2)
    return a_boxes, w_boxes, ready, empty


@gluon.jit
def _grouped_gemm_ws_kernel(
    a_desc,
    w_desc,
    a_scale_ptr,
    w_scale_ptr,
    offsets_ptr,
    out_ptr,
    out_desc,
    N,
    K,
    groups,
    num_experts,
    GROUPED: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    a_boxes, w_boxes, ready, empty = _ring(
        a_desc.dtype, gl.constexpr(a_desc.layout), w_desc, 1
    )
    # The consumers' arguments, but for their half (Gluon cannot concatenate
    # tuples in warp_specialize's argument lists).
    shared = (
        a_scale_ptr,
        w_scale_ptr,
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
            (_consumer, (shared, 0, GROUPED, BLOCK_E)),
            (_consumer, (shared, 1, GROUPED, BLOCK_E)),
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
    BLOCK_K: gl.constexpr = w_boxes.shape[2]
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
                ready.index(slot), BLOCK_N * BLOCK_K * _itemsize(w_boxes.dtype)
            )
            _tma_load(
                w_desc,
                [expert * W_N + n_tile * BLOCK_N, k],
                ready.index(slot),
                w_boxes.index(slot),
            )
            step += 1


@gluon.jit
def _gated_consumer(
    shared,
    HALF: gl.constexpr,
    MODE: gl.constexpr,
    ALPHA: gl.constexpr,
    LIMIT: gl.constexpr,
    QUANT: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    (
        a_scale_ptr,
        src_routes_ptr,
        topk,
        w_scale_ptr,
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
    OUT_N: gl.constexpr = BLOCK_N // 2  # gate and up columns interleaved
    acc_layout: gl.constexpr = _acc_layout(w_boxes.dtype)
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
        if first_row < row_end:
            acc, _, step = _mainloop(
                a_boxes, w_boxes, ready, empty, step, K, None, None, HALF, True, False
            )
            if _scaled(w_boxes.dtype):
                rows = first_row + gl.arange(
                    0, SUB, layout=gl.SliceLayout(1, acc_layout)
                )
                row_ok = rows < row_end
                tokens = gl.load(src_routes_ptr + rows, mask=row_ok, other=0) // topk
                a_scale = gl.load(a_scale_ptr + tokens, mask=row_ok, other=0.0)
                w_rows = n_tile * BLOCK_N + gl.arange(
                    0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)
                )
                w_scale = gl.load(
                    w_scale_ptr + expert * 2 * inter + w_rows,
                    mask=w_rows < 2 * inter,
                    other=0.0,
                )
                acc = acc * a_scale[:, None] * w_scale[None, :]
            gate, up = gl.split(gl.reshape(acc, (SUB, OUT_N, 2)))
            y = _gated_act(gate, up, MODE, ALPHA, LIMIT)
            if QUANT:  # fp8 with one scale per row of this tile's GROUP columns
                amax = gl.reduce(gl.abs(y), 1, _maximum)
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
        else:
            step = _skip(ready, empty, step, K, w_boxes.shape[2])
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_gated_ws_kernel(
    a_ptr,
    a_scale_ptr,
    src_routes_ptr,
    w_desc,
    w_scale_ptr,
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
    BLOCK_E: gl.constexpr,
):
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, w_desc.block_type.shape[1]], w_desc.dtype
    )
    # A slot is ready once every gathering thread's copies and the weights'
    # TMA box have landed.
    a_boxes, w_boxes, ready, empty = _ring(
        w_desc.dtype, a_layout, w_desc, GATHER_WARPS * 32 + 1
    )
    shared = (  # the consumers' arguments, but for their half
        a_scale_ptr,
        src_routes_ptr,
        topk,
        w_scale_ptr,
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
            (_gated_consumer, (shared, 0, MODE, ALPHA, LIMIT, QUANT, BLOCK_E)),
            (_gated_consumer, (shared, 1, MODE, ALPHA, LIMIT, QUANT, BLOCK_E)),
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


def supports_gated(a: torch.Tensor, inter: int, out: torch.Tensor) -> bool:
    """Whether the gated kernel can run the call: :func:`supports`, and token
    rows that 16-byte copies can read. The callers check K a multiple of 16
    with ``w13``: the compiler proves the rows 16-byte aligned only from
    that."""
    return supports(a.device, inter, out) and a.data_ptr() % 16 == 0


def supports(device: torch.device, n: int, out: torch.Tensor) -> bool:
    """Whether this kernel can run the call: a Hopper GPU (sm90), and an
    ``out`` [R, n] whose rows a TMA box can store (16-byte aligned start and
    rows)."""
    return (
        is_hopper(device)
        and n * out.element_size() % 16 == 0
        and out.data_ptr() % 16 == 0
    )


@functools.cache  # building the layout costs ~6 us of host time per call
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def _k_box(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A ring box of ``rows`` rows of operand ``t`` [*, K]: K_BYTES of K."""
    return _descriptor(t, [rows, K_BYTES.value // t.element_size()])


def launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Runs the kernel on arguments ``grouped_gemm_fp8`` or
    ``grouped_gemm_bf16`` has checked (shapes, dtypes, TMA alignment of
    ``a`` and ``w``) and :func:`supports`. fp8 operands come with scales (a
    2-D ``a_scale`` [R, cdiv(K, GROUP)] holds per-group row scales), 16-bit
    ones with ``None``."""
    assert (a_scale is None) == (w_scale is None) == (a.element_size() == 2)
    num_experts, n, k = w.shape
    grouped = a_scale is not None and a_scale.dim() == 2
    groups = a_scale.shape[1] if a_scale is not None and grouped else 1
    programs = persistent_programs(
        a.device, a.shape[0], num_experts, BLOCK_M.value, triton.cdiv(n, BLOCK_N.value)
    )
    _grouped_gemm_ws_kernel[(programs,)](
        _k_box(a, BLOCK_M.value),
        _k_box(w.view(-1, k), BLOCK_N.value),
        out if a_scale is None else a_scale,  # scales are never read for 16 bits
        out if w_scale is None else w_scale,
        expert_first_token_offset,
        out,
        _descriptor(out, [SUB.value, BLOCK_N.value]),
        n,
        k,
        groups,
        num_experts,
        GROUPED=grouped,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=4,
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
) -> None:
    """Runs the gated kernel on arguments ``grouped_gemm_fp8_gated`` or
    ``grouped_gemm_bf16_gated`` has checked (shapes, dtypes, TMA alignment of
    ``w13``) and :func:`supports_gated`; scales as in :func:`launch`, and an
    fp8 ``out`` takes per-group row scales ``out_scale`` [R, cdiv(I, GROUP)]."""
    assert (a_scale is None) == (w13_scale is None) == (a.element_size() == 2)
    num_experts, w_n, k = w13.shape
    rows, inter = out.shape
    programs = persistent_programs(
        a.device, rows, num_experts, BLOCK_M.value, triton.cdiv(w_n, BLOCK_N.value)
    )
    _grouped_gemm_gated_ws_kernel[(programs,)](
        a,
        out if a_scale is None else a_scale,  # scales are never read for 16 bits
        src_routes,
        _k_box(w13.view(-1, k), BLOCK_N.value),
        out if w13_scale is None else w13_scale,
        expert_first_token_offset,
        out,
        _descriptor(out, [SUB.value, BLOCK_N.value // 2]),
        out if out_scale is None else out_scale,  # never read without QUANT
        inter,
        k,
        num_experts,
        topk,
        MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA,
        LIMIT=SWIGLU_LIMIT,
        QUANT=out_scale is not None,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=4,
    )
