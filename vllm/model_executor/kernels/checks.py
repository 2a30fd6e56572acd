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
