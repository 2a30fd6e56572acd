"""The Triton kernels of the Marlin-style W4A16 GEMM (launched by :mod:`.gemm`).

``C[M, N] = A[M, K] @ dequant(B)^T`` with B in the layout of :mod:`.packing`
(nibbles ``i`` and ``i + 4`` of a word hold a (k, k + 1) pair), so one
``(word >> 4i) & 0x000F000F`` yields both halves of a pair, which an OR with
the float pattern of 128 (bf16) or 1024 (fp16) turns into the two 16-bit
floats ``magic + q`` without any int-to-float conversion.

The kernels compute the transposed product ``C^T = W @ A^T`` (swap A/B): the
dequantized weights are the dot's left operand and M is the dot's N dimension,
so small M pads only to 16. Split-K reduces the K slices of one output tile
into C in slice order under a per-tile int32 lock (Marlin's protocol): slice
``s`` waits for ``lock == s``, adds (slice 0 stores), then sets ``s + 1``; the
last slice brings it back to 0, so every call leaves the lock buffer zero and
no memset is needed between calls.

Only ``@triton.jit`` code lives here: no checks, no host-side heuristics. The
entry kernels are launched only by :mod:`.gemm` and keep their names from
before the package split, so compiled binaries and profiler names match.
"""

import triton
import triton.language as tl


@triton.jit
def _dequant_mma(
    a_ptr,
    b_ptr,  # this tile's expert (grouped) or the whole matrix (dense)
    s_ptr,
    rm,  # [BLOCK_M] A rows to read (all valid: masked rows clamped)
    offs_n,
    mask_n,
    N,
    stride_am,
    stride_bn,
    k_iter0,  # first K step of this slice
    iters,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr,
    F32_MATH: tl.constexpr,
):
    """fp32 ``acc[BLOCK_N, BLOCK_M] = dequant(B[offs_n, slice]) @ A[rm, slice]^T``."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    # 16-bit float patterns: bf16 0x4300 = 128.0, fp16 0x6400 = 1024.0; both
    # represent magic + q exactly for q < 16.
    magic = 0x43004300 if IS_BF16 else 0x64006400
    bias = 136.0 if IS_BF16 else 1032.0  # magic + 8
    dtype = tl.bfloat16 if IS_BF16 else tl.float16
    ASM_DEQUANT: tl.constexpr = (
        "{ .reg .b32 t; add.rn.bf16x2 t, $1, $2; mul.rn.bf16x2 $0, t, $3; }"
        if IS_BF16
        else "{ .reg .b32 t; add.rn.f16x2 t, $1, $2; mul.rn.f16x2 $0, t, $3; }"
    )
    shifts = (tl.arange(0, 4) * 4)[None, None, :]

    b_ptrs = (
        b_ptr
        + offs_n[:, None] * stride_bn
        + (k_iter0 * (BLOCK_K // 8) + offs_w)[None, :]
    )
    a_ptrs = (
        a_ptr
        + rm.to(tl.int64)[None, :] * stride_am
        + (k_iter0 * BLOCK_K + offs_k)[:, None]
    )
    # Every slice has K steps (the launchers check it). Without the hint the
    # loop's zero-trip path zeroes the accumulator on its own, and ptxas
    # serializes every wgmma of the 4-warp tiles without split-K (Triton 3.6
    # and 3.9).
    tl.assume(iters > 0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(iters):
        packed = tl.load(
            b_ptrs, mask=mask_n[:, None], other=0
        )  # [BLOCK_N, BLOCK_K // 8] int32
        a = tl.load(a_ptrs)  # [BLOCK_K, BLOCK_M]
        pairs = ((packed[:, :, None] >> shifts) & 0x000F000F) | magic
        lo = pairs.to(tl.int16).to(dtype, bitcast=True)  # k = 8c + 2i
        hi = (pairs >> 16).to(tl.int16).to(dtype, bitcast=True)  # k = 8c + 2i + 1
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # magic + q
        if GROUP_SIZE > 0:
            group = ((k_iter0 + i) * BLOCK_K) // GROUP_SIZE
            scale = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0)[:, None]
        else:
            scale = tl.full((BLOCK_N, 1), 1.0, dtype)
        if F32_MATH:
            # (q - 8) exact, times the scale: one rounding, as the reference.
            w = ((w.to(tl.float32) - bias) * scale.to(tl.float32)).to(dtype)
            acc = tl.dot(
                w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee"
            )
        else:
            # Triton lowers 16-bit float math through fp32; packed x2
            # instructions do two weights per op (sub is exact, mul rounds once).
            w = tl.inline_asm_elementwise(
                ASM_DEQUANT,
                "=r,r,r,r",
                [
                    w,
                    tl.full((BLOCK_N, BLOCK_K), -bias, dtype),
                    scale.broadcast_to(w.shape),
                ],
                dtype=dtype,
                is_pure=True,
                pack=2,
            )
            acc = tl.dot(w, a, acc)
        b_ptrs += BLOCK_K // 8
        a_ptrs += BLOCK_K
    if GROUP_SIZE < 0:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _store_tile(
    c_ptr,
    lock,  # this output tile's counter
    acc,
    offs_m,
    mask_m,
    offs_n,
    mask_n,
    stride_cm,
    pid_k,
    SPLIT_K: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """Write ``acc^T`` to C; split-K slices add into it in order under ``lock``."""
    dtype = tl.bfloat16 if IS_BF16 else tl.float16
    # int64: M x N may exceed 2^31 elements (e.g. a vocabulary-sized N).
    c_ptrs = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    c_mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(dtype), mask=c_mask)
    else:
        # Spin on plain (volatile) loads, which do not queue at the L2 atomic
        # unit like RMWs do, then acquire once. A counter outside 0..SPLIT_K-1
        # cannot come from this protocol (the buffer was not zero at launch):
        # go on rather than spin forever. One inside that range silently
        # reorders the slices: the buffer must be zero at launch.
        seen = tl.load(lock, volatile=True)
        while (seen != pid_k) & (seen >= 0) & (seen < SPLIT_K):
            seen = tl.load(lock, volatile=True)
        tl.atomic_add(lock, 0, sem="acquire")
        # The acquire may be issued by one thread: order every thread's reads
        # of the previous slice's sum after it.
        tl.debug_barrier()
        if pid_k == 0:
            tl.store(c_ptrs, acc.to(dtype), mask=c_mask)
        else:
            # .cg: read the previous slice's sum from L2, not a stale L1 line.
            prev = tl.load(c_ptrs, mask=c_mask, cache_modifier=".cg")
            tl.store(c_ptrs, (acc + prev.to(tl.float32)).to(dtype), mask=c_mask)
        # Every thread's stores happen before the release below.
        tl.debug_barrier()
        # Relative updates (+1, the last slice -(SPLIT_K - 1)) bring a clean
        # counter back to 0 and leave a poisoned one visibly non-zero.
        step = tl.where(pid_k < SPLIT_K - 1, 1, 1 - SPLIT_K)
        tl.atomic_add(lock, step, sem="release")


@triton.jit
def _marlin_gemm_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,  # K // 8, passed so Triton sees its divisibility (16 B loads)
    stride_cm,
    iters_per_slice,
    GROUP_SIZE: tl.constexpr,  # -1: per-channel scales
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_N: tl.constexpr,  # n-tiles per swizzle group (L2 reuse of A)
    IS_BF16: tl.constexpr,
    # The interpreter keeps bf16 as uint16 and does integer math on it (also in
    # tl.dot), so it dequantizes and multiplies in fp32; the GPU dequantizes in
    # 16-bit and feeds the tensor cores 16-bit operands.
    F32_MATH: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # Slice-major order: slice s of a tile has a higher program id than slice
    # s - 1, so a program only waits on lower ids (the interpreter runs ids in
    # order, the GPU schedules lower ids first).
    pid_k = pid // num_tiles
    tile = pid % num_tiles
    tiles_in_group = GROUP_N * num_pid_m
    first_n = (tile // tiles_in_group) * GROUP_N
    group_n = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (tile % tiles_in_group) % group_n
    pid_m = (tile % tiles_in_group) // group_n

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    # Clamp A rows instead of masking them: rows past M are never stored.
    rm = tl.where(mask_m, offs_m, 0)
    acc = _dequant_mma(
        a_ptr,
        b_ptr,
        s_ptr,
        rm,
        offs_n,
        mask_n,
        N,
        stride_am,
        stride_bn,
        pid_k * iters_per_slice,
        iters_per_slice,
        GROUP_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IS_BF16,
        F32_MATH,
    )
    _store_tile(
        c_ptr,
        lock_ptr + tile,
        acc,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        stride_cm,
        pid_k,
        SPLIT_K,
        IS_BF16,
    )


@triton.jit
def _marlin_gemm_grouped_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    lock_ptr,
    offsets_ptr,  # int64 [E + 1]: rows of expert e are offsets[e]:offsets[e + 1]
    N,
    K,
    stride_am,
    stride_bn,  # K // 8
    stride_be,  # N * K // 8
    stride_se,  # groups * N
    stride_cm,
    iters_per_slice,
    num_m_tiles,  # host bound on the M-tiles of all experts together
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # NUM_EXPERTS rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IS_BF16: tl.constexpr,
    F32_MATH: tl.constexpr,  # as in _marlin_gemm_kernel
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m_tiles * num_pid_n
    # Slice-major, as in the dense kernel; the N-tiles of one M-tile are
    # neighbours (same expert, same A rows).
    pid_k = pid // num_tiles
    tile = pid % num_tiles
    m_tile = tile // num_pid_n
    pid_n = tile % num_pid_n

    # The offsets stay on the device: every program finds its expert from the
    # running sum of per-expert M-tile counts (cheap for a few hundred experts).
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < NUM_EXPERTS
    starts = tl.load(offsets_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + offs_e + 1, mask=mask_e, other=0).to(tl.int32)
    tiles_e = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles_e, axis=0)
    expert = tl.sum((tile_ends <= m_tile).to(tl.int32), axis=0)
    if expert >= NUM_EXPERTS:
        return  # past the last expert's tiles (all slices of the tile agree)
    this = offs_e == expert
    first_tile = tl.sum(tl.where(this, tile_ends - tiles_e, 0), axis=0)
    row_start = tl.sum(tl.where(this, starts, 0), axis=0)
    row_start += (m_tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < row_end
    # Clamp to the tile's first row (valid): rows past it belong to another
    # expert or to the unspecified tail and are never stored.
    rm = tl.where(mask_m, offs_m, row_start)
    expert_64 = expert.to(tl.int64)
    acc = _dequant_mma(
        a_ptr,
        b_ptr + expert_64 * stride_be,
        s_ptr + expert_64 * stride_se,
        rm,
        offs_n,
        mask_n,
        N,
        stride_am,
        stride_bn,
        pid_k * iters_per_slice,
        iters_per_slice,
        GROUP_SIZE,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IS_BF16,
        F32_MATH,
    )
    _store_tile(
        c_ptr,
        lock_ptr + tile,
        acc,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        stride_cm,
        pid_k,
        SPLIT_K,
        IS_BF16,
    )
