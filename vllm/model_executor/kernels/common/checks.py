"""Argument checks shared by the kernel launchers (before any launch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_contiguous(
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype,
    shape: Sequence[int],
    device: torch.device,
) -> None:
    """Raise naming ``name`` unless ``t`` is a contiguous ``dtype`` tensor of
    ``shape`` on ``device``."""
    if (
        t.dtype != dtype
        or t.shape != tuple(shape)
        or not t.is_contiguous()
        or t.device != device
    ):
        layout = "" if t.is_contiguous() else "non-contiguous "
        raise ValueError(
            f"{name}: expected contiguous {dtype} {list(shape)} on {device}, got "
            f"{layout}{t.dtype} {list(t.shape)} on {t.device}"
        )


def check_norm_operands(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor
) -> None:
    """Raise naming ``residual`` or ``norm_weight`` unless they fit an
    RMSNorm of ``x + residual`` over ``x``'s last dim: ``residual`` of
    ``x``'s shape and dtype with unit stride there, the weight of its width
    with unit stride, all on ``x``'s device."""
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype != x.dtype
        or residual.stride(-1) != 1
        or residual.device != x.device
    ):
        raise arg_error(
            "residual", f"{x.dtype} {list(x.shape)} on {x.device} with unit stride "
            f"along the last dim, got {residual.dtype} {list(residual.shape)} on "
            f"{residual.device} (strides {residual.stride()})",
        )  # fmt: skip
    width = x.shape[-1:]
    if (
        norm_weight.shape != width
        or norm_weight.dtype != x.dtype
        or norm_weight.device != x.device
        or norm_weight.stride(-1) != 1
    ):
        raise arg_error(
            "norm_weight", f"contiguous {x.dtype} {list(width)} on {x.device}, got "
            f"{norm_weight.dtype} {list(norm_weight.shape)} on {norm_weight.device} "
            f"(strides {norm_weight.stride()})",
        )  # fmt: skip


def check_tma_rows(name: str, t: torch.Tensor, multiple: int = 1) -> None:
    """Raise naming ``name`` unless ``t`` [..., K] starts 16-byte aligned
    with rows of a positive multiple of 16 bytes (TMA boxes) and K a
    multiple of ``multiple`` (16 for rows gathered by 16-byte copies: the
    compiler proves them aligned only from K a multiple of 16)."""
    k, step = t.shape[-1], max(16 // t.element_size(), multiple)
    if k == 0 or k % step or t.data_ptr() % 16:
        raise ValueError(
            f"{name}: expected a 16-byte aligned start and K a positive multiple "
            f"of {step} for {t.dtype}, got K={k} at {t.data_ptr():#x}"
        )


def arg_error(name: str, expected: str) -> ValueError:
    """The error for argument ``name`` not being ``expected``; callers build
    it only on failure, since launchers check on every call."""
    return ValueError(f"{name}: expected {expected}")


def check_index(
    name: str, t: torch.Tensor, min_numel: int, device: torch.device
) -> None:
    """Raise naming ``name`` unless ``t`` is a contiguous int32 tensor of at
    least ``min_numel`` elements on ``device`` (an index buffer a kernel
    writes or reads a prefix of)."""
    if not (t.dtype == torch.int32 and t.is_contiguous() and t.numel() >= min_numel):
        raise arg_error(
            name,
            f"a contiguous int32 tensor with at least {min_numel} elements, got "
            f"{t.dtype} {tuple(t.shape)}",
        )
    if t.device != device:
        raise arg_error(name, f"a tensor on {device}, got {t.device}")


def check_rows(
    name: str,
    t: torch.Tensor,
    min_rows: int,
    cols: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    """Raise naming ``name`` unless ``t`` is a row buffer: [>= min_rows, cols]
    of one of ``dtypes`` on ``device``, with unit last stride."""
    if not (
        t.dim() == 2
        and t.dtype in dtypes
        and t.shape[0] >= min_rows
        and t.shape[1] == cols
        and t.stride(1) == 1
        and t.device == device
    ):
        raise arg_error(
            name,
            f"a [>= {min_rows}, {cols}] tensor of {dtypes} on {device} with unit "
            f"last stride, got {t.dtype} {tuple(t.shape)} on {t.device}",
        )
