"""One generation request's state as the engine moves it along."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    num_computed_tokens: int = 0  # tokens whose keys and values are cached
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_preemptions: int = 0

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
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason

    def append_token(
        self, token_id: int, logprob: float, top: dict[int, float]
    ) -> None:
        """Add a sampled token and finish on a stop token or the length limit
        (stop strings are checked on the text, by the engine)."""
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.top_logprobs.append(top)
        params = self.sampling_params
        if token_id in params.stop_token_ids or (
            token_id == self.eos_token_id and not params.ignore_eos
        ):
            self.finish("stop")
        elif len(self.output_token_ids) >= params.max_tokens:
            self.finish("length")
