"""Which CUDA graphs the runner captures, and which one runs a step.

Decode steps (every request computes one token) replay graphs captured by
request count; steps with prefill, graphs captured by token count, the
largest being the token budget. A step runs in the smallest graph that
holds it (:func:`plan_step`); under expert parallelism the ranks plan from
their largest step, so that all replay one size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.forward_context import DPMetadata


def decode_capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured for decode, largest first: 1, 2, 4, then every
    multiple of 8, up to ``max_num_seqs`` (itself included)."""
    sizes = {n for n in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if n <= max_num_seqs}
    return sorted(sizes | {max_num_seqs}, reverse=True)


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts captured for steps with prefill, largest first: 64, 128,
    256, then every multiple of 512, up to ``max_num_batched_tokens``
    (itself included). The padding costs at most 512 tokens of compute above
    512 tokens, where a step's GPU time is a few ms."""
    budget = max_num_batched_tokens
    sizes = {n for n in (64, 128, 256, *range(512, budget + 1, 512)) if n <= budget}
    return sorted(sizes | {budget}, reverse=True)


@dataclass(frozen=True)
class StepPlan:
    """How one step runs: a replay of the decode graph of ``size`` requests
    (``decode``) or of the graph with prefill of ``size`` tokens, or eagerly
    (``size`` None). ``dp_metadata``: every rank's token count of an eager
    step's forward under expert parallelism."""

    decode: bool
    size: int | None
    dp_metadata: DPMetadata | None = None


def plan_step(
    num_tokens: int,
    decode: bool,
    decode_sizes: Iterable[int],
    mixed_sizes: Iterable[int],
) -> StepPlan:
    """The smallest captured graph that holds a step of ``num_tokens``
    (``decode``: one per request): a decode graph for a decode step, else
    one with prefill (a decode step fits one too); eager where none does."""
    if decode:
        size = min((s for s in decode_sizes if s >= num_tokens), default=None)
        if size is not None:
            return StepPlan(True, size)
    size = min((s for s in mixed_sizes if s >= num_tokens), default=None)
    return StepPlan(False, size)
