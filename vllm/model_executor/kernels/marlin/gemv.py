"""The Marlin-style W4A16 GEMM at decode sizes (a few rows of A), on the CUDA
cores: launched by :func:`~.gemm.marlin_gemm` where :func:`gemv_applies`.

At a few rows the GEMM only has to stream the packed weights once; the
tensor-core kernel (:mod:`.kernels`) pads M to 16 and runs a serial global ->
shared -> register -> dequantize -> layout-convert -> wgmma chain per K step,
which keeps it near a third of the copy bandwidth (docs/marlin.md). Here
each program multiplies ``BLOCK_N`` whole weight rows, one packed word per
lane and row (see :func:`dot_rows`), the next K step's words in flight
while the current ones are multiplied; nothing goes through shared memory.

Dequantization without shifts or int-to-float conversions: nibble ``i`` of a
word, masked in place (``word & 0xF << 4i``) and ORed into the fp32 pattern of
2^(23 - 4i), reads as ``2^(23 - 4i) + q`` exactly (the mantissa's step at that
exponent is 16^-i); subtracting ``2^(23 - 4i) + 8`` leaves ``q - 8``. The
upper four nibbles take one shift per word. So a weight costs a LOP3 (inline
PTX: written in Triton, ptxas splits the mask-and-or in two), an FSUB and
one FMA per row of A; each product is scaled by its word's group
scale and summed in fp32 (no weight is rounded to 16 bits: closer to the
exact product than the tensor-core kernel). Where the K step divides K the
loop has no bounds checks: rows past N or M repeat the last row instead of
being masked (SASS for sm_90, one row, (8, 1024, 2): 765 -> 534 instructions per
step of 128 weights a thread).
No split-K: the lock workspace is not touched.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.device_info import inline_ptx
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait
from vllm.model_executor.kernels.marlin.config import TILE_K

# Up to this many rows of A the kernel takes a GemvConfig (its accumulators);
# gemv_applies says when it beats the tensor-core kernel.
GEMV_MAX_M = 4


def gemv_applies(m: int) -> bool:
    """Whether ``marlin_gemm`` takes this kernel by default. Measured on the
    H200 (benchmarks/RESULTS.md, ``tune_marlin_gemv.py``): at 1 and 2 rows
    it wins on every shape (2 rows: 6.5 against 11.9 us on 4096 x 4096,
    21.1 against 23.9 on 8192 x 8192); at 4 its FMAs (4 per weight) and
    registers (spills with 8 rows of 1024) make it slower than the
    tensor-core kernel, whose time does not grow with the rows."""
    return m <= 2


@dataclass(frozen=True)
class GemvConfig:
    """Weight rows per program, K columns per step (a multiple of ``TILE_K``)
    and warps."""

    block_n: int
    block_k: int
    num_warps: int


def default_gemv_config(m: int, k: int) -> GemvConfig:
    """Within 7% (one row) and 9% (two rows) of the best of 18 configs on
    each of the four large shapes of ``tune_marlin_gemv.py`` (H200): one
    row streams long K steps (more bytes in flight per register), two rows
    need the registers for a second set of products. One row of K <= 2048
    (Qwen3-30B-A3B's qkv, 5120 x 2048) is fastest in narrow one-warp
    programs: 4.0 against 5.2 us."""
    if m > 1:
        return GemvConfig(8, 1024, 4)
    return GemvConfig(2, 1024, 1) if k <= 2048 else GemvConfig(4, 2048, 2)


def check_tile(block_n: int, block_k: int, num_warps: int, config: object) -> None:
    """Errors naming ``config`` unless :func:`dot_rows` takes the tile."""
    if block_k % TILE_K or block_k & (block_k - 1):
        raise ValueError(
            f"config: block_k must be a power of two multiple of {TILE_K}: {config}"
        )
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"config: num_warps must be 1, 2, 4 or 8: {config}")
    if block_k // 8 < 32 * num_warps:
        raise ValueError(
            f"config: block_k / 8 words must cover the 32 x num_warps lanes: {config}"
        )
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"config: block_n must be a power of two: {config}")


@triton.jit
def _nibble(words, i: tl.constexpr, ASM: tl.constexpr):
    """fp32 ``q - 8`` of nibble ``i`` of each word: masked in place and ORed
    into the fp32 pattern of 2^(23 - 4i), it reads as 2^(23 - 4i) + q."""
    mask = tl.full(words.shape, 15 << (4 * i), tl.int32)
    exponent = tl.full(words.shape, (150 - 4 * i) << 23, tl.int32)
    if ASM:
        # One LOP3 (a & b) | c: written in Triton, ptxas splits it in two
        # (both constants do not fit one instruction as immediates).
        pattern = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [words, mask, exponent],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        pattern = (words & mask) | exponent
    return pattern.to(tl.float32, bitcast=True) - ((1 << (23 - 4 * i)) + 8)


@triton.jit
def _row_terms(
    x_ptrs,  # [WORDS, 8] one row of A at this K step, or [WORDS, ROWS, 8]
    k_left,  # its columns from here on
    EVEN_K: tl.constexpr,
    X_PER_ROW: tl.constexpr,  # x_ptrs has a row of A per weight row
    w0,
    w1,
    w2,
    w3,
    w4,
    w5,
    w6,
    w7,  # [ROWS, WORDS] q - 8 of columns 0..7 of each word
):
    """fp32 [ROWS, WORDS]: each word's 8 weights times the row's columns."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        offs = tl.arange(0, w0.shape[1])[:, None] * 8 + tl.arange(0, 8)[None, :]
        if X_PER_ROW:
            offs = offs[:, None, :]
        x = tl.load(x_ptrs, mask=offs < k_left, other=0.0).to(tl.float32)
    # Column j = 4a + 2b + c of the word, split out as x_j.
    if X_PER_ROW:
        x = tl.reshape(tl.permute(x, (1, 0, 2)), (x.shape[1], x.shape[0], 2, 2, 2))
    else:
        x = tl.reshape(x, (1, x.shape[0], 2, 2, 2))  # one row for every weight row
    x_c0, x_c1 = tl.split(x)
    x_b0c0, x_b1c0 = tl.split(x_c0)
    x_b0c1, x_b1c1 = tl.split(x_c1)
    x0, x4 = tl.split(x_b0c0)
    x2, x6 = tl.split(x_b1c0)
    x1, x5 = tl.split(x_b0c1)
    x3, x7 = tl.split(x_b1c1)
    return w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3 + w4 * x4 + w5 * x5 + w6 * x6 + w7 * x7


@triton.jit
def _load_words(w_ptrs, offs_w, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed words of K step ``k``: from a step past the last the last
    step's again where ``EVEN_K`` (in bounds, unused), else 0x88888888 past
    K (every nibble 8: weight 0)."""
    if EVEN_K:
        return tl.load(w_ptrs + tl.minimum(k, K - BLOCK_K) // 8)
    return tl.load(
        w_ptrs + k // 8, mask=(offs_w + k // 8 < K // 8)[None, :], other=-2004318072
    )


@triton.jit
def dot_rows(
    w_rows,  # [BLOCK_N] pointers to each weight row's first packed word
    s_rows,  # [BLOCK_N] pointers to each row's scale of group 0 (or channel)
    x_ptr,  # row 0 of A, or [BLOCK_N] rows of A, one per weight row
    stride_xm,
    M,  # rows of A (1 to BLOCK_M)
    K,
    s_group_stride,  # elements from one group's scales to the next
    GROUP_SIZE: tl.constexpr,  # -1: per-channel scales
    BLOCK_M: tl.constexpr,  # <= 4
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no bounds checks in the loop
    ASM: tl.constexpr,  # inline PTX allowed (:func:`inline_ptx`)
    PDL: tl.constexpr,
    X_PER_ROW: tl.constexpr = False,  # x_ptr per weight row (BLOCK_M 1)
    NIBBLES_IN_ORDER: tl.constexpr = False,  # nibble i: column i (W4A8's packing)
):
    """fp32 [BLOCK_N] products of the dequantized weight rows with each of
    the (up to 4) rows of A, or with each weight row's own row of A
    (``X_PER_ROW``: the activations then arrive per row, 16 bytes per
    packed word instead of per lane). Every row pointer must be in bounds: callers
    clamp rows past N to the last one and do not store their sums; rows of
    A past M repeat row M - 1 the same way.

    Callers compute ``w_rows`` / ``s_rows`` from unspecialized strides, so
    that Triton cannot prove the rows 16-byte aligned: the weights are then
    read one word per lane (4-byte loads, 128 B per warp) and a lane holds
    the same words of every row, whose activations arrive in one 16-byte
    load per word, shared by the BLOCK_N rows. With 16-byte weight loads a
    lane would hold 4 words, and their activations would pass through
    shared memory (a layout conversion per K step).

    With ``PDL`` it waits for the previous kernel (:func:`~.pdl.pdl_wait`)
    after loading its first weights, before it reads A.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, WORDS)
    w_ptrs = w_rows[:, None] + offs_w[None, :]
    offs_x = offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    # Per weight row: [WORDS, BLOCK_N, 8], words first, so that Triton lays
    # them over the lanes as in the weights (rows first: a conversion per step).
    x0_ptrs = x_ptr[None, :, None] + offs_x[:, None, :] if X_PER_ROW else x_ptr + offs_x
    x1_ptrs = x0_ptrs + tl.minimum(1, M - 1) * stride_xm
    x2_ptrs = x0_ptrs + tl.minimum(2, M - 1) * stride_xm
    x3_ptrs = x0_ptrs + tl.minimum(3, M - 1) * stride_xm
    if GROUP_SIZE > 0:
        # Group scales per word, not per group: a group spans lanes, and
        # summing it across them every step costs more shuffles than these
        # loads (lanes of one group read one address). Loaded as [WORDS,
        # BLOCK_N] and transposed: Triton then lays the words over the lanes
        # as in the weights (no shared-memory conversion).
        group = (offs_w * 8) // GROUP_SIZE
        s_ptrs = s_rows[None, :] + group[:, None] * s_group_stride
    acc0 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    packed = _load_words(w_ptrs, offs_w, 0, K, BLOCK_K, EVEN_K)
    pdl_wait(PDL)
    for k in range(0, K, BLOCK_K):
        packed_next = _load_words(w_ptrs, offs_w, k + BLOCK_K, K, BLOCK_K, EVEN_K)
        upper = packed >> 16
        # w_j: the weights of column j of each word, from nibbles 0..7.
        w0 = _nibble(packed, 0, ASM)
        n1 = _nibble(packed, 1, ASM)
        n2 = _nibble(packed, 2, ASM)
        n3 = _nibble(packed, 3, ASM)
        n4 = _nibble(upper, 0, ASM)
        n5 = _nibble(upper, 1, ASM)
        n6 = _nibble(upper, 2, ASM)
        w7 = _nibble(upper, 3, ASM)
        if NIBBLES_IN_ORDER:
            w1, w2, w3, w4, w5, w6 = n1, n2, n3, n4, n5, n6
        else:  # Marlin's: nibble i < 4 holds column 2i, nibble i + 4 column 2i + 1
            w1, w2, w3, w4, w5, w6 = n4, n1, n5, n2, n6, n3
        if GROUP_SIZE > 0:
            if BLOCK_K % GROUP_SIZE == 0:  # k starts a group: lane offsets fixed
                s_step = s_ptrs + (k // GROUP_SIZE) * s_group_stride
            else:
                group = (k + offs_w * 8) // GROUP_SIZE
                s_step = s_rows[None, :] + group[:, None] * s_group_stride
            if EVEN_K:
                scale = tl.load(s_step).to(tl.float32).T
            else:
                s_ok = (offs_w * 8 < K - k)[:, None]
                scale = tl.load(s_step, mask=s_ok, other=0.0).to(tl.float32).T
        else:
            scale = tl.full((BLOCK_N, WORDS), 1.0, tl.float32)
        acc0 += scale * _row_terms(
            x0_ptrs + k, K - k, EVEN_K, X_PER_ROW, w0, w1, w2, w3, w4, w5, w6, w7
        )
        if BLOCK_M > 1:
            acc1 += scale * _row_terms(
                x1_ptrs + k, K - k, EVEN_K, X_PER_ROW, w0, w1, w2, w3, w4, w5, w6, w7
            )
        if BLOCK_M > 2:
            acc2 += scale * _row_terms(
                x2_ptrs + k, K - k, EVEN_K, X_PER_ROW, w0, w1, w2, w3, w4, w5, w6, w7
            )
            acc3 += scale * _row_terms(
                x3_ptrs + k, K - k, EVEN_K, X_PER_ROW, w0, w1, w2, w3, w4, w5, w6, w7
            )
        packed = packed_next
    if GROUP_SIZE < 0:
        channel = tl.load(s_rows).to(tl.float32)
    else:
        channel = tl.full((BLOCK_N,), 1.0, tl.float32)
    return (
        tl.sum(acc0, axis=1) * channel,
        tl.sum(acc1, axis=1) * channel,
        tl.sum(acc2, axis=1) * channel,
        tl.sum(acc3, axis=1) * channel,
    )


@triton.jit(do_not_specialize=["stride_bn", "stride_sn"])
def _marlin_gemv_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,  # K // 8, unspecialized (see dot_rows)
    stride_sn,  # 1, unspecialized: scales are read in the weights' layout
    stride_cm,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.minimum(offs_n, N - 1)  # rows past N repeat the last (not stored)
    out0, out1, out2, out3 = dot_rows(
        b_ptr + rows.to(tl.int64) * stride_bn, s_ptr + rows * stride_sn,
        a_ptr, stride_am, M, K, N, GROUP_SIZE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
        ASM, PDL,
    )  # fmt: skip
    dtype = c_ptr.dtype.element_ty
    c_ptrs = c_ptr + offs_n
    row = tl.zeros((BLOCK_N,), dtype=tl.int32)  # the row stored, as a vector
    tl.store(c_ptrs, out0.to(dtype), mask=mask_n)
    if BLOCK_M > 1:
        tl.store(c_ptrs + stride_cm, out1.to(dtype), mask=mask_n & (row + 1 < M))
    if BLOCK_M > 2:
        tl.store(c_ptrs + 2 * stride_cm, out2.to(dtype), mask=mask_n & (row + 2 < M))
        tl.store(c_ptrs + 3 * stride_cm, out3.to(dtype), mask=mask_n & (row + 3 < M))


def launch_gemv(
    a: torch.Tensor,
    b_packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    group_size: int,
    cfg: GemvConfig,
) -> None:
    """One launch over checked arguments (:func:`~.gemm.marlin_gemm` checks)."""
    m, k = a.shape
    n = out.shape[1]
    if m > GEMV_MAX_M:
        raise ValueError(f"a: at most {GEMV_MAX_M} rows for a GemvConfig, got {m}")
    check_tile(cfg.block_n, cfg.block_k, cfg.num_warps, cfg)
    launch_pdl = pdl(a.device)
    _marlin_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        a,
        b_packed,
        scales,
        out,
        m,
        n,
        k,
        a.stride(0),
        b_packed.stride(0),
        scales.stride(1),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        ASM=inline_ptx(a.device, _marlin_gemv_kernel),
        PDL=launch_pdl,
        num_warps=cfg.num_warps,
        launch_pdl=launch_pdl,
    )
