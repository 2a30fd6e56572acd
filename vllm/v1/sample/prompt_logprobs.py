"""Prompt log-probabilities: each prompt token's log-probability given the
tokens before it, and the most likely alternatives (``prompt_logprobs``).

A step that computes a requesting chunk keeps that chunk's hidden states;
here they become logits a slice of rows at a time (a row of a 152k-token
vocabulary is 0.6 MB in fp32: a whole 8k-token chunk at once would hold
5 GB; the profile run does not count a slice, so it comes out of the
headroom ``gpu_memory_utilization`` leaves), and only the chosen and
top-k log-probabilities leave the device, copied to the host behind the
step's work as the sampled tokens are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.utils import to_device
from vllm.v1.core.scheduler import ScheduledChunk
from vllm.v1.request import Request
from vllm.v1.sample.sampler import host_copy

_ROWS_PER_SLICE = 256  # 152k-token vocabulary: ~230 MB of bf16 + fp32 logits
# Top log-probabilities per prompt token at most (vLLM's max_logprobs): the
# host builds a dict per prompt token of this many
MAX_PROMPT_LOGPROBS = 20


@dataclass
class PromptRows:
    """One chunk's share: its rows of the step's hidden states give the
    log-probabilities of prompt tokens ``first_token`` onwards."""

    request: Request
    first_token: int
    targets: list[int]  # the prompt tokens those rows predict
    num_top: int


def prompt_rows_of(
    chunks: list[ScheduledChunk],
) -> tuple[list[int], list[PromptRows]]:
    """The step's rows whose logits give prompt log-probabilities (row of
    position ``p`` predicts prompt token ``p + 1``), and their chunks'."""
    rows: list[int] = []
    prompt_rows = []
    offset = 0
    for chunk in chunks:
        request = chunk.request
        num_top = request.sampling_params.prompt_logprobs
        if num_top is not None:  # (few requests: the check comes first)
            # past the positions whose tokens it has (a recomputed prompt)
            first = max(chunk.start, len(request.prompt_logprobs) - 1)
            last = min(chunk.end, len(request.prompt_token_ids) - 1)
            if first < last:
                skip = offset + first - chunk.start
                rows += range(skip, skip + last - first)
                targets = request.prompt_token_ids[first + 1 : last + 1]
                prompt_rows.append(PromptRows(request, first + 1, targets, num_top))
        offset += chunk.end - chunk.start
    return rows, prompt_rows


class PromptLogprobsBatch:
    def __init__(
        self,
        hidden: torch.Tensor,  # [sum of the chunks' rows, H]
        chunks: list[PromptRows],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.chunks = chunks
        targets = to_device(
            [t for c in chunks for t in c.targets], torch.long, hidden.device
        )
        num_top = max(c.num_top for c in chunks)
        chosen, top_values, top_ids = [], [], []
        for start in range(0, hidden.shape[0], _ROWS_PER_SLICE):
            rows = slice(start, start + _ROWS_PER_SLICE)
            logprobs = torch.log_softmax(
                compute_logits(hidden[rows]), -1, dtype=torch.float32
            )
            chosen.append(logprobs.gather(1, targets[rows, None]).squeeze(1))
            values, ids = logprobs.topk(num_top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        self._event = torch.cuda.Event() if hidden.is_cuda else None
        self._host = [
            host_copy(torch.cat(parts)) for parts in (chosen, top_values, top_ids)
        ]
        if self._event is not None:
            self._event.record()

    def tolist(self) -> list[tuple[PromptRows, list[dict[int, float]]]]:
        """Per chunk, per row: ``{target: logprob, **top}`` (the target
        first, as the sampled tokens' logprobs are)."""
        if self._event is not None:
            self._event.synchronize()
        chosen, values, ids = (t.tolist() for t in self._host)
        result, row = [], 0
        for chunk in self.chunks:
            entries = []
            k = chunk.num_top
            for target in chunk.targets:
                top = dict(zip(ids[row][:k], values[row][:k], strict=True))
                entries.append({target: chosen[row], **top})
                row += 1
            result.append((chunk, entries))
        return result
