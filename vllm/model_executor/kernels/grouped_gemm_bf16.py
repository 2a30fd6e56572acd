"""bf16/fp16 grouped GEMMs over expert-contiguous rows, on Hopper.

The 16-bit counterparts of :mod:`grouped_gemm_fp8`'s GEMMs, without scales,
run by the same warp-specialized Gluon kernels (:mod:`grouped_gemm_ws`):

``grouped_gemm_bf16``: ``out[r] = a[r] @ w[e]^T`` for the rows ``r`` of
expert ``e`` (``offsets[e]:offsets[e+1]``, the permute's
``expert_first_token_offset``).

``grouped_gemm_bf16_gated``: the first expert GEMM with the permute and the
gated activation fused in: row ``r`` reads its token's row straight from the
unpermuted input (``src_routes[r] // topk``) and the program writes
``act(gate, up)`` of w13's interleaved gate and up rows, so neither a
permuted copy of the tokens nor the [R, 2I] intermediate reaches memory.
That is what ``torch._grouped_mm`` cannot do: it takes permuted contiguous
rows and returns the whole product.

Hopper only (sm90; K a multiple of 8, and of 16 for the gathered rows of
the gated GEMM); elsewhere the unquantized layer runs ``torch._grouped_mm``.
The plain-PyTorch references are the oracle in tests and the CPU path.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels import grouped_gemm_ws as gluon_ws
from vllm.model_executor.kernels.common.activation_quant import gated_act_reference
from vllm.model_executor.kernels.common.checks import check_contiguous, check_tma_rows
from vllm.model_executor.kernels.common.device_info import capability, is_hopper
from vllm.model_executor.kernels.grouped_gemm_fp8 import deinterleave_gate_up

DTYPES = (torch.bfloat16, torch.float16)


def _check_runs_here(a: torch.Tensor, out: torch.Tensor) -> None:
    """The kernels run on Hopper and store ``out`` through TMA boxes."""
    if not is_hopper(a.device):
        raise ValueError(
            f"a: expected a tensor on a Hopper GPU (sm90), got {a.device} "
            f"(capability {capability(a.device)}); use torch._grouped_mm elsewhere"
        )
    if not gluon_ws.supports(a.device, out.shape[1], out):
        raise ValueError(
            f"out: expected a 16-byte aligned start and rows (TMA stores), got "
            f"{out.shape[1]} {out.dtype} columns at {out.data_ptr():#x}"
        )


def _check_dtypes(a: torch.Tensor, **others: torch.Tensor) -> None:
    if a.dtype not in DTYPES:
        raise ValueError(f"a: expected bfloat16 or float16, got {a.dtype}")
    for name, t in others.items():
        if t.dtype != a.dtype:
            raise ValueError(f"{name}: expected a's dtype {a.dtype}, got {t.dtype}")


def _check(
    a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
) -> None:
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, N, K], got shape {list(w.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected [R, K], got shape {list(a.shape)}")
    _check_dtypes(a, w=w, out=out)
    num_experts, n, k = w.shape
    rows = a.shape[0]
    for name, tensor, dtype, shape in (
        ("a", a, a.dtype, [rows, k]),
        ("w", w, a.dtype, [num_experts, n, k]),
        ("expert_first_token_offset", offsets, torch.int64, [num_experts + 1]),
        ("out", out, a.dtype, [rows, n]),
    ):
        check_contiguous(name, tensor, dtype, shape, w.device)


def grouped_gemm_bf16(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes the rows below ``expert_first_token_offset[-1]`` of ``out``
    [R, N] from ``a`` [R, K] and ``w`` [E, N, K] (all bf16, or all fp16);
    returns ``out``. The offsets (int64 [E + 1]) must ascend from 0 to at
    most R: they live on the device and are not checked (no host sync,
    CUDA-graph capturable)."""
    _check(a, w, expert_first_token_offset, out)
    if a.shape[0] == 0 or w.shape[0] == 0:  # no rows or no experts: nothing to write
        return out
    check_tma_rows("a", a)
    check_tma_rows("w", w)
    _check_runs_here(a, out)
    gluon_ws.launch(a, None, w, None, expert_first_token_offset, out)
    return out


def _check_gated(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    out: torch.Tensor,
) -> None:
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2 * I, K], got shape {list(w13.shape)}")
    if a.dim() != 2 or out.dim() != 2:
        raise ValueError(
            f"a, out: expected [T, K] and [R, I], got {list(a.shape)} and "
            f"{list(out.shape)}"
        )
    _check_dtypes(a, w13=w13, out=out)
    if activation not in ("silu", "swiglu"):
        raise ValueError(f"activation: expected 'silu' or 'swiglu', got {activation!r}")
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    num_experts, n, k = w13.shape
    tokens, rows = a.shape[0], out.shape[0]
    for name, tensor, dtype, shape in (
        ("a", a, a.dtype, [tokens, k]),
        ("src_routes", src_routes, torch.int32, [rows]),
        ("w13", w13, a.dtype, [num_experts, n, k]),
        ("expert_first_token_offset", offsets, torch.int64, [num_experts + 1]),
        ("out", out, a.dtype, [rows, n // 2]),
    ):
        check_contiguous(name, tensor, dtype, shape, w13.device)


def grouped_gemm_bf16_gated(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = act(gate, up)`` where ``[gate | up]`` is the deinterleaved
    ``a[t] @ w13[e]^T``, for each row ``r`` below
    ``expert_first_token_offset[-1]``, of expert ``e``, with
    ``t = src_routes[r] // topk``; returns ``out``.

    ``a`` [T, K]; ``src_routes`` int32 [R] (the permute's destination ->
    route index, each < T * topk); ``w13`` [E, 2I, K] with its gate and up
    rows interleaved (``interleave_gate_up``); ``out`` [R, I]; ``a``, ``w13``
    and ``out`` all bf16 or all fp16. Offsets and routes live on the device
    and are not checked, as in :func:`grouped_gemm_bf16`."""
    _check_gated(a, src_routes, topk, w13, expert_first_token_offset, activation, out)
    if out.shape[0] == 0 or w13.shape[0] == 0:
        return out
    check_tma_rows("a", a, 16)  # gathered by 16-byte copies
    check_tma_rows("w13", w13, 16)
    _check_runs_here(a, out)
    gluon_ws.launch_gated(
        a,
        None,
        src_routes,
        topk,
        w13,
        None,
        expert_first_token_offset,
        activation,
        out,
    )
    return out


def grouped_gemm_bf16_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Plain PyTorch, fp32 per expert: the oracle in tests and the CPU path."""
    _check(a, w, expert_first_token_offset, out)
    bounds = expert_first_token_offset.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            out[lo:hi] = (a[lo:hi].float() @ w[e].float().t()).to(out.dtype)
    return out


def grouped_gemm_bf16_gated_reference(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
) -> torch.Tensor:
    """Plain PyTorch, fp32 per expert: the oracle in tests and the CPU path."""
    _check_gated(a, src_routes, topk, w13, expert_first_token_offset, activation, out)
    bounds = expert_first_token_offset.tolist()
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            tokens = src_routes[lo:hi].long() // topk
            product = a[tokens].float() @ w13[e].float().t()
            y = gated_act_reference(activation, deinterleave_gate_up(product))
            out[lo:hi] = y.to(out.dtype)
    return out
