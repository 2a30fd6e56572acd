"""The grouped GEMMs over expert-contiguous rows: one API for fp8 and
bf16/fp16 operands, checked against one table of what each dtype needs.

:func:`grouped_gemm`: ``out[r] = a[r] @ w[e]^T`` for the rows ``r`` of
expert ``e`` (``offsets[e]:offsets[e+1]``, the permute's
``expert_first_token_offset``); fp8 operands scale it by ``a_scale[r]`` and
``w_scale[e]``.

:func:`grouped_gemm_gated`: the first expert GEMM with the permute and the
gated activation fused in: row ``r`` reads its token's row straight from
the unpermuted input (``src_routes[r] // topk``) and the kernel writes
``act(gate, up)`` of w13's interleaved gate and up rows, so neither a
permuted copy of the tokens nor the [R, 2I] intermediate reaches memory
(what ``torch._grouped_mm`` cannot do: it takes permuted contiguous rows and
returns the whole product).

Every call checks its arguments (:data:`OPERANDS`, shapes, TMA alignment)
before any launch; :mod:`.dispatch` picks the kernel. The expert offsets
(int64 [E + 1]) must ascend from 0 to at most R, and the routes be below
T * topk: they live on the device and are not checked, so that a call needs
no host sync and no allocation (CUDA-graph capturable). Rows at or past
``offsets[E]`` are never written.

:func:`grouped_gemm_fp8` and :func:`grouped_gemm_fp8_gated` take fp8
operands in the argument order the expert layers use (each scale after its
tensor). The plain-PyTorch references are in :mod:`.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.kernels.common.activation_quant import ACTIVATIONS
from vllm.model_executor.kernels.common.checks import check_contiguous, check_tma_rows
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    hopper_gated,
    hopper_plain,
    triton_kernels,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import (
    GroupedGemmConfig,
    Kernel,
    default_config,
    default_gated_config,
    gated_kernel,
    plain_kernel,
)
from vllm.model_executor.kernels.grouped_gemm.layout import act_groups


@dataclass(frozen=True)
class Operands:
    """What the grouped GEMMs need of ``a`` and ``w`` of one dtype."""

    # fp32 scales: a_scale per row [R] (or per row and group of 128 K
    # columns, [R, act_groups(K)]), w_scale per output channel [E, N].
    scaled: bool
    out_dtypes: tuple[torch.dtype, ...]  # the plain GEMM's out
    gated_out_dtypes: tuple[torch.dtype, ...]  # fp8: with out_scale
    # K's multiple for 16-byte operand rows (TMA boxes); the gated GEMM's
    # token rows, gathered by 16-byte copies, need GATHERED_K_MULTIPLE.
    k_multiple: int
    # Only the Hopper kernels (a Hopper GPU, sm90) run them; otherwise the
    # Triton kernels (any CUDA GPU) too.
    hopper_only: bool


OPERANDS = {
    FP8_DTYPE: Operands(
        scaled=True,
        out_dtypes=(torch.bfloat16, torch.float16),
        gated_out_dtypes=(torch.bfloat16, torch.float16, FP8_DTYPE),
        k_multiple=16,
        hopper_only=False,
    ),
    **{
        dtype: Operands(
            scaled=False,
            out_dtypes=(dtype,),
            gated_out_dtypes=(dtype,),
            k_multiple=8,
            hopper_only=True,
        )
        for dtype in (torch.bfloat16, torch.float16)
    },
}
# The compiler proves gathered rows 16-byte aligned only from K a multiple
# of 16 elements, whatever their size.
GATHERED_K_MULTIPLE = 16


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    """'bfloat16, float16 or float8_e4m3fn'."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return " or ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)


def _operands(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    w_name: str,
) -> Operands:
    """``a``'s row of :data:`OPERANDS`, with the scales it needs given."""
    spec = OPERANDS.get(a.dtype)
    if spec is None:
        raise ValueError(f"a: expected {_names(tuple(OPERANDS))}, got {a.dtype}")
    for name, scale in (("a_scale", a_scale), (f"{w_name}_scale", w_scale)):
        if (scale is not None) != spec.scaled:
            expected, got = (
                ("a tensor", "None") if spec.scaled else ("None", "a tensor")
            )
            raise ValueError(
                f"{name}: expected {expected} for {_names((a.dtype,))} operands, "
                f"got {got}"
            )
    return spec


def check_plain(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
) -> Operands:
    """Raise naming the first argument of a :func:`grouped_gemm` call that
    does not fit; returns the operands' :data:`OPERANDS` row."""
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, N, K], got shape {list(w.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected [R, K], got shape {list(a.shape)}")
    spec = _operands(a, a_scale, w_scale, "w")
    num_experts, n, k = w.shape
    rows = a.shape[0]
    check_contiguous("a", a, a.dtype, [rows, k], w.device)
    if a_scale is not None:
        groups = [act_groups(k)] if a_scale.dim() == 2 else []
        check_contiguous("a_scale", a_scale, torch.float32, [rows, *groups], w.device)
    check_contiguous("w", w, a.dtype, [num_experts, n, k], w.device)
    if w_scale is not None:
        check_contiguous("w_scale", w_scale, torch.float32, [num_experts, n], w.device)
    check_contiguous(
        "expert_first_token_offset",
        offsets,
        torch.int64,
        [num_experts + 1],
        w.device,
    )
    if out.dtype not in spec.out_dtypes:
        raise ValueError(f"out: expected {_names(spec.out_dtypes)}, got {out.dtype}")
    check_contiguous("out", out, out.dtype, [rows, n], w.device)
    return spec


def check_gated(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    out_scale: torch.Tensor | None,
) -> Operands:
    """:func:`check_plain` for a :func:`grouped_gemm_gated` call."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2 * I, K], got shape {list(w13.shape)}")
    if a.dim() != 2:
        raise ValueError(f"a: expected [T, K], got shape {list(a.shape)}")
    spec = _operands(a, a_scale, w13_scale, "w13")
    if out.dim() != 2 or out.dtype not in spec.gated_out_dtypes:
        raise ValueError(
            f"out: expected a {_names(spec.gated_out_dtypes)} [R, I], got "
            f"{list(out.shape)} {out.dtype}"
        )
    if (out_scale is None) != (out.dtype != FP8_DTYPE):
        raise ValueError(
            f"out_scale: required for (and only for) an fp8 out; got "
            f"{None if out_scale is None else 'a tensor'} for a {out.dtype} out"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}"
        )
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    num_experts, n, k = w13.shape
    tokens, rows = a.shape[0], out.shape[0]
    check_contiguous("a", a, a.dtype, [tokens, k], w13.device)
    if a_scale is not None:
        check_contiguous("a_scale", a_scale, torch.float32, [tokens], w13.device)
    check_contiguous("src_routes", src_routes, torch.int32, [rows], w13.device)
    check_contiguous("w13", w13, a.dtype, [num_experts, n, k], w13.device)
    if w13_scale is not None:
        shape = [num_experts, n]
        check_contiguous("w13_scale", w13_scale, torch.float32, shape, w13.device)
    check_contiguous(
        "expert_first_token_offset",
        offsets,
        torch.int64,
        [num_experts + 1],
        w13.device,
    )
    check_contiguous("out", out, out.dtype, [rows, n // 2], w13.device)
    if out_scale is not None:
        shape = [rows, act_groups(n // 2)]
        check_contiguous("out_scale", out_scale, torch.float32, shape, w13.device)
    return spec


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    config: GroupedGemmConfig | None = None,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """Writes the rows below ``expert_first_token_offset[-1]`` of ``out``
    [R, N] from ``a`` [R, K] and ``w`` [E, N, K]; returns ``out``.

    fp8 ``a`` and ``w`` come with ``a_scale`` [R] and ``w_scale`` [E, N] and
    write bf16 or fp16; a 2-D ``a_scale`` [R, act_groups(K)] scales each
    row's columns in groups of 128 (as :func:`grouped_gemm_gated` writes its
    fp8 output; positive and finite, since the kernel divides by them).
    bf16 or fp16 ``a``, ``w`` and ``out`` share one dtype and take no scales.

    ``config`` runs the Triton kernel with those tiles (fp8, per-row scales
    only); without it :mod:`.dispatch` picks the kernel and tiles. ``kernel``
    is a caller's choice (an expert layer's :func:`~.dispatch.moe_gemm_kernels`),
    checked to run the call and not made again."""
    spec = check_plain(a, w, expert_first_token_offset, out, a_scale, w_scale)
    if a.shape[0] == 0 or w.shape[0] == 0:  # no rows or no experts: nothing to write
        return out
    check_tma_rows("a", a, spec.k_multiple)
    check_tma_rows("w", w, spec.k_multiple)
    needs_hopper = None  # what of the call only the Hopper kernel takes
    if spec.hopper_only:
        needs_hopper = f"{_names((a.dtype,))} operands"
    elif a_scale is not None and a_scale.dim() == 2:
        needs_hopper = "per-group a_scale"
    kernel = plain_kernel(a, w, out, config, needs_hopper, kernel)
    if kernel is Kernel.HOPPER:
        hopper_plain.launch(a, a_scale, w, w_scale, expert_first_token_offset, out)
        return out
    assert a_scale is not None and w_scale is not None  # fp8, checked
    tiles = config or default_config(a.shape[0], w.shape[0])
    triton_kernels.launch(a, a_scale, w, w_scale, expert_first_token_offset, out, tiles)
    return out


def grouped_gemm_gated(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    config: GroupedGemmConfig | None = None,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """``out[r] = act(gate, up)`` where ``[gate | up]`` is the deinterleaved
    ``a[t] @ w13[e]^T`` (fp8: scaled), for each row ``r`` below
    ``expert_first_token_offset[-1]``, of expert ``e``, with
    ``t = src_routes[r] // topk``; returns ``out``.

    ``a`` [T, K]; ``src_routes`` int32 [R] (the permute's destination ->
    route index); ``w13`` [E, 2I, K] with its gate and up rows interleaved
    (:func:`~.layout.interleave_gate_up`); ``out`` [R, I]; ``activation``
    one of ``ACTIVATIONS``. fp8 ``a`` and ``w13`` come with ``a_scale`` [T]
    and ``w13_scale`` [E, 2I] (interleaved too) and write bf16, fp16, or fp8
    quantized per row in groups of 128 columns with ``out_scale``
    [R, act_groups(I)] (``out * out_scale`` restores the values; what
    :func:`grouped_gemm` takes as ``a``, ``a_scale``). bf16 or fp16 ``a``,
    ``w13`` and ``out`` share one dtype and take no scales.

    ``config`` and ``kernel`` as in :func:`grouped_gemm`."""
    spec = check_gated(
        a,
        src_routes,
        topk,
        w13,
        expert_first_token_offset,
        activation,
        out,
        a_scale,
        w13_scale,
        out_scale,
    )
    rows = out.shape[0]
    if rows == 0 or w13.shape[0] == 0:  # no rows or no experts: nothing to write
        return out
    needs_hopper = None  # what of the call only the Hopper kernel takes
    if spec.hopper_only:
        needs_hopper = f"{_names((a.dtype,))} operands"
    elif out_scale is not None:
        needs_hopper = "an fp8 out"
    if needs_hopper is not None:  # the Hopper kernel gathers by 16-byte copies
        check_tma_rows("a", a, GATHERED_K_MULTIPLE)
    check_tma_rows("w13", w13, GATHERED_K_MULTIPLE)
    kernel = gated_kernel(a, w13, out, config, needs_hopper, kernel)
    if kernel is Kernel.HOPPER:
        hopper_gated.launch_gated(
            a,
            a_scale,
            src_routes,
            topk,
            w13,
            w13_scale,
            expert_first_token_offset,
            activation,
            out,
            out_scale,
        )
        return out
    assert a_scale is not None and w13_scale is not None  # fp8, checked
    tiles = config or default_gated_config(rows, w13.shape[0])
    triton_kernels.launch_gated(
        a,
        a_scale,
        src_routes,
        topk,
        w13,
        w13_scale,
        expert_first_token_offset,
        activation,
        out,
        tiles,
    )
    return out


def grouped_gemm_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig | None = None,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm` on fp8 operands."""
    return grouped_gemm(
        a,
        w,
        expert_first_token_offset,
        out,
        a_scale=a_scale,
        w_scale=w_scale,
        config=config,
        kernel=kernel,
    )


def grouped_gemm_fp8_gated(
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
    out_scale: torch.Tensor | None = None,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm_gated` on fp8 operands."""
    return grouped_gemm_gated(
        a,
        src_routes,
        topk,
        w13,
        expert_first_token_offset,
        activation,
        out,
        a_scale=a_scale,
        w13_scale=w13_scale,
        out_scale=out_scale,
        config=config,
        kernel=kernel,
    )
