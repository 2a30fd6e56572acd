"""Packed uint4 weights on the warp-specialized Hopper GEMMs (Gluon): W4A8
(:mod:`.w4a8`'s format: two per byte along K, one fp32 scale per output
channel and group of 128 K columns; fp8 activations with row scales) and
W4A16 (the Marlin packing of :mod:`~..marlin.packing`: eight per int32 word,
16-bit scales per group of 128; bf16 or fp16 activations).

The loaders of :mod:`.hopper_plain` and :mod:`.hopper_gated` bring the
packed weight box (half a byte per K column of the A box) beside the A
rows; the unpack's format follows A's dtype, not the weights'; this
module adds what the consumers do with it:

- each consumer warpgroup unpacks its half of the box's rows into one of two
  shared-memory buffers, in A's dtype, and both multiply with the whole
  buffer once both halves are in (``uready``); a buffer is rewritten only
  after both warpgroups' MMAs that read it are done (``ufree``). The next K
  step is unpacked while the MMA runs;
- W4A16 unpacks ``(q - 8) * scale`` rounded once to 16 bits (the Marlin
  kernels' numerics), so its MMAs need nothing more;
- W4A8 unpacks ``q - 8`` (exact in fp8). A K step is one weight group, so the
  accumulator is carried in units of the current group's channel scales:
  before step ``g``'s MMA it is multiplied by ``s[g - 1] / s[g]`` per column
  (:func:`w4_scale_steps` computes those ratios once, at weight
  preparation), and the epilogue multiplies by the last group's scales as
  the fp8 kernels do by their channel scales. The ratios and each rescale
  round in fp32; scales must be finite and positive
  (:func:`~.w4a8.quantize_w4` never writes a zero). A step's ratios travel
  with its unpacked box: the unpack loads them (one column a thread) into a
  shared buffer beside it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vllm.model_executor.kernels.common.checks import arg_error
from vllm.model_executor.kernels.grouped_gemm.hopper_common import (
    BLOCK_N,
    GROUP,
    K_BYTES,
    STAGES,
    SUB,
    _acc_layout,
    _itemsize,
    _scaled,
    descriptor,
)

# Triton 3.6 (the H200 here) names the block-wide barrier thread_barrier.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
BUFFERS = gl.constexpr(2)  # unpacked weight boxes: one multiplied, one filled
HALF_N = gl.constexpr(BLOCK_N.value // 2)  # weight rows each warpgroup unpacks

# Four packed bytes (eight columns) per register in, two registers of four
# fp8 columns each out, in column order. A nibble ORed into the mantissa of
# fp16 1024 is 1024 + q (the high one 1024 + 16q); one paired subtraction
# (or fma) per two values makes q - 8, the paired fp16 -> fp8 conversion
# packs them, and prmt puts the bytes in column order.
_UNPACK_ASM = gl.constexpr("""{
.reg .b32 sh, l02, l13, h02, h13, lo, hi, bias, sixteenth, off;
.reg .b16 c0, c1, c2, c3;
mov.b32 bias, 0x64086408;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 off, 0xD480D480;
shr.u32 sh, $2, 8;
lop3.b32 l02, $2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l13, sh, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h02, $2, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h13, sh, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 l02, l02, bias;
sub.f16x2 l13, l13, bias;
fma.rn.f16x2 h02, h02, sixteenth, off;
fma.rn.f16x2 h13, h13, sixteenth, off;
cvt.rn.satfinite.e4m3x2.f16x2 c0, l02;
cvt.rn.satfinite.e4m3x2.f16x2 c1, l13;
cvt.rn.satfinite.e4m3x2.f16x2 c2, h02;
cvt.rn.satfinite.e4m3x2.f16x2 c3, h13;
mov.b32 lo, {c0, c2};
mov.b32 hi, {c1, c3};
prmt.b32 $0, lo, hi, 0x6420;
prmt.b32 $1, lo, hi, 0x7531;
}""")


@gluon.constexpr_function
def _unpack16_asm(dtype: gl.dtype) -> str:
    """W4A16: one packed word (columns 2i and 2i + 1 in nibbles i and i + 4)
    in, four registers of two 16-bit columns each out, in column order. A
    nibble pair ORed into the pattern of 128 (bf16) or 1024 (fp16) is
    ``magic + q``; adding ``-(magic + 8)`` is exact, and the multiply by the
    scale (two copies per register) rounds once."""
    bf16 = dtype == gl.bfloat16
    magic = "0x43004300" if bf16 else "0x64006400"
    bias = "0xC308C308" if bf16 else "0xE408E408"  # -136.0 / -1032.0
    op = "bf16x2" if bf16 else "f16x2"
    pairs = "\n".join(
        f"lop3.b32 $${i}, {src}, 0x000F000F, magic, 0xEA;\n"
        f"add.rn.{op} $${i}, $${i}, bias;\n"
        f"mul.rn.{op} $${i}, $${i}, $$5;"
        for i, src in enumerate(("$$4", "s4", "s8", "s12"))
    )
    return f"""{{
.reg .b32 s4, s8, s12, magic, bias;
mov.b32 magic, {magic};
mov.b32 bias, {bias};
shr.u32 s4, $$4, 4;
shr.u32 s8, $$4, 8;
shr.u32 s12, $$4, 12;
{pairs}
}}""".replace("$$", "$")


def w4_scale_steps(w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(steps [E, G, N], last [E, N])`` of channel scales ``w_scale``
    [E, N, G]: ``steps[:, g] = w_scale[..., g - 1] / w_scale[..., g]`` (ones
    at g = 0, which multiply nothing) and the last group's scales. The
    kernels trust them to be of the scales they run with."""
    if w_scale.dim() != 3 or w_scale.shape[2] == 0:
        raise arg_error("w_scale", f"[E, N, groups >= 1], got {list(w_scale.shape)}")
    if not bool(((w_scale > 0) & w_scale.isfinite()).all()):
        raise arg_error(
            "w_scale", "finite positive scales (a zero one would divide the "
            "carried accumulator by zero)",
        )  # fmt: skip
    scale = w_scale.transpose(1, 2).float()
    steps = torch.ones_like(scale)
    steps[:, 1:] = scale[:, :-1] / scale[:, 1:]
    return steps.contiguous(), scale[:, -1].contiguous()


@gluon.jit
def _in_column_order(first, second):
    """[R, 2C] of the unpacks' outputs [R, C]: bytes 4j..4j+3 gave columns
    8j..8j+3 in ``first`` and 8j+4..8j+7 in ``second``. pack=4 hands the
    asm four consecutive bytes of a row: the callers' layout holds 16
    consecutive bytes per thread."""
    R: gl.constexpr = first.shape[0]
    C: gl.constexpr = first.shape[1]
    halves = gl.reshape(gl.join(first, second), [R, C // 4, 4, 2])
    return gl.reshape(gl.permute(halves, [0, 1, 3, 2]), [R, 2 * C])


@gluon.jit
def _unpack_fp8(packed):
    """W4A8: fp8 [R, 2C] values -8..7 of packed uint8 [R, C]."""
    first, second = gl.inline_asm_elementwise(
        _UNPACK_ASM,
        "=r,=r,r",
        [packed],
        dtype=(gl.float8e4nv, gl.float8e4nv),
        is_pure=True,
        pack=4,
    )
    return _in_column_order(first, second)


@gluon.jit
def _unpack_16(packed, scale):
    """W4A16: ``(q - 8) * scale`` [R, 2C] in ``scale``'s dtype of packed
    uint8 [R, C] (Marlin words) and row scales [R, 1]."""
    first, second = gl.inline_asm_elementwise(
        _unpack16_asm(scale.dtype),
        "=r,=r,=r,=r,r,r,r",
        [packed, scale],
        dtype=(scale.dtype, scale.dtype),
        is_pure=True,
        pack=4,
    )
    return _in_column_order(first, second)


@gluon.jit
def _unpack_half(w_boxes, ready, w4, step, group, steps, HALF: gl.constexpr):
    """Unpacks this warpgroup's half of the weight box of ring step ``step``
    into its unpacked buffer once the box has landed and both warpgroups
    are done with the buffer. W4A16 multiplies by the columns' scales of K
    group ``group``; W4A8 copies their scale steps beside the box (the
    rescales read them before the MMA that ``ufree`` waits for).
    ``steps``: (the tile's first column's scales, or :func:`w4_scale_steps`,
    at group 0; its real columns; N)."""
    unpacked, ratios, uready, ufree = w4
    tile_scales, cols_left, N = steps
    PACKED_K: gl.constexpr = w_boxes.shape[2]
    # 16 bytes per thread: a row of 32 or 64 bytes per 2 or 4 threads.
    layout: gl.constexpr = gl.BlockedLayout(
        [1, 16], [32 * 16 // PACKED_K, PACKED_K // 16], [4, 1], [1, 0]
    )
    # Loaded before the waits, which hide their latency.
    if _scaled(unpacked.dtype):  # one column a thread
        cols = HALF * HALF_N + gl.arange(
            0, HALF_N, layout=gl.BlockedLayout([1], [32], [4], [0])
        )
        ratio = gl.load(
            tile_scales + group * N + cols, mask=cols < cols_left, other=1.0
        )
    else:  # the columns of the thread's rows
        cols = HALF * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, layout))
        scale = gl.load(tile_scales + group * N + cols, mask=cols < cols_left)
        scale = scale[:, None]
    slot = step % STAGES
    buf = step % BUFFERS
    mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
    mbarrier.wait(ufree.index(buf), (step // BUFFERS) & 1)
    packed = w_boxes.index(slot).slice(HALF * HALF_N, HALF_N, dim=0).load(layout)
    if _scaled(unpacked.dtype):
        values = _unpack_fp8(packed)
    else:
        values = _unpack_16(packed, scale)
    unpacked.index(buf).slice(HALF * HALF_N, HALF_N, dim=0).store(values)
    if _scaled(unpacked.dtype):  # after the unpack, which hides the load
        ratios.index(buf).slice(HALF * HALF_N, HALF_N).store(ratio)
    fence_async_shared()
    _barrier()  # every thread's stores before the warpgroup's one arrival
    mbarrier.arrive(uready.index(buf), count=1)


@gluon.jit
def w4_mainloop(
    a_boxes,
    w_boxes,
    ready,
    empty,
    step,
    K,
    w4,
    steps,
    HALF: gl.constexpr,
    GATHERED: gl.constexpr,
):
    """This warpgroup's 64 x BLOCK_N accumulator over K (W4A8: in units of
    the last group's channel scales), and the next ring step. ``steps``: the
    tile's scales or scale steps as :func:`_unpack_half` takes them. W4A8
    reads a step's ratios from shared memory, where the unpack put them:
    read from global memory (64 columns a thread), each rescale waited on
    their latency."""
    unpacked, ratios, uready, ufree = w4
    BLOCK_K: gl.constexpr = a_boxes.shape[2]
    RESCALE: gl.constexpr = _scaled(a_boxes.dtype)
    acc_layout: gl.constexpr = _acc_layout(a_boxes.dtype)
    acc = gl.zeros((SUB, BLOCK_N), gl.float32, acc_layout)
    _unpack_half(w_boxes, ready, w4, step, 0, steps, HALF)
    # No `prev = step` before the loop: Triton 3.6 and 3.9 then carry one
    # value for both, and the releases below would all go to the first slot.
    for k in range(0, K, BLOCK_K):
        mbarrier.wait(uready.index(step % BUFFERS), (step // BUFFERS) & 1)
        if GATHERED:  # cp.async wrote the A rows: order them before the MMA's reads
            fence_async_shared()
        if RESCALE and k > 0:
            ratio = ratios.index(step % BUFFERS).load(gl.SliceLayout(0, acc_layout))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
            mbarrier.arrive(ufree.index((step - 1) % BUFFERS), count=1)
            acc = acc * ratio[None, :]
        acc = warpgroup_mma(
            a_boxes.index(step % STAGES).slice(HALF * SUB, SUB, dim=0),
            unpacked.index(step % BUFFERS).permute((1, 0)),
            acc,
            is_async=True,
        )
        if not RESCALE:  # the MMA before this one is done with its boxes
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k > 0:
                mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
                mbarrier.arrive(ufree.index((step - 1) % BUFFERS), count=1)
        if k + BLOCK_K < K:  # the next box, while the MMA runs
            group = (k + BLOCK_K) // GROUP
            _unpack_half(w_boxes, ready, w4, step + 1, group, steps, HALF)
        if RESCALE:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # no wait
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    mbarrier.arrive(ufree.index((step - 1) % BUFFERS), count=1)
    return acc, step


@gluon.jit
def w4_skip(
    w_boxes,
    ready,
    empty,
    step,
    K,
    w4,
    steps,
    BLOCK_K: gl.constexpr,
    HALF: gl.constexpr,
):
    """No rows in this warpgroup's half: it still unpacks its half of each
    box (and its scale steps) for the other one, and releases what it never
    multiplies with."""
    ufree = w4[3]
    for k in range(0, K, BLOCK_K):
        _unpack_half(w_boxes, ready, w4, step, k // GROUP, steps, HALF)
        mbarrier.arrive(ufree.index(step % BUFFERS), count=1)
        mbarrier.arrive(empty.index(step % STAGES), count=1)
        step += 1
    return step


@gluon.jit
def w4_buffers(a_dtype: gl.constexpr):
    """The two unpacked weight boxes in A's dtype, W4A8's buffers of their
    columns' scale steps (W4A16: the boxes stand in, never read), and their
    barriers, both buffers free."""
    BLOCK_K: gl.constexpr = K_BYTES // _itemsize(a_dtype)  # one A box's K
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, BLOCK_K], a_dtype
    )
    unpacked = gl.allocate_shared_memory(a_dtype, [BUFFERS, BLOCK_N, BLOCK_K], layout)
    if _scaled(a_dtype):
        ratios = gl.allocate_shared_memory(
            gl.float32, [BUFFERS, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
    else:
        ratios = unpacked
    uready = gl.allocate_shared_memory(
        gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout()
    )
    ufree = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(uready.index(i), count=2)
        mbarrier.init(ufree.index(i), count=2)
        mbarrier.arrive(ufree.index(i), count=2)
    return unpacked, ratios, uready, ufree


def packed_box(w: torch.Tensor, a: torch.Tensor) -> TensorDescriptor:
    """The TMA box of packed weights ``w`` (uint8 [E * N, K // 2], two K
    columns per byte) that pairs with a ring box of ``a``: BLOCK_N rows of
    half as many bytes as its K columns."""
    return descriptor(w, [BLOCK_N.value, K_BYTES.value // a.element_size() // 2])
