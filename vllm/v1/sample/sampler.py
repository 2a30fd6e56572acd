"""Next tokens of a batch from its logits, one row per request.

Each row's logit bias is added first; penalized rows then get their
presence, frequency and repetition penalties from the tokens of their
prompt and output so far (:class:`TokenHistory`), and the tokens a row may
not sample yet (its stop tokens before ``min_tokens``) or at all (outside
its grammar: :class:`TokenMasks`) are masked. Greedy rows take the
argmax. Random rows divide by their temperature, keep the ``top_k`` most
likely tokens, the smallest set whose probability reaches ``top_p`` and
those of at least ``min_p`` times the top probability, and draw from what
is left with the request's own generator when it has a seed (the same seed
gives the same tokens in any batch). Log-probabilities are those of the
model's distribution (``log_softmax`` of the raw logits, before penalties).
Host values reach the device without a stream sync (``to_device``): the
host samples step N + 1 while the GPU runs step N.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.utils import to_device


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of the sampled token; NaN unless the request asked
    top_logprobs: dict[int, float]  # the ``logprobs`` most likely, if asked


@dataclass
class TokenHistory:
    """The tokens that penalties count, per row of a batch: each request's
    prompt (an int64 array the request keeps: it never changes) and output
    on the host, and under async scheduling the token that the step in
    flight sampled for it, still on the device (``pending`` [R], -1 for
    none). Token ids must be in the vocabulary."""

    prompt_token_ids: list[np.ndarray]
    output_token_ids: list[list[int]]
    pending: torch.Tensor | None = None


@dataclass
class TokenMasks:
    """The tokens some rows may sample: ``bitmask`` [len(rows), ceil(V / 32)]
    int32 on the logits' device, token t allowed where bit t % 32 of word
    t // 32 is set (xgrammar's layout)."""

    rows: list[int]
    bitmask: torch.Tensor


def adjusted_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: TokenHistory | None,
    banned: dict[int, list[int]] | None = None,
    masks: TokenMasks | None = None,
) -> torch.Tensor:
    """fp32 ``logits`` [R, V] with each row's logit bias then penalties
    applied (vLLM's order), the tokens its mask leaves out and its
    ``banned`` ones at -inf (unless that leaves none: then the banned ones
    stay), for the batch at once (a copy: the raw logits give logprobs);
    ``history`` is needed where a row has penalties."""
    vocab, device = logits.shape[1], logits.device
    out = logits.to(torch.float32, copy=True)
    biased = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
    if biased:
        if max(max(bias) for _, bias in biased) >= vocab:  # else another row's
            raise ValueError(f"logit_bias: expected token ids < {vocab}")
        cells = [row * vocab + token for row, bias in biased for token in bias]
        values = [value for _, bias in biased for value in bias.values()]
        out.view(-1).index_add_(
            0,
            to_device(cells, torch.long, device),
            to_device(values, torch.float32, device),
        )
    if any(p.penalized for p in params):
        if history is None:
            raise ValueError("history: expected the rows' tokens for their penalties")
        _apply_penalties(out, params, history)
    if masks is not None:
        rows = to_device(masks.rows, torch.long, device)
        # token t is bit t % 8 of byte t // 8 of the (little-endian) words
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        bits = (masks.bitmask.view(torch.uint8)[:, :, None] >> shifts) & 1
        masked = out.index_select(0, rows)
        masked.masked_fill_(bits.view(len(masks.rows), -1)[:, :vocab] == 0, -torch.inf)
        out.index_copy_(0, rows, masked)
    if banned:
        cells = [row * vocab + token for row, ids in banned.items() for token in ids]
        if any(not 0 <= token < vocab for ids in banned.values() for token in ids):
            raise ValueError(f"banned: expected token ids in [0, {vocab})")
        index = to_device(cells, torch.long, device)
        kept = out.view(-1)[index]
        out.view(-1).index_fill_(0, index, -torch.inf)
        if masks is not None:
            # a row that its mask and bans leave without a token gets the
            # banned ones back: the grammar wins (its stop token, say, over
            # min_tokens)
            rows = to_device(list(banned), torch.long, device)
            dead = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
            dead[rows] = torch.isneginf(out.index_select(0, rows)).all(-1)
            restored = torch.where(dead[index // vocab], kept, -torch.inf)
            out.view(-1).index_copy_(0, index, restored)
    return out


def _apply_penalties(
    out: torch.Tensor, params: list[SamplingParams], history: TokenHistory
) -> None:
    """Each penalized row's penalties applied to ``out`` [R, V] fp32."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    vocab, device = out.shape[1], out.device
    row_index = to_device(rows, torch.long, device)
    cells = len(rows) * vocab  # of the penalized rows' [rows, V], row-major

    def cell_index(tokens: np.ndarray, lengths: list[int]) -> torch.Tensor:
        """``row * vocab + token`` of the rows' concatenated ``tokens``."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"history: expected token ids in [0, {vocab})")
        index = tokens + np.repeat(np.arange(len(rows)) * vocab, lengths)
        return to_device(index, torch.long, device)

    def per_row(name: str) -> torch.Tensor:
        values = [getattr(params[i], name) for i in rows]
        return to_device(values, torch.float32, device)[:, None]

    # the outputs flat through numpy: a nested list per step cost ~6x the time
    outputs = [history.output_token_ids[i] for i in rows]
    lengths = [len(o) for o in outputs]
    flat = np.fromiter(chain.from_iterable(outputs), np.int64, sum(lengths))
    output = cell_index(flat, lengths)
    if history.pending is not None:
        # a row without a pending token counts one past the last cell
        pending = history.pending[row_index]
        offsets = torch.arange(0, cells, vocab, device=device)
        output = torch.cat([output, torch.where(pending < 0, cells, offsets + pending)])
    # scatter_add, not bincount: bincount reads its input's range on the host
    counts = torch.zeros(cells + 1, device=device)
    counts.scatter_add_(0, output, torch.ones(output.shape, device=device))
    counts = counts[:cells].view(-1, vocab)
    prompts = [history.prompt_token_ids[i] for i in rows]
    seen = torch.zeros(cells, dtype=torch.bool, device=device)
    # index_fill_: ``seen[index] = True`` copies the True to the device, blocking
    seen.index_fill_(
        0, cell_index(np.concatenate(prompts), list(map(len, prompts))), True
    )
    seen = seen.view(-1, vocab) | (counts > 0)
    penalized = out[row_index]
    repetition = per_row("repetition_penalty")
    scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
    penalized = torch.where(seen, scaled, penalized)
    penalized -= per_row("frequency_penalty") * counts
    penalized -= per_row("presence_penalty") * (counts > 0)
    out[row_index] = penalized


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sampling probabilities of the rows of ``logits`` [R, V] after each
    row's temperature and filters, for the whole batch at once (a loop over
    rows would launch ~10 kernels per row per step)."""
    vocab = logits.shape[1]
    device = logits.device

    def per_row(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)[:, None]

    logits = logits.float() / per_row([p.temperature for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        ks = to_device(top_k, torch.long, device)[:, None]
        kth = logits.topk(max(top_k), dim=-1).values.gather(1, ks - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the tokens before it hold less than top_p (rows
        # without top_p keep all: a rounded sum must not reach 1 and drop).
        before = sorted_probs.cumsum(-1) - sorted_probs
        top_p = per_row([p.top_p if p.top_p < 1 else float("inf") for p in params])
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop.scatter_(1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0 for p in params):
        floor = per_row([p.min_p for p in params]) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a pinned copy queued on the current stream (wait
    on an event recorded after it), or ``t`` itself off CUDA."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class SampledBatch:
    """A batch's sampled tokens (``device_tokens`` [R], on the logits'
    device) on their way to the host: the copies start when it is made, on
    the current stream; :meth:`tolist` waits for them alone, not for work
    queued after them (the next step)."""

    def __init__(
        self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> None:
        self.device_tokens = tokens
        # Log-probabilities only for the rows that asked (a full-vocabulary
        # log_softmax per row and more host copies otherwise).
        self._asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        self._num_top = [params[i].logprobs or 0 for i in self._asked]
        copies = [tokens]
        if self._asked:
            asked = to_device(self._asked, torch.long, tokens.device)
            logprobs = torch.log_softmax(logits[asked].float(), dim=-1)
            chosen = logprobs.gather(1, tokens[asked, None]).squeeze(1)
            values, ids = logprobs.topk(max(self._num_top), dim=-1)
            copies += [chosen, values, ids]
        self._event = torch.cuda.Event() if tokens.is_cuda else None
        self._host = [host_copy(t) for t in copies]
        if self._event is not None:
            self._event.record()

    def tolist(self) -> list[SampledToken]:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[0].tolist()
        chosen = [float("nan")] * len(tokens)
        top: dict[int, dict[int, float]] = {}
        if len(self._host) > 1:
            picked, values, ids = (t.tolist() for t in self._host[1:])
            for row, i in enumerate(self._asked):
                chosen[i], k = picked[row], self._num_top[row]
                if k:
                    top[i] = dict(zip(ids[row][:k], values[row][:k], strict=True))
        return [
            SampledToken(token, chosen[i], top.get(i, {}))
            for i, token in enumerate(tokens)
        ]


def sample_async(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    generator: torch.Generator | None = None,
    history: TokenHistory | None = None,
    banned: dict[int, list[int]] | None = None,
    masks: TokenMasks | None = None,
) -> SampledBatch:
    """One token per row of ``logits`` [R, V], left on the device with its
    host copy under way; ``generators[i]`` draws row i's randomness (None:
    ``generator``'s, the engine's; None: the global generator's);
    ``history``: the rows' tokens, needed when a row has penalties;
    ``banned``: tokens rows may not sample (by row); ``masks``: the only
    tokens some rows may sample."""
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(
            f"params/generators: expected {logits.shape[0]} each (one per row), "
            f"got {len(params)}/{len(generators)}"
        )
    scores = logits
    if banned or masks or any(p.penalized or p.logit_bias for p in params):
        scores = adjusted_logits(logits, params, history, banned, masks)
    tokens = scores.argmax(dim=-1)  # greedy rows; random rows replaced below
    random = [i for i, p in enumerate(params) if not p.greedy]
    if random:
        rows = to_device(random, torch.long, logits.device)
        probs = filtered_probs(scores[rows], [params[i] for i in random])
        # The exponential race: argmax(p / E), E ~ Exp(1), draws from p. A
        # seeded row draws from its own generator (the same tokens in any
        # batch); the others in one draw.
        race = torch.empty_like(probs).exponential_(generator=generator)
        for row, i in enumerate(random):
            if generators[i] is not None:
                race[row].exponential_(generator=generators[i])
        tokens[rows] = (probs / race).argmax(dim=-1)
    return SampledBatch(logits, tokens, params)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: TokenHistory | None = None,
) -> list[SampledToken]:
    """:func:`sample_async`, waited for: one host copy of the tokens for the
    batch (a GPU sync per row would stall each step)."""
    return sample_async(logits, params, generators, history=history).tolist()
