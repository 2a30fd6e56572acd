"""What ``LLM.generate`` returns per prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    text: str | None  # None without a tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None  # per token: sampled + top ones
    index: int = 0  # which of the prompt's ``n`` sequences (LLM.generate's)
    # The sampled tokens' log-probs summed (under ``logprobs``, else None)
    cumulative_logprob: float | None = None
    # What stopped it with "stop": the stop string, or the token of
    # ``stop_token_ids``; None at EOS (vLLM's)
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # Under prompt_logprobs, per prompt token (None for the first); a
    # stream's first output carries them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prompt tokens found in the prefix cache (a stream's first output)
    num_cached_tokens: int | None = None
