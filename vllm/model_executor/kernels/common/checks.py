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
