"""What ``LLM.generate`` returns per prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    text: str | None  # None without a tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None  # per token: sampled + top ones


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
