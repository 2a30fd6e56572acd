"""W4A8 grouped GEMMs over expert-contiguous rows (Triton): uint4 weights
with one fp32 scale per output channel and group of 128 input columns, fp8
e4m3 activations with one scale per row.

Weight format (:func:`quantize_w4`): symmetric, ``w ~ (q - 8) * scale``
with ``q`` in 0..15, two per byte along K (the even column in the low
nibble): ``w`` uint8 [E, N, K / 2], ``w_scale`` fp32 [E, N, K / 128]. Half
the bytes of fp8 weights, and the values -8..7 are exact in fp8 e4m3: each
K step of 128 (one group) unpacks the weight tile in registers to fp8, runs
an fp8 tensor-core product and adds it times the group's channel scales;
the row scales multiply the sum once.

The plain GEMM: ``out[r] = a[r] @ w[e]^T`` (dequantized) for the rows ``r``
of expert ``e`` (``offsets[e]:offsets[e+1]``). The gated GEMM, as the fp8
one in :mod:`.triton_kernels`: row ``r`` reads token ``src_routes[r] //
topk`` straight from the unpermuted input, w13's gate and up rows are
interleaved, and the program writes ``act(gate, up)`` [R, I]. Both are
persistent with grids that depend only on the row count (CUDA-graph
capturable); rows at or past ``offsets[E]`` are not written.

On Hopper, given the scales' :func:`~.hopper_uint4.w4_scale_steps`
(computed once with the weights), both GEMMs run the warp-specialized
Gluon kernels instead (:mod:`.hopper_uint4`), which multiply in 128-row
tiles.

Every call checks its arguments before any launch. The expert offsets and
the routes live on the device and are not checked (as in :mod:`.api`).
:func:`grouped_gemm_w4a8_reference` and its gated twin are the
plain-PyTorch oracles and the CPU path.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.activation_quant import (
    ACTIVATIONS,
    MODES,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    gated_act,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.checks import arg_error, check_contiguous
from vllm.model_executor.kernels.common.device_info import persistent_programs
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import hopper_gated, hopper_plain
from vllm.model_executor.kernels.grouped_gemm.dispatch import (
    GroupedGemmConfig,
    hopper_supports,
    hopper_supports_gated,
)
from vllm.model_executor.kernels.grouped_gemm.layout import deinterleave_gate_up
from vllm.model_executor.kernels.grouped_gemm.reference import expert_products
from vllm.model_executor.kernels.grouped_gemm.triton_kernels import (
    _expert_tiles,
    _tile_coords,
)

W4_GROUP = 128  # input columns per weight scale; the kernels' K step


# The fastest tiles of ``benchmarks/tuning/tune_w4a8.py``'s sweep on the
# H200, at 16, 64 and 8192 tokens alike (Qwen3-30B-A3B's experts; the fp8
# kernels' tiles ran the layer 2-7x slower): down 120 / 163 / 1317 us,
# gate/up (block_n output columns: a 2 x block_n product tile) 207 / 311 /
# 2658 us.
W4A8_TILES = GroupedGemmConfig(64, 256, W4_GROUP, 8, 3)
W4A8_GATED_TILES = GroupedGemmConfig(64, 128, W4_GROUP, 8, 3)


# -- the weight format ---------------------------------------------------------


def quantize_w4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [..., N, K / 2], scale fp32 [..., N, K / 128])`` of
    weights [..., N, K] (K a multiple of 128): the nearest of 16 levels per
    group, the largest magnitude at +-7 levels."""
    if w.shape[-1] % W4_GROUP:
        raise arg_error("w", f"K a multiple of {W4_GROUP}, got shape {list(w.shape)}")
    groups = w.float().unflatten(-1, (-1, W4_GROUP))
    scale = groups.abs().amax(-1).clamp_min(1e-12) / 7
    q = ((groups / scale[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8)
    q = q.flatten(-2)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), scale.contiguous()


def dequantize_w4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weights [..., N, K] of :func:`quantize_w4`'s format."""
    q = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).float() - 8
    return (q.unflatten(-1, (-1, W4_GROUP)) * scale[..., None]).flatten(-2)


# -- kernels -------------------------------------------------------------------


@triton.jit
def _unpack_w4(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 [BLOCK_N, BLOCK_K] values -8..7 of packed uint8 [BLOCK_N, BLOCK_K / 2].

    A nibble ``q`` ORed into the mantissa of fp16 1024 is ``1024 + q``
    exactly: one OR and one subtraction per value, then the hardware's
    paired fp16 -> fp8 conversion (no fp32 detour)."""
    low = (packed & 15).to(tl.uint16) | 0x6400
    high = (packed >> 4).to(tl.uint16) | 0x6400
    biased = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
    return (biased.to(tl.float16, bitcast=True) - 1032.0).to(tl.float8e4nv)


@triton.jit
def _w4a8_product(
    a_rows,  # [BLOCK_M] pointers to the rows' first fp8 column
    row_ok,
    w_ptr,
    w_scale_ptr,
    w_rows,  # [BLOCK_N] int64 rows of the flattened [E * N, K / 2] weights
    w_ok,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N]: the rows' products with the dequantized
    weight rows (row scales not applied), one group per K step."""
    ks = tl.arange(0, BLOCK_K)
    half_ks = tl.arange(0, BLOCK_K // 2)
    groups = K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        a_ptrs = a_rows[:, None] + g * BLOCK_K + ks[None, :]
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        packed = tl.load(
            w_ptr + w_rows[:, None] * (K // 2) + g * (BLOCK_K // 2) + half_ks[None, :],
            mask=w_ok[:, None],
            other=0x88,  # zero weights
        )
        scale = tl.load(w_scale_ptr + w_rows * groups + g, mask=w_ok, other=0.0)
        w = _unpack_w4(packed, BLOCK_N, BLOCK_K)
        acc += tl.dot(a, w.T) * scale[None, :]
    return acc


@triton.jit
def _grouped_gemm_w4a8_kernel(
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
    starts, ends, tiles, tiles_end = _expert_tiles(
        offsets_ptr, num_experts, BLOCK_M, BLOCK_E
    )
    n_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(
        tl.program_id(0), tl.sum(tiles) * n_tiles, tl.num_programs(0), flatten=True
    ):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, starts, ends, tiles, tiles_end, BLOCK_M, BLOCK_E
        )
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = _w4a8_product(
            a_ptr + rows.to(tl.int64) * K, row_ok, w_ptr, w_scale_ptr,
            expert.to(tl.int64) * N + cols, col_ok, K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc *= tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(
            out_ptrs,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _grouped_gemm_w4a8_gated_kernel(
    a_ptr,
    a_scale_ptr,
    src_routes_ptr,
    w_ptr,
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
    for tile in tl.range(
        tl.program_id(0), tl.sum(tiles) * n_tiles, tl.num_programs(0), flatten=True
    ):
        expert, row_start, row_end, n_tile = _tile_coords(
            tile, n_tiles, starts, ends, tiles, tiles_end, BLOCK_M, BLOCK_E
        )
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        tokens = tl.load(src_routes_ptr + rows, mask=row_ok, other=0) // topk
        # 2 * BLOCK_N interleaved w13 rows: gate j, up j, ...
        w_cols = n_tile * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        acc = _w4a8_product(
            a_ptr + tokens.to(tl.int64) * K, row_ok, w_ptr, w_scale_ptr,
            expert.to(tl.int64) * 2 * inter + w_cols, w_cols < 2 * inter, K,
            BLOCK_M, 2 * BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc *= tl.load(a_scale_ptr + tokens, mask=row_ok, other=0.0)[:, None]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        y = gated_act(gate, up, MODE, ALPHA, LIMIT)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :]
        tl.store(
            out_ptrs,
            y.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols < inter)[None, :],
        )


# -- launchers -----------------------------------------------------------------


def _check_weights(
    name: str, w: torch.Tensor, w_scale: torch.Tensor, a: torch.Tensor
) -> tuple[int, int, int]:
    """(E, N, K) of packed weights ``w`` for fp8 activations ``a`` [*, K]."""
    if a.dim() != 2 or a.dtype != FP8_DTYPE or a.shape[1] % W4_GROUP or not a.shape[1]:
        raise arg_error(
            "a", f"fp8 e4m3 rows [*, K] with K a positive multiple of {W4_GROUP}, got "
            f"{a.dtype} {list(a.shape)}",
        )  # fmt: skip
    k = a.shape[1]
    if w.dim() != 3:
        raise arg_error(name, f"packed uint8 [E, N, {k // 2}], got {list(w.shape)}")
    experts, n = w.shape[:2]
    check_contiguous(name, w, torch.uint8, (experts, n, k // 2), a.device)
    shape = (experts, n, k // W4_GROUP)
    check_contiguous(f"{name}_scale", w_scale, torch.float32, shape, a.device)
    return experts, n, k


def _check_rows(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    offsets: torch.Tensor,
    experts: int,
    out: torch.Tensor,
    out_shape: tuple[int, int],
) -> None:
    device = a.device
    check_contiguous("a", a, FP8_DTYPE, tuple(a.shape), device)
    check_contiguous("a_scale", a_scale, torch.float32, (a.shape[0],), device)
    shape = (experts + 1,)
    check_contiguous("expert_first_token_offset", offsets, torch.int64, shape, device)
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise arg_error("out", f"bfloat16 or float16, got {out.dtype}")
    check_contiguous("out", out, out.dtype, out_shape, device)


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether TMA boxes can read these (16-byte aligned starts; the rows
    are, K being a multiple of 128); the Triton kernels take any."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _check_scale_steps(
    name: str, scale_steps: tuple[torch.Tensor, torch.Tensor], w_scale: torch.Tensor
) -> None:
    experts, n, groups = w_scale.shape
    steps, last = scale_steps
    device = w_scale.device
    check_contiguous(
        f"{name}_steps", steps, torch.float32, (experts, groups, n), device
    )
    check_contiguous(f"{name}_last", last, torch.float32, (experts, n), device)


def grouped_gemm_w4a8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
    scale_steps: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Writes the rows below ``expert_first_token_offset[-1]`` of ``out``
    [R, N] (bf16 or fp16) from fp8 ``a`` [R, K] with ``a_scale`` [R] and
    :func:`quantize_w4` weights ``w`` [E, N, K / 2] with ``w_scale``
    [E, N, K / 128]; returns ``out``. ``config``'s block_k is the group.
    With ``scale_steps`` (:func:`~.hopper_uint4.w4_scale_steps` of
    ``w_scale``), no ``config`` and a call the Hopper kernel supports, the
    Hopper kernel runs it."""
    experts, n, k = _check_weights("w", w, w_scale, a)
    rows = a.shape[0]
    _check_rows(a, a_scale, expert_first_token_offset, experts, out, (rows, n))
    if scale_steps is not None:
        _check_scale_steps("w", scale_steps, w_scale)
    if rows == 0 or experts == 0:
        return out
    if (
        scale_steps is not None
        and config is None
        and hopper_supports(a.device, n, out)
        and _tma_aligned(a, w)
    ):
        steps, last = scale_steps
        hopper_plain.launch(a, a_scale, w, last, expert_first_token_offset, out, steps)
        return out
    tiles = config or W4A8_TILES
    programs = persistent_programs(
        a.device, rows, experts, tiles.block_m, triton.cdiv(n, tiles.block_n)
    )
    _grouped_gemm_w4a8_kernel[(programs,)](
        a, a_scale, w, w_scale, expert_first_token_offset, out, n, k, experts,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=W4_GROUP,
        BLOCK_E=triton.next_power_of_2(experts), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def grouped_gemm_w4a8_gated(
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
    scale_steps: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[r] = act(gate, up)`` of the deinterleaved ``a[t] @ w13[e]^T``
    for each row ``r`` below ``expert_first_token_offset[-1]``, of expert
    ``e``, with ``t = src_routes[r] // topk``: fp8 tokens ``a`` [T, K] with
    ``a_scale`` [T], ``src_routes`` int32 [R], interleaved :func:`quantize_w4`
    weights ``w13`` [E, 2I, K / 2] with ``w13_scale`` [E, 2I, K / 128],
    ``out`` [R, I] bf16 or fp16; returns ``out``. ``scale_steps`` as in
    :func:`grouped_gemm_w4a8`."""
    experts, two_inter, _ = _check_weights("w13", w13, w13_scale, a)
    if two_inter % 2:
        raise arg_error("w13", f"an even row count (gate, up), got {two_inter}")
    rows = out.shape[0] if out.dim() == 2 else -1
    shape = (rows, two_inter // 2)
    _check_rows(a, a_scale, expert_first_token_offset, experts, out, shape)
    check_contiguous("src_routes", src_routes, torch.int32, (rows,), a.device)
    if topk < 1:
        raise arg_error("topk", f">= 1, got {topk}")
    if activation not in ACTIVATIONS:
        raise arg_error("activation", f"one of {list(ACTIVATIONS)}, got {activation!r}")
    if scale_steps is not None:
        _check_scale_steps("w13", scale_steps, w13_scale)
    if rows == 0 or experts == 0:
        return out
    if (
        scale_steps is not None
        and config is None
        and hopper_supports_gated(a, two_inter // 2, out)
        and _tma_aligned(w13)
    ):
        steps, last = scale_steps
        hopper_gated.launch_gated(
            a, a_scale, src_routes, topk, w13, last, expert_first_token_offset,
            activation, out, w13_steps=steps,
        )  # fmt: skip
        return out
    tiles = config or W4A8_GATED_TILES
    inter = two_inter // 2
    programs = persistent_programs(
        a.device, rows, experts, tiles.block_m, triton.cdiv(inter, tiles.block_n)
    )
    _grouped_gemm_w4a8_gated_kernel[(programs,)](
        a, a_scale, src_routes, w13, w13_scale, expert_first_token_offset, out,
        inter, a.shape[1], experts, topk, MODE=MODES[activation],
        ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=W4_GROUP,
        BLOCK_E=triton.next_power_of_2(experts), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


# -- references ----------------------------------------------------------------


def _products(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    tokens: torch.Tensor | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """:func:`~.reference.expert_products` of packed uint4 weights, each
    expert's dequantized only when it has rows."""

    def weight(e: int) -> torch.Tensor:
        return dequantize_w4(w[e], w_scale[e])

    for _, rows, product in expert_products(
        a, a_scale, w.shape[0], weight, offsets, tokens
    ):
        yield rows, product


def grouped_gemm_w4a8_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`grouped_gemm_w4a8` in plain PyTorch (fp32, rounded once)."""
    experts, n, _ = _check_weights("w", w, w_scale, a)
    _check_rows(a, a_scale, expert_first_token_offset, experts, out, (a.shape[0], n))
    for rows, product in _products(a, a_scale, w, w_scale, expert_first_token_offset):
        out[rows] = product.to(out.dtype)
    return out


def grouped_gemm_w4a8_gated_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`grouped_gemm_w4a8_gated` in plain PyTorch."""
    experts, two_inter, _ = _check_weights("w13", w13, w13_scale, a)
    shape = (out.shape[0], two_inter // 2)
    _check_rows(a, a_scale, expert_first_token_offset, experts, out, shape)
    if activation not in ACTIVATIONS:
        raise arg_error("activation", f"one of {list(ACTIVATIONS)}, got {activation!r}")
    tokens = src_routes.long() // topk
    offsets = expert_first_token_offset
    for rows, product in _products(a, a_scale, w13, w13_scale, offsets, tokens):
        y = gated_act_reference(activation, deinterleave_gate_up(product))
        out[rows] = y.to(out.dtype)
    return out
