"""Operand layouts the grouped GEMMs take beyond plain row-major tensors.

- w13 (and its per-channel scales) with the gate and up rows interleaved:
  gate 0, up 0, gate 1, ... so that one 2 x BLOCK_N product tile of the
  gated GEMM holds matching gate and up columns. Expert layers re-lay their
  weights out once, at construction.
- Activations scaled per row and group of ``GROUP`` (128) columns: the
  gated Hopper kernel's fp8 output, which the plain one takes as ``a``.
"""

from __future__ import annotations

import torch
import triton

from vllm.model_executor.kernels.grouped_gemm.hopper_common import GROUP


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[..., 2I, ...] gate rows then up rows -> rows gate 0, up 0, gate 1, ...
    (dimension 1: w13 [E, 2I, K] or its scales [E, 2I])."""
    e, n = w13.shape[:2]
    return w13.view(e, 2, n // 2, *w13.shape[2:]).transpose(1, 2).reshape(w13.shape)


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_gate_up`, along dimension 1."""
    e, n = w13.shape[:2]
    return w13.view(e, n // 2, 2, *w13.shape[2:]).transpose(1, 2).reshape(w13.shape)


def act_groups(cols: int) -> int:
    """Scales per row of a group-quantized activation of ``cols`` columns."""
    return triton.cdiv(cols, GROUP.value)
