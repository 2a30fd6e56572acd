"""The K loop of the tensor-core uint4 decode kernels (Gluon, NVIDIA sm_80
and later), shared by the dense GEMM (:mod:`.gemv_mma`) and the MoE kernels
(route by route, :mod:`.moe_decode_mma`; expert by expert,
:mod:`.moe_grouped_mma`): :func:`mma_rows` multiplies 16 weight rows a warp
tile by up to two 8-row blocks of activations.

A weight costs half a LOP3 and under half a shift (the CUDA-core
:mod:`.gemv`: 4.2 instructions, docs/marlin.md):
``mma.sync.m16n8k16`` multiplies them, the A operand (16 weight rows x 16
K) straight from the registers the words were unpacked into.
Each thread holds exactly its fragment's values, so nothing moves between
threads or through shared memory:

- lane ``(g, t) = (lane // 4, lane % 4)`` of a warp loads, per K step of
  128, the 16-byte run of packed words ``4t .. 4t + 3`` of weight rows ``g``
  and ``g + 8`` (K columns ``32t .. 32t + 31``; the four lanes of a row read
  64 contiguous bytes);
- a word's nibbles ``(i, i + 4)`` are columns ``(8c + 2i, 8c + 2i + 1)``
  (:mod:`.packing`; in W4A8's column order ``(8c + i, 8c + i + 4)``, and
  two PRMTs a word pair the activations the same way), so one LOP3 of the
  word shifted into place gives them
  as an exact 16-bit pair ``MAGIC + UNIT * q``; each step's sum starts from
  ``-(MAGIC + 8 UNIT)`` times the step's activation sums (8 MMAs with a
  constant A), so the MMAs add up ``UNIT * (q - 8) * x`` without a subtract
  per weight;
- the K order inside an MMA is free as long as A and B agree: MMA ``(j,
  h)`` of the step gives the fragment's slot pair ``2t`` the columns ``32t +
  8j + 4h + (0, 1)`` and slot pair ``2t + 8`` the next two, so its B
  fragment (A's row ``g``: the activations, n = 8 rows) is two consecutive
  pairs of the same thread's 64-byte run of that row;
- a step is one group of scales when the group size is a multiple of 128:
  the step's MMAs sum into a fresh accumulator that is then scaled into the
  total (the weights stay exact; the products sum in fp32).

Each warp loads the next step's words and activations while it multiplies
this step's; the first step's words load before the PDL wait (plain loads:
ptxas hoists the wait above non-coherent ones). Steps past K repeat the
last one and are scaled by zero. ptxas, keeping under its register target
(56 on sm_90 for one tile and 8 warps), sinks both loads from the step's
top to its end, so a step waits about one HBM latency for its words and
another for its scales (loaded after its MMAs, used at once). Keeping
more K steps in flight, in registers or in shared memory, lost
(docs/marlin.md v4.1-v4.3).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from vllm import envs
from vllm.model_executor.kernels.common.device_info import capability
from vllm.model_executor.kernels.common.pdl import gluon_pdl_wait
from vllm.model_executor.kernels.marlin.config import PACK, TILE_K


def runs_mma(device: torch.device) -> bool:
    """Whether the tensor-core decode kernels run on ``device``: compiled
    (not the interpreter) for an NVIDIA GPU with ``mma.sync`` (sm_80+)."""
    cap = capability(device)
    return not (torch.version.hip or envs.triton_interpret() or cap is None) and (
        cap >= (8, 0)
    )


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows (along its last dimension but one) start on
    16-byte boundaries, as the tensor-core kernels' vector loads need (a
    default path falls back where not). Of stacked experts' weights only
    the rows: their callers require them contiguous."""
    row_bytes = t.stride(-2) * t.element_size()
    return t.data_ptr() % 16 == 0 and (t.shape[-2] <= 1 or row_bytes % 16 == 0)


def check_warp_tiles(config: object, names: tuple[str, str, str]) -> None:
    """Errors naming ``config`` unless its fields ``names`` (row tiles per
    program, of them per warp, warp slices) make a launchable program."""
    tiles, per_warp, slices = (getattr(config, name) for name in names)
    for name, value in zip(names, (tiles, per_warp, slices), strict=True):
        if value < 1 or value & (value - 1):
            raise ValueError(f"config: {name} must be a power of two: {config}")
    if tiles % per_warp or tiles // per_warp * slices > 16:
        raise ValueError(
            f"config: {names[1]} must divide {names[0]}, in at most 16 warps: {config}"
        )


@gluon.constexpr_function
def warp_tiles(slices: int, row_tiles: int, tiles_per_warp: int) -> gl.BlockedLayout:
    """A program's [slice, row tile, lane] layout: the warps split into
    ``slices`` (of K, or of routes), each warp holding ``tiles_per_warp`` of
    the ``row_tiles`` 16-row tiles, a lane each of its 32."""
    return gl.BlockedLayout(
        [1, tiles_per_warp, 1],
        [1, 1, 32],
        [slices, row_tiles // tiles_per_warp, 1],
        [2, 1, 0],
    )


# One word -> its four pairs, nibbles (i, i + 4) in pair i, as the 16-bit
# pattern MAGIC ORed with q at a bit position where it reads MAGIC + UNIT q
# exactly. The sum then carries an offset -(MAGIC + 8 UNIT) per weight that
# must cancel: its size over UNIT's sets the fp32 error. bf16 (7 mantissa
# bits): 128 + q (the nibble in bits 0-3). fp16 (10 bits): 1024 + 16 q (bits
# 4-7), 9x the largest weight where 1024 + q would be 129x.
def _unpack_asm(magic: int, mask: int, shifts: tuple[int, ...]) -> str:
    """Word ``$4`` -> pairs ``$0 .. $3``; ``shifts[i]`` moves pair i onto
    ``mask`` (a right shift, left where negative)."""
    lines = []
    for i, shift in enumerate(shifts):
        src = "$4"
        if shift:
            op = "shr.u32" if shift > 0 else "shl.b32"
            lines.append(f"{op} t, $4, {abs(shift)};")
            src = "t"
        pattern = f"0x{magic:04x}{magic:04x}"
        lines.append(f"lop3.b32 ${i}, {src}, 0x{mask:08x}, {pattern}, 0xEA;")
    return "{ .reg .b32 t; " + " ".join(lines) + " }"


_UNPACK_BF16 = gl.constexpr(_unpack_asm(0x4300, 0x000F000F, (0, 4, 8, 12)))
_UNPACK_FP16 = gl.constexpr(_unpack_asm(0x6400, 0x00F000F0, (-4, 0, 4, 8)))
# -(MAGIC + 8 UNIT) as a 16-bit pair, and 1 / UNIT.
_OFFSET_BF16 = gl.constexpr(-0x3CF73CF8)  # 0xC308C308 as int32: -136
_OFFSET_FP16 = gl.constexpr(-0x1B7F1B80)  # 0xE480E480 as int32: -1152
_UNIT_INV_BF16 = gl.constexpr(1.0)
_UNIT_INV_FP16 = gl.constexpr(1.0 / 16)


def _mma_asm(ab: str) -> str:
    return (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )


_MMA_BF16 = gl.constexpr(_mma_asm("bf16"))
_MMA_FP16 = gl.constexpr(_mma_asm("f16"))

# 16 bytes per thread. Not ld.global.nc: ptxas moves a PDL wait above those.
_LOAD_V4 = gl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")
_TILE_K = gl.constexpr(TILE_K)
_STEP_WORDS = gl.constexpr(TILE_K // PACK)  # packed words per row and K step


@gluon.jit
def _load_words(ptrs):
    """Four consecutive int32 per thread, one 16-byte load; pure (movable):
    for the weights, which no kernel of the step writes."""
    return gl.inline_asm_elementwise(
        _LOAD_V4, "=r,=r,=r,=r,l", [ptrs],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _step_words(w_lo, w_hi, step, steps):
    """The words of rows g and g + 8 at K step ``step`` (past the last: the
    last again)."""
    step = gl.minimum(step, steps - 1)[:, None, :] * _STEP_WORDS
    return _load_words(w_lo + step), _load_words(w_hi + step)


@gluon.jit
def append(items, item):
    """``items`` with ``item`` at the end (the kernels' tuples: blocks of
    A rows, their sums)."""
    return items + (item,)  # noqa: RUF005 (Gluon compiles no starred tuple)


@gluon.jit
def _load_act(ptrs):
    """As :func:`_load_words`, but not pure: the activations are the previous
    kernel's, read after the PDL wait only (a pure asm may move above it)."""
    return gl.inline_asm_elementwise(
        _LOAD_V4, "=r,=r,=r,=r,l", [ptrs],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _unpack(word, FP16: gl.constexpr):
    asm: gl.constexpr = _UNPACK_FP16 if FP16 else _UNPACK_BF16
    return gl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r", [word],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FP16: gl.constexpr):
    asm: gl.constexpr = _MMA_FP16 if FP16 else _MMA_BF16
    return gl.inline_asm_elementwise(
        asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _offset(x, FP16: gl.constexpr):
    """-(MAGIC + 8 UNIT) times the sum of the step's activations, as an MMA
    fragment of A rows 2t, 2t + 1 (the same for every weight row): an A
    operand of constant pairs against each of the step's 8 B fragments."""
    pair: gl.constexpr = _OFFSET_FP16 if FP16 else _OFFSET_BF16
    a = gl.full(x[0].shape, pair, gl.int32, x[0].type.layout)
    c = gl.zeros_like(a, dtype=gl.float32)
    c0, c1, c2, c3 = _mma(a, a, a, a, x[0], x[1], c, c, c, c, FP16)
    for i in gl.static_range(1, 8):
        c0, c1, c2, c3 = _mma(a, a, a, a, x[2 * i], x[2 * i + 1], c0, c1, c2, c3, FP16)
    return c0, c1


@gluon.jit
def _offsets(word, xs, FP16: gl.constexpr):
    """Each block's :func:`_offset` as the fragment a step's sum starts
    from (in ``word``'s shape: one per row tile)."""
    cs = ()
    for b in gl.static_range(len(xs)):
        off0, off1 = _offset(xs[b], FP16)
        c0 = gl.zeros_like(word.to(gl.float32, bitcast=True)) + off0[:, None, :]
        c1 = gl.zeros_like(c0) + off1[:, None, :]
        cs = append(cs, (c0, c1, c0, c1))
    return cs


@gluon.jit
def _step(lo, hi, xs, FP16: gl.constexpr):
    """fp32 fragments (rows g, g + 8 x A rows 2t, 2t + 1) of one K step, one
    per block of 8 A rows: ``lo``/``hi`` the four words of rows g and g + 8,
    ``xs`` each block's 16 activation pairs of the thread. A word unpacks
    once for all blocks; pairs 0, 1 multiply activations 4j, 4j + 1, pairs
    2, 3 the next two ([K_SPLIT, 32]: broadcast over a lane's row tiles, a
    register copy)."""
    cs = _offsets(lo[0], xs, FP16)
    for j in gl.static_range(4):
        l0, l1, l2, l3 = _unpack(lo[j], FP16)
        h0, h1, h2, h3 = _unpack(hi[j], FP16)
        summed = ()
        for b in gl.static_range(len(xs)):
            x = xs[b]
            c0, c1, c2, c3 = cs[b]
            c0, c1, c2, c3 = _mma(
                l0, h0, l1, h1, x[4 * j][:, None, :], x[4 * j + 1][:, None, :],
                c0, c1, c2, c3, FP16,
            )  # fmt: skip
            c0, c1, c2, c3 = _mma(
                l2, h2, l3, h3, x[4 * j + 2][:, None, :], x[4 * j + 3][:, None, :],
                c0, c1, c2, c3, FP16,
            )  # fmt: skip
            summed = append(summed, (c0, c1, c2, c3))
        cs = summed
    return cs


@gluon.jit
def _scaled(cs, scale_lo, scale_hi):
    """Each block's rows g times ``scale_lo``, rows g + 8 times ``scale_hi``."""
    out = ()
    for b in gl.static_range(len(cs)):
        c0, c1, c2, c3 = cs[b]
        scaled = (c0 * scale_lo, c1 * scale_lo, c2 * scale_hi, c3 * scale_hi)
        out = append(out, scaled)
    return out


@gluon.jit
def _sum(accs, cs):
    out = ()
    for b in gl.static_range(len(cs)):
        a0, a1, a2, a3 = accs[b]
        c0, c1, c2, c3 = cs[b]
        out = append(out, (a0 + c0, a1 + c1, a2 + c2, a3 + c3))
    return out


@gluon.jit
def _column_order(w0, w1, w2, w3):
    """A word's 8 activations (pairs of columns 01, 23, 45, 67) as the
    pairs of columns 04, 15, 26, 37."""
    asm: gl.constexpr = "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;"
    p0, p1 = gl.inline_asm_elementwise(
        asm, "=r,=r,r,r", [w0, w2], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
    )
    p2, p3 = gl.inline_asm_elementwise(
        asm, "=r,=r,r,r", [w1, w3], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
    )
    return p0, p1, p2, p3


@gluon.jit
def _load_x(x_rows, step, NIBBLES_IN_ORDER: gl.constexpr):
    """The thread's 64 bytes of its A row at K step ``step``: 16 pairs, four
    per packed word in the order its nibble pairs hold the columns. Pair i
    of a word is columns (2i, 2i + 1) in Marlin's packing; in column order
    (``NIBBLES_IN_ORDER``: nibble i is column i) it is (i, i + 4)."""
    p = x_rows + step * (_TILE_K // 2)
    x0, x1, x2, x3 = _load_act(p)
    x4, x5, x6, x7 = _load_act(p + 4)
    x8, x9, x10, x11 = _load_act(p + 8)
    x12, x13, x14, x15 = _load_act(p + 12)
    if NIBBLES_IN_ORDER:
        x0, x1, x2, x3 = _column_order(x0, x1, x2, x3)
        x4, x5, x6, x7 = _column_order(x4, x5, x6, x7)
        x8, x9, x10, x11 = _column_order(x8, x9, x10, x11)
        x12, x13, x14, x15 = _column_order(x12, x13, x14, x15)
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)


@gluon.jit
def _load_xs(x_rows, step, NIBBLES_IN_ORDER: gl.constexpr):
    """:func:`_load_x` for each block of A rows."""
    xs = ()
    for b in gl.static_range(len(x_rows)):
        xs = append(xs, _load_x(x_rows[b], step, NIBBLES_IN_ORDER))
    return xs


@gluon.jit
def mma_rows(
    w_lo,  # [S, R, 32] int32 pointers: rows g of R tiles, lane t's first word
    w_hi,  # the same for rows g + 8
    s_lo,  # [S, R, 32] pointers to rows g's group-0 (or channel) scales
    s_hi,  # the same for rows g + 8
    x_rows,  # per block of 8 A rows, [S, 32] int32 pointers: the lane's row at its run
    first,  # [S, 32] each slice's first K step (< STEP_STRIDE)
    steps,  # K // 128
    stride_sg,  # from one group's scales to the next
    STEP_STRIDE: gl.constexpr,  # a slice takes steps first, first + STEP_STRIDE..
    GROUP_SIZE: gl.constexpr,  # a multiple of 128, or -1 (per channel)
    FP16: gl.constexpr,
    PDL: gl.constexpr,  # wait for the previous kernel after the first words
    NIBBLES_IN_ORDER: gl.constexpr = False,  # W4A8's packing (see _load_x)
):
    """The K loop: per block of A rows, fp32 [S, R, 32] x 4, each warp
    slice's scaled sums of its steps; lane (g, t) holds rows g (0, 1) and
    g + 8 (2, 3) of the block's A rows 2t and 2t + 1. A slice's steps past
    the last repeat the last one and are scaled by zero."""
    words = _step_words(w_lo, w_hi, first, steps)
    gluon_pdl_wait(PDL)
    xs = _load_xs(x_rows, gl.minimum(first, steps - 1), NIBBLES_IN_ORDER)
    zero = gl.zeros_like(words[0][0], dtype=gl.float32)
    accs = ()
    for _ in gl.static_range(len(x_rows)):
        accs = append(accs, (zero, zero, zero, zero))
    for i in range(0, gl.cdiv(steps, STEP_STRIDE)):
        here = first + i * STEP_STRIDE
        ahead = here + STEP_STRIDE
        lo, hi = words
        words = _step_words(w_lo, w_hi, ahead, steps)
        xs_next = _load_xs(x_rows, gl.minimum(ahead, steps - 1), NIBBLES_IN_ORDER)
        cs = _step(lo, hi, xs, FP16)
        valid = (here < steps)[:, None, :]
        if GROUP_SIZE > 0:
            group = gl.minimum(here, steps - 1)[:, None, :] * _TILE_K // GROUP_SIZE
            scale_lo = gl.load(s_lo + group * stride_sg).to(gl.float32)
            scale_hi = gl.load(s_hi + group * stride_sg).to(gl.float32)
        else:
            scale_lo = 1.0
            scale_hi = 1.0
        scale_lo = gl.where(valid, scale_lo, 0.0)
        scale_hi = gl.where(valid, scale_hi, 0.0)
        accs = _sum(accs, _scaled(cs, scale_lo, scale_hi))
        xs = xs_next
    unit_inv: gl.constexpr = _UNIT_INV_FP16 if FP16 else _UNIT_INV_BF16
    if GROUP_SIZE < 0:
        scale_lo = gl.load(s_lo).to(gl.float32) * unit_inv
        scale_hi = gl.load(s_hi).to(gl.float32) * unit_inv
    else:
        scale_lo = unit_inv
        scale_hi = unit_inv
    return _scaled(accs, scale_lo, scale_hi)
