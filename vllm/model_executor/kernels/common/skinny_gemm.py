"""``x @ weight.T`` for one or two rows of ``x`` and a short weight (a MoE
router or an attention output projection at decode; at one token also
q/k/v and the head), in Triton.

At decode a dense layer's GEMM streams its weight once for a token or two:
the time is the weight's bytes over HBM bandwidth, if enough of the GPU
pulls at once. cuBLAS does not spread short weights: on the H200 (one
token, CUDA-graph replay) Qwen3-30B-A3B's router (128 x 2048) ran on two
thread blocks, 4.9 us for 0.5 MB, and its output projection (2048 x 4096)
took a split-K kernel plus a reduction, 9.4 us. Here each program streams
``BLOCK_N`` weight rows as a matrix-vector product on the CUDA cores: the
output projection in 7.6 us at 4 rows x 1024 K per program (8.0 at 8 rows;
``benchmarks/tuning/tune_skinny_gemm.py``). For longer weights cuBLAS
streamed as fast or faster than stepped tiles alone (H200: q/k/v, 5120 x
2048: 8.1 vs 8.6 us; the head, 151936 x 2048: 149 vs 161 us), but not in
a decode step: there q/k/v follows another kernel, and this kernel,
launched with PDL, streams its first weight tiles while that one finishes
(7.8 against cuBLAS's 9.0 us past an RMSNorm,
``benchmarks/tuning/probe_l2_prefetch.py``; the norm now runs in the
prologue, below, and the q/k/v GEMM follows the previous layer's MoE), so
``skinny_gemm_applies`` admits 5120 rows at one token, and any number on
whole-K tiles (below). A ``tl.dot`` version of this kernel (rows padded to
16) lost everywhere.
``skinny_gemm_reference`` is the oracle.

``rms_norm_skinny_gemm`` also takes the decoder's residual add + RMSNorm
before the GEMM: each program computes the rows' 1/rms in a first pass over
them, then normalizes each K step before its products (rounded as
:func:`~.rms_norm.rms_norm` rounds), so the norm needs no launch of its own
(q/k/v at one token: 9.1-9.3 against 9.6-9.8 us for the norm's kernel then
this one, ``benchmark_skinny_gemm``; a one-pass variant lost, 11.2 us).

At one row and K <= 4096 (:func:`skinny_tiles`) a program's tile spans all
of K: every weight load is issued before the PDL wait, while the kernel
before runs, and one load of the row (the norm on it) follows the wait;
stepped tiles wait for a weight round trip per K step after it. In
Qwen3-30B-A3B's decode step (H100, batch 1) q/k/v and the output
projection went from 9.0 to 5.3 us each on the critical path, and the
head (151,936 x 2048), which cuBLAS streamed slower than these tiles
(H100: 219 against 199 us alone), moved off it: TPOT -17 us (fp8 and
bf16). Other one-row products of K <= 4096 past 5120 rows (a dense MLP's
gate/up) take them on that evidence alone, unmeasured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error, check_norm_operands
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait

SKINNY_MAX_ROWS = 2  # the products stay in registers: rows x 4 x 1024 fp32
SKINNY_MAX_N = 2048  # measured to win at 128 and 2048 weight rows, lose at 5120
# ... except at one row launched with PDL after a kernel launched with PDL
# (as q/k/v in a decode step): cuBLAS cannot start early, 9.0 against 7.8 us
# at 5120 rows
SKINNY_MAX_N_ONE_ROW = 5120
_BLOCK_N, _BLOCK_K = 4, 1024
# with the norm in the prologue (q/k/v, 5120 x 2048, at one row): 8.7 against
# 9.5 us at 4 x 1024 (``tune_skinny_gemm.py --fused``, H200)
_NORM_BLOCK_N, _NORM_BLOCK_K = 8, 512
# One row of K <= 4096 takes whole-K tiles: all of a program's weights load
# before the PDL wait, while the previous kernel runs, and one load of the
# row follows it (stepped tiles wait for a weight round trip per K step
# after it). Weights a program, by fp8 TPOT of Qwen3-30B-A3B's decode at
# batch 1 (H100): 16384 (4 x 4096, 8 x 2048) 2.378-2.381 ms; 8192 2.415;
# 4096 2.399; 16384 at 8 warps 2.405; 32768 at 8 warps 2.393. The head
# (151,936 x 2048) on these tiles: fp8 TPOT 2.360 / 2.363 against 2.379 /
# 2.379 ms on cuBLAS, bf16 2.861 against 2.878 (H100, one lease)
_WHOLE_K_MAX = 4096
_WHOLE_K_ELEMENTS = 16384


def skinny_gemm_applies(
    rows: int, n: int, k: int, dtype: torch.dtype, with_pdl: bool
) -> bool:
    """Whether ``skinny_gemm`` takes (and beats cuBLAS on) this product
    [rows, k] @ [n, k].T; ``with_pdl``: whether it would launch with PDL
    (:func:`~.pdl.pdl`). One row on whole-K tiles takes any ``n``: in a
    decode step it won at 5120 (q/k/v) and at 151,936 (the head, above)."""
    one_row = rows == 1 and with_pdl
    whole_k = one_row and skinny_tiles(rows, k, norm=False)[2]
    max_n = SKINNY_MAX_N_ONE_ROW if one_row else SKINNY_MAX_N
    return (
        0 < rows <= SKINNY_MAX_ROWS
        and (whole_k or n <= max_n)
        and dtype in (torch.bfloat16, torch.float16)
    )


@triton.jit
def _x_chunk(
    x_ptr, res_ptr, rows, offs_k, M, K, stride_xm, stride_rm, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Columns ``offs_k`` of the rows of ``x`` (``NORM`` and
    ``HAS_RESIDUAL``: of ``x + residual``, rounded to x's dtype as the
    unfused add rounds)."""
    mask = (rows < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0
    )
    if NORM:  # noqa: SIM102 (Triton: nested constexpr tests)
        if HAS_RESIDUAL:
            res_ptrs = res_ptr + rows[:, None] * stride_rm + offs_k[None, :]
            res = tl.load(res_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _normalize_chunk(
    x, rstd, norm_w_ptr, sum_ptr, normed_ptr, rows, offs_k, M, K,
    HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr,
):  # fmt: skip
    """Columns ``offs_k`` of the rows ``x`` normalized by ``rstd``
    [BLOCK_M] (as :func:`~.rms_norm.rms_norm` rounds them); program 0 also
    writes the sum (``HAS_RESIDUAL``) and the normalized rows
    (``STORE_NORMED``)."""
    dtype = x.dtype
    mask = (rows < M)[:, None] & (offs_k < K)[None, :]
    store = mask & (rows * 0 + tl.program_id(0) == 0)[:, None]  # program 0
    out_offs = rows[:, None] * K + offs_k[None, :]
    if HAS_RESIDUAL:
        tl.store(sum_ptr + out_offs, x, mask=store)
    weight = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0)
    x = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    x = (x * weight.to(tl.float32)[None, :]).to(dtype)
    if STORE_NORMED:
        tl.store(normed_ptr + out_offs, x, mask=store)
    return x


@triton.jit
def skinny_tile(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    cols,  # [BLOCK_N] weight rows of this program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    res_ptr,  # NORM and HAS_RESIDUAL: [M, K] residual, read only
    norm_w_ptr,  # NORM: [K] the RMSNorm's weight
    sum_ptr,  # NORM and HAS_RESIDUAL: [M, K] out, x + residual
    normed_ptr,  # STORE_NORMED: [M, K] out, the normalized rows
    stride_rm,
    eps,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_NORMED: tl.constexpr,
    WHOLE_K: tl.constexpr,  # one row, K <= BLOCK_K: a single tile per program
):
    """fp32 [BLOCK_M, BLOCK_N]: the rows of ``x`` (with ``NORM``: of
    ``rms_norm(x + residual)``, which program 0 also writes out) times
    weight rows ``cols``. Waits for the previous kernel
    (:func:`~.pdl.pdl_wait`) after loading the first weight tile (with
    ``WHOLE_K``, all of its weights), before it reads ``x``."""
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    col_ok = (cols < N)[:, None]
    # Each step loads the next step's weights (masked off past K): the
    # first tile streams while the previous kernel finishes
    w = tl.load(w_ptrs, mask=col_ok & (offs_k < K)[None, :], other=0.0)
    pdl_wait(PDL)
    if WHOLE_K:
        # One load of the row after the wait, no K loop, and no accumulator
        # (held across steps, [BLOCK_N, BLOCK_K] fp32 would spill)
        tl.static_assert(BLOCK_M == 1, "WHOLE_K takes one row")
        x = _x_chunk(
            x_ptr, res_ptr, rows, offs_k, M, K, stride_xm, stride_rm, NORM,
            HAS_RESIDUAL,
        )  # fmt: skip
        if NORM:
            x32 = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x32 * x32, 1) / K + eps)
            x = _normalize_chunk(
                x, rstd, norm_w_ptr, sum_ptr, normed_ptr, rows, offs_k, M, K,
                HAS_RESIDUAL, STORE_NORMED,
            )  # fmt: skip
        out = tl.sum(x.to(tl.float32) * w.to(tl.float32), 1)[None, :]
    else:
        if NORM:
            # 1/rms first: a pass over the (cached) rows before the products
            squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                s = _x_chunk(
                    x_ptr, res_ptr, rows, offs_k + k, M, K, stride_xm, stride_rm,
                    NORM, HAS_RESIDUAL,
                ).to(tl.float32)  # fmt: skip
                squares += s * s
            rstd = tl.rsqrt(tl.sum(squares, 1) / K + eps)
        # Products accumulate per K lane, reduced once at the end (a
        # reduction per step would shuffle between threads after every load)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = _x_chunk(
                x_ptr, res_ptr, rows, offs_k + k, M, K, stride_xm, stride_rm, NORM,
                HAS_RESIDUAL,
            )  # fmt: skip
            if NORM:
                x = _normalize_chunk(
                    x, rstd, norm_w_ptr, sum_ptr, normed_ptr, rows, offs_k + k, M,
                    K, HAS_RESIDUAL, STORE_NORMED,
                )  # fmt: skip
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            next_k = (offs_k + k + BLOCK_K < K)[None, :]
            w = tl.load(w_ptrs + k + BLOCK_K, mask=col_ok & next_k, other=0.0)
        out = tl.sum(acc, 2)
    return out


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    res_ptr,
    norm_w_ptr,
    sum_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WHOLE_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = skinny_tile(
        x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, cols,
        BLOCK_M, BLOCK_N, BLOCK_K, PDL,
        res_ptr, norm_w_ptr, sum_ptr, None, stride_rm, eps,
        NORM, HAS_RESIDUAL, False, WHOLE_K,
    )  # fmt: skip
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows < M)[:, None] & (cols < N),
    )


def check_skinny_operands(
    x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight"
) -> None:
    """Errors naming ``x`` or the weight unless :func:`skinny_tile` takes
    them."""
    if (
        x.dim() != 2
        or x.shape[0] > SKINNY_MAX_ROWS
        or x.stride(1) != 1
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        raise arg_error(
            "x", f"16-bit [M <= {SKINNY_MAX_ROWS}, K] with unit stride along K, got "
            f"{x.dtype} {list(x.shape)} (strides {x.stride()})",
        )  # fmt: skip
    k = x.shape[1]
    if (
        weight.dim() != 2
        or weight.shape[1] != k
        or weight.stride(1) != 1
        or weight.dtype != x.dtype
        or weight.device != x.device
    ):
        raise arg_error(
            weight_name, f"[N, {k}] {x.dtype} on {x.device} with unit stride along K, "
            f"got {weight.dtype} {list(weight.shape)} on {weight.device}",
        )  # fmt: skip


def skinny_tiles(
    rows: int, k: int, norm: bool, block_k: int | None = None
) -> tuple[int, int, bool]:
    """``(BLOCK_N, BLOCK_K, WHOLE_K)`` of a launch: whole-K tiles for one row
    where ``block_k`` covers K, or is None and K <= ``_WHOLE_K_MAX``;
    otherwise ``block_k`` (None: the shipped step) along K."""
    if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
        raise arg_error("block_k", f"a power of two >= 16, got {block_k}")
    if rows == 1 and (k <= _WHOLE_K_MAX if block_k is None else k <= block_k):
        block_k = block_k or max(16, triton.next_power_of_2(k))
        return max(1, _WHOLE_K_ELEMENTS // block_k), block_k, True
    if norm:
        return _NORM_BLOCK_N, block_k or _NORM_BLOCK_K, False
    return _BLOCK_N, block_k or _BLOCK_K, False


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, block_k: int | None = None
) -> torch.Tensor:
    """``x`` [M <= SKINNY_MAX_ROWS, K] @ ``weight`` [N, K].T in ``x``'s
    16-bit dtype (fp32 accumulation), both with unit stride along K;
    ``block_k``: see :func:`skinny_tiles` (tests take small ones)."""
    check_skinny_operands(x, weight)
    return _launch(x, weight, block_k, None)


def rms_norm_skinny_gemm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)`` in one launch:
    every program normalizes the rows itself before its products (a
    decoder layer's residual add and norm cost no launch of their own).
    The norm rounds as :func:`~.rms_norm.rms_norm`; the sum is a new tensor
    (``x`` itself without ``residual``)."""
    check_skinny_operands(x, weight)
    check_norm_operands(x, residual, norm_weight)
    total = (
        x
        if residual is None
        else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    norm = (residual, norm_weight, total, eps)
    return _launch(x, weight, block_k, norm), total


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_k: int | None,
    norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None,
) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    block_n, block_k, whole_k = skinny_tiles(m, k, norm is not None, block_k)
    residual, norm_weight, total, eps = norm or (None, None, None, 0.0)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n:
        launch_pdl = pdl(x.device)
        _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, residual, norm_weight, total,
            m, n, k, x.stride(0), weight.stride(0),
            0 if residual is None else residual.stride(0), eps,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            PDL=launch_pdl, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
            WHOLE_K=whole_k, num_warps=4, launch_pdl=launch_pdl,
        )  # fmt: skip
    return out


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.float() @ weight.float().T).to(x.dtype)
