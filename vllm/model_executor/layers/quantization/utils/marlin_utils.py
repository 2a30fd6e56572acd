"""Marlin-style W4A16: weight preparation, lock workspaces and the runtime op.

The lock (semaphore) workspace of the split-K reduction is owned by the
workspace manager, never by a layer or a kernel object: one int32 buffer per
(ubatch, lane, CUDA stream), zeroed once. Every successful kernel call leaves
its counters at zero, so no memset is needed between calls.

``torch.ops.vllm.marlin_gemm`` takes ``workspace=None`` and resolves it inside
the op, at execution time: a ``torch.compile``-d graph then calls the op with
None and never bakes in one slot's or one stream's buffer.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.marlin import (
    MAX_TILES_PER_SM,
    check_marlin_args,
    dequantize_weights,
    marlin_gemm,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
)
from vllm.v1.worker.workspace import get_lock_buffer

MARLIN_WORKSPACE_KEY = "marlin_workspace"


def marlin_make_workspace_new(
    device: torch.device | str, max_blocks_per_sm: int = MAX_TILES_PER_SM
) -> torch.Tensor:
    """A zeroed int32 lock buffer for up to ``max_blocks_per_sm`` tiles per SM."""
    device = torch.device(device)
    if max_blocks_per_sm < MAX_TILES_PER_SM:
        raise ValueError(
            f"max_blocks_per_sm: the kernel keeps up to {MAX_TILES_PER_SM} "
            f"output tiles per SM in flight, expected >= that, got "
            f"{max_blocks_per_sm}"
        )
    numel = marlin_workspace_numel(device)
    numel = numel // MAX_TILES_PER_SM * max_blocks_per_sm
    return torch.zeros(numel, dtype=torch.int32, device=device)


def get_marlin_workspace(device: torch.device | str) -> torch.Tensor:
    """The lock buffer for the current (ubatch, lane, stream) on ``device``.

    With a workspace manager it is a stream-scoped persistent tensor, zeroed
    once; without one, a fresh zeroed buffer per call.
    """
    return get_lock_buffer(MARLIN_WORKSPACE_KEY, marlin_workspace_numel(device), device)


# -- weight preparation ------------------------------------------------------


def marlin_quantize_and_repack(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight[N, K]`` -> (packed int32 [N, K // 8], scales [groups, N] in dtype)."""
    q, scales = quantize_weights(weight, group_size)
    return repack_weights(q), scales.to(dtype)


def marlin_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference dequantized weights ``[N, K]`` in the scales' dtype."""
    return dequantize_weights(packed, scales, group_size)


# -- runtime op --------------------------------------------------------------

# The workspace is scratch, not an output: the lock protocol returns every
# counter to zero before the kernel exits, so its value is the same after the
# call and the schema does not mark it mutated. Marked (a!), functionalization
# would clone or copy back an explicit buffer on every call, and inductor
# (torch 2.11-2.13) cannot lower the op when that only mutable argument is None.
# The compiler cannot see the transient writes, so one buffer must never serve
# two concurrent calls: resolved ones are per stream, given ones the caller's.
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define(
    "marlin_gemm(Tensor a, Tensor b_q_weight, Tensor b_scales, "
    "Tensor? workspace, SymInt group_size, SymInt size_n, SymInt size_k) "
    "-> Tensor"
)


def _resolve_workspace(a: torch.Tensor, workspace: torch.Tensor | None) -> torch.Tensor:
    # At execution time: the running slot's and stream's buffer.
    return get_marlin_workspace(a.device) if workspace is None else workspace


def _marlin_gemm_cuda(
    a: torch.Tensor,
    b_q_weight: torch.Tensor,
    b_scales: torch.Tensor,
    workspace: torch.Tensor | None,
    group_size: int,
    size_n: int,
    size_k: int,
) -> torch.Tensor:
    return marlin_gemm(
        a,
        b_q_weight,
        b_scales,
        _resolve_workspace(a, workspace),
        group_size=group_size,
        size_n=size_n,
        size_k=size_k,
    )


def _marlin_gemm_cpu(
    a: torch.Tensor,
    b_q_weight: torch.Tensor,
    b_scales: torch.Tensor,
    workspace: torch.Tensor | None,
    group_size: int,
    size_n: int,
    size_k: int,
) -> torch.Tensor:
    """The plain-PyTorch path, with the same workspace resolution and checks."""
    check_marlin_args(
        a,
        b_q_weight,
        b_scales,
        _resolve_workspace(a, workspace),
        group_size=group_size,
        size_n=size_n,
        size_k=size_k,
    )
    weight = marlin_dequantize(b_q_weight, b_scales, group_size)
    return (a.float() @ weight.float().t()).to(a.dtype)


def _marlin_gemm_fake(
    a: torch.Tensor,
    b_q_weight: torch.Tensor,
    b_scales: torch.Tensor,
    workspace: torch.Tensor | None,
    group_size: int,
    size_n: int,
    size_k: int,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], size_n))


_lib.impl("marlin_gemm", _marlin_gemm_cuda, "CUDA")
_lib.impl("marlin_gemm", _marlin_gemm_cpu, "CPU")
torch.library.register_fake("vllm::marlin_gemm", _marlin_gemm_fake, lib=_lib)


def apply_marlin_linear(
    x: torch.Tensor,
    b_q_weight: torch.Tensor,
    b_scales: torch.Tensor,
    group_size: int,
    size_n: int,
    size_k: int,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x[..., K] @ dequant(W)^T`` through the runtime op."""
    out = torch.ops.vllm.marlin_gemm(
        x.reshape(-1, size_k),
        b_q_weight,
        b_scales,
        workspace,
        group_size,
        size_n,
        size_k,
    )
    return out.reshape(*x.shape[:-1], size_n)
