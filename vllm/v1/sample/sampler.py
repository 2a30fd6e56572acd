"""Next tokens of a batch from its logits, one row per request.

Greedy rows take the argmax. Random rows divide by their temperature, keep
the ``top_k`` most likely tokens, the smallest set whose probability reaches
``top_p`` and those of at least ``min_p`` times the top probability, and draw
from what is left with the request's own generator when it has a seed (the
same seed gives the same tokens in any batch). Log-probabilities are those
of the model's distribution (``log_softmax`` of the raw logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of the sampled token
    top_logprobs: dict[int, float]  # the ``logprobs`` most likely, if asked


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling probabilities of one row after temperature and filters."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the tokens before it hold less than top_p.
        before = sorted_probs.cumsum(0) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before >= params.top_p
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampledToken]:
    """One token per row of ``logits`` [R, V]; ``generators[i]`` draws row
    i's randomness (None: the global generator)."""
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(
            f"params/generators: expected {logits.shape[0]} each (one per row), "
            f"got {len(params)}/{len(generators)}"
        )
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = logits.argmax(dim=-1)  # greedy rows; random rows replaced below
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            probs = filtered_probs(logits[i], p)
            # The exponential race: argmax(p / E), E ~ Exp(1), draws from p.
            race = torch.empty_like(probs).exponential_(generator=gen)
            tokens[i] = (probs / race).argmax()
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    out: list[SampledToken] = []
    # One host copy for the batch (a GPU sync per row would stall each step).
    rows = zip(params, tokens.tolist(), chosen.tolist(), strict=True)
    for i, (p, token, logprob) in enumerate(rows):
        top: dict[int, float] = {}
        if p.logprobs:
            values, ids = logprobs[i].topk(p.logprobs)
            top = dict(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(SampledToken(token, logprob, top))
    return out
