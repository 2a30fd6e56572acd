"""One generation request's state as the engine moves it along."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from vllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (recomputed from scratch)
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a request is itself (identity), never equal to a look-alike; the
# scheduler's membership tests stay pointer compares.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    generator: torch.Generator | None = None  # the seeded request's own
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys and values are (being) cached
    # Tokens sampled by scheduled steps and not yet appended: the step in
    # flight's (with async scheduling, also the one before, still on the
    # device when the next step is scheduled).
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # Under "stop": the stop string (set by the detokenizer's owner) or the
    # token of stop_token_ids; None at EOS (vLLM's)
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # xgrammar's matcher of its structured outputs (the engine's), which
    # has accepted every appended output token; while it compiles, the
    # compile's future (no step samples for the request until then)
    grammar: Any = None
    compiling: Future[Any] | None = None
    # Prompt tokens found in the prefix cache when it was first scheduled
    # (None before that).
    num_cached_tokens: int | None = None
    # Hashes of its full blocks, in order, as far as the pool has needed them.
    block_hashes: list[bytes] = field(default_factory=list)
    # Per prompt token, under ``prompt_logprobs``: its log-probability and
    # the top ones (None for the first token, which nothing predicts).
    prompt_logprobs: list[dict[int, float] | None] = field(
        default_factory=lambda: [None]
    )

    @cached_property
    def prompt_array(self) -> np.ndarray:
        """The prompt as int64 (what penalties count, every step)."""
        return np.asarray(self.prompt_token_ids, dtype=np.int64)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a
        decode step asks every running request for its last token)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    @property
    def num_known_tokens(self) -> int:
        """Tokens on the host: the prompt and the appended outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """The sequence's length, the pending tokens included."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def max_tokens_scheduled(self) -> bool:
        """Whether its outputs and pending tokens make ``max_tokens``: it
        finishes with those, and needs no further step."""
        scheduled = len(self.output_token_ids) + self.num_pending_tokens
        return scheduled >= self.sampling_params.max_tokens

    def min_tokens_bans(self) -> list[int]:
        """The stop tokens and EOS (even with ``ignore_eos``, as vLLM) if the
        token a step now samples would leave it short of ``min_tokens`` (it
        is its output's token ``len(outputs) + pending - 1``: the step in
        flight's is pending), else none."""
        params = self.sampling_params
        index = len(self.output_token_ids) + self.num_pending_tokens - 1
        if index >= params.min_tokens:  # (most requests: min_tokens 0)
            return []
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        return [*params.stop_token_ids, *eos]

    @property
    def missing_prompt_logprobs(self) -> bool:
        """Whether it asks for prompt log-probabilities and lacks some."""
        return self.sampling_params.prompt_logprobs is not None and len(
            self.prompt_logprobs
        ) < len(self.prompt_token_ids)

    def add_prompt_logprobs(
        self, first_token: int, entries: list[dict[int, float]]
    ) -> None:
        """Those of prompt tokens ``first_token`` onwards, past the ones it
        has (a recomputed prompt, after a preemption, gives them again)."""
        have = len(self.prompt_logprobs)
        assert first_token <= have, "prompt rows are computed in order"
        self.prompt_logprobs += entries[have - first_token :]

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason

    def resolve_token(
        self, token_id: int, logprob: float, top: dict[int, float]
    ) -> None:
        """The oldest pending token, now on the host: appended, unless the
        request finished meanwhile (an abort, a stop: the step that sampled
        it computed past the end, and its token is dropped)."""
        self.num_pending_tokens -= 1
        if self.status is not RequestStatus.FINISHED:
            self.append_token(token_id, logprob, top)

    def append_token(
        self, token_id: int, logprob: float, top: dict[int, float]
    ) -> None:
        """Add a sampled token and finish on a stop token or the length limit
        (stop strings are checked on the text, by the engine)."""
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.top_logprobs.append(top)
        params = self.sampling_params
        if token_id == self.eos_token_id and not params.ignore_eos:
            self.finish("stop")
        elif token_id in params.stop_token_ids:
            self.finish("stop")
            self.stop_reason = token_id
        elif len(self.output_token_ids) >= params.max_tokens:
            self.finish("length")
