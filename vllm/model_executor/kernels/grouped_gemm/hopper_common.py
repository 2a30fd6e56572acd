"""Warp-specialized grouped GEMMs for Hopper (Gluon): the pieces both
kernels share. The plain kernel is :mod:`.hopper_plain`, the gated one
:mod:`.hopper_gated`; :mod:`.dispatch` decides when they run (the sm90 path
of fp8 calls with 128-row tiles, group scales or an fp8 gated output, and
the only path of 16-bit calls), and ``marlin.gemm`` when the plain one runs
W4A16.

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

The Gluon code compiles only for sm90 (CPU tests build it for that target
without running it); importing it needs no GPU.
"""

from __future__ import annotations

import functools

import torch
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

from vllm.model_executor.kernels.common.activation_quant import gated_act
from vllm.model_executor.kernels.common.fp8 import FP8_MAX, MIN_SCALE
from vllm.model_executor.kernels.common.gluon_combine import add

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
# 2 x 8 KiB for its fp8 output). W4A8: 3 x 32 KiB of boxes + 64 KiB of
# unpacked weights + 2 KiB of their scale steps + staging: the plain kernel
# leaves < 1 KiB of the 227. W4A16: 3 x 24 KiB of boxes + 64 KiB unpacked +
# staging.
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
# Columns per scale of a group-quantized activation (the gated GEMM's output
# tile quantizes itself, and the plain GEMM takes one group per K step) and
# of the uint4 weights' scales (one fp8 K step, two 16-bit ones).
GROUP = gl.constexpr(128)
# One fp8 K step (K_BYTES one-byte columns) and half a gated output tile.
assert GROUP.value == K_BYTES.value == BLOCK_N.value // 2
_FP8_MAX = gl.constexpr(FP8_MAX)
_MIN_SCALE = gl.constexpr(MIN_SCALE)

_GL_DTYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.uint8: gl.uint8,  # packed uint4 weights
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
def _total(x):
    return gl.reduce(x, 0, add)


@gluon.jit
def _expert_tiles(offsets_ptr, num_experts, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
    """(experts, starts, ends, row tiles, inclusive prefix sum of the tiles)
    in a layout of the calling partition's ``WARPS`` warps."""
    experts = gl.arange(0, BLOCK_E, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    valid = experts < num_experts
    starts = gl.load(offsets_ptr + experts, mask=valid, other=0).to(gl.int32)
    ends = gl.load(offsets_ptr + experts + 1, mask=valid, other=0).to(gl.int32)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return experts, starts, ends, tiles, gl.associative_scan(tiles, 0, add)


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
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
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
def _ring(
    a_dtype: gl.constexpr,
    a_layout: gl.constexpr,
    w_desc,
    READY_ARRIVALS: gl.constexpr,
):
    """The loader's ring of STAGES slots: A boxes (BLOCK_M rows of K_BYTES),
    weight boxes (BLOCK_N rows of the host's K box: the same K, or half of
    it for packed uint4), and per slot a ready barrier (``READY_ARRIVALS``
    arrivals) and an empty one that both consumers release; every slot
    starts free."""
    a_boxes = gl.allocate_shared_memory(
        a_dtype, [STAGES, BLOCK_M, K_BYTES // _itemsize(a_dtype)], a_layout
    )
    w_boxes = gl.allocate_shared_memory(
        w_desc.dtype, [STAGES, BLOCK_N, w_desc.block_type.shape[1]], w_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=2)
        mbarrier.arrive(empty.index(i), count=2)
    return a_boxes, w_boxes, ready, empty


@gluon.jit
def _w_k(k, a_boxes, w_boxes):
    """The weight box's K coordinate at A's column ``k`` (packed uint4
    weights hold two columns per byte)."""
    return k // (a_boxes.shape[2] // w_boxes.shape[2])


@functools.cache  # building the layout costs ~6 us of host time per call
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``t`` in boxes of ``block``, in the swizzled
    layout the kernels' shared memory uses."""
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def k_box(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A ring box of ``rows`` rows of operand ``t`` [*, K]: K_BYTES of K."""
    return descriptor(t, [rows, K_BYTES.value // t.element_size()])
