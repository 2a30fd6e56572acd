"""The uint4 experts' path between decode and large batches (W4A16's
:class:`MarlinExperts` and W4A8's :class:`TritonExpertsW4A8`): sort the
routes, run the kernels of
:mod:`~vllm.model_executor.kernels.marlin.moe_grouped_mma` (each routed
expert's weights streamed once, its routes' rows multiplied together on the
tensor cores), then ``moe_unpermute``.

Its numerics are the decode kernels' (w4a16: the tokens stay 16-bit, for
W4A8 too). It takes batches up to :data:`GROUPED_MAX_TOKENS` on NVIDIA GPUs
with ``mma.sync``, after the route-by-route decode kernels' sizes.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.marlin.mma_rows import rows_aligned, runs_mma
from vllm.model_executor.kernels.marlin.moe_grouped_mma import marlin_moe_grouped
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_prepare_scatter,
    moe_unpermute,
)

# Up to this many tokens the grouped kernels run (benchmarks/RESULTS.md).
GROUPED_MAX_TOKENS = 64


def runs_grouped(hidden_states: torch.Tensor, max_tokens: int) -> bool:
    """Whether a batch of ``hidden_states`` takes the grouped kernels."""
    return (
        hidden_states.shape[0] <= max_tokens
        and runs_mma(hidden_states.device)
        and rows_aligned(hidden_states)
    )


def apply_grouped(
    experts: FusedMoEExperts,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    group_size: int,
    act: torch.Tensor,
    down: torch.Tensor,
) -> None:
    """``output`` of ``experts``' uint4 ``weights`` (w13, its scales, w2, its
    scales) on the running slot's permute scratch; ``act`` [R, I] and
    ``down`` [R, H] from the caller's workspaces."""
    rows = topk_ids.numel()
    scratch = experts.permute_scratch(hidden_states.device)
    offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
    marlin_moe_grouped(
        hidden_states, scratch.permuted_idx[:rows], offsets, topk_ids.shape[1],
        *weights, experts.moe.activation, group_size, act, down,
    )  # fmt: skip
    moe_unpermute(output, down, topk_weights, inv, offsets)
