"""How one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's int64 range
GREEDY_BELOW = 1e-5  # temperatures below it sample greedily (vLLM's bound)


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's): a JSON schema (``json``:
    a dict or its text), any JSON object (``json_object``), a regular
    expression, one of the ``choice`` strings, or an EBNF ``grammar``
    (xgrammar's dialect). Exactly one of them. JSON may hold whitespace
    anywhere JSON allows it unless ``disable_any_whitespace`` (vLLM's
    option for models that pad without end)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        types: dict[str, tuple[type | tuple[type, ...], str]] = {
            "json": ((str, dict), "a JSON schema (an object or its text)"),
            "regex": (str, "a string"),
            "choice": (list, "a list of strings"),
            "grammar": (str, "a string"),
            "json_object": (bool, "a bool"),
            "disable_any_whitespace": (bool, "a bool"),
        }
        for name, (kind, expected) in types.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(
                    f"structured_outputs.{name}: expected {expected}, got {value!r:.80}"
                )
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: expected exactly one of json, regex, choice, "
                f"grammar, json_object; got {given or 'none'}"
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice: expected non-empty strings, got "
                f"{self.choice!r:.80}"
            )


@dataclass
class SamplingParams:
    """``n`` sequences are generated from the prompt (the engine runs each
    as a request of its own: :meth:`fan_out`). ``temperature`` 0 is greedy,
    and so is any below ``GREEDY_BELOW`` (vLLM's bound: dividing logits by
    it would overflow fp32, and sampling there is greedy in effect).
    ``top_k`` 0 and ``top_p`` 1 keep every
    token; ``min_p`` drops tokens below that fraction of the most likely
    one's probability. ``seed`` makes a request's samples reproducible
    whatever else is in the batch. ``logprobs`` asks for that many most
    likely tokens' log-probabilities (of the model's distribution, before
    bias, penalties, temperature and filters) besides the sampled one's.
    Before everything else, greedy rows included (vLLM's order):
    ``logit_bias`` (OpenAI's) adds its value, in [-100, 100], to its token's
    logit; then ``repetition_penalty`` divides the positive logits (and
    multiplies the negative ones) of every token in the prompt or the
    output, and ``presence_penalty`` is subtracted from every token that
    the output holds, ``frequency_penalty`` times the number of times it
    does. A request stops after ``max_tokens``, at a token of
    ``stop_token_ids`` (or the model's EOS unless ``ignore_eos``; kept in
    the token ids, out of the text unless ``include_stop_str_in_output``),
    or when its text ends in a string of ``stop`` (cut off, unless
    ``include_stop_str_in_output``); not before ``min_tokens``
    (vLLM's): until then its stop tokens and EOS cannot be sampled, and a
    stop string counts only if it ends past the text of its first
    ``min_tokens`` tokens. The text leaves special tokens out unless
    ``skip_special_tokens`` is False. ``prompt_logprobs`` asks for each
    prompt token's log-probability given the tokens before it, with that
    many most likely alternatives (vLLM's; such a request computes its
    whole prompt: no prefix-cache hits). ``structured_outputs`` holds the
    output to a grammar (:mod:`vllm.v1.structured_output`)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        checks = (
            ("n", self.n >= 1, ">= 1", self.n),
            (
                "temperature",
                0 <= self.temperature < math.inf,
                "a finite value >= 0",
                self.temperature,
            ),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]", self.top_p),
            ("top_k", self.top_k >= 0, ">= 0 (0: all tokens)", self.top_k),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]", self.min_p),
            ("max_tokens", self.max_tokens >= 1, ">= 1", self.max_tokens),
            (
                "min_tokens",
                0 <= self.min_tokens <= self.max_tokens,
                f"in [0, max_tokens={self.max_tokens}]",
                self.min_tokens,
            ),
            (
                "logprobs",
                self.logprobs is None or self.logprobs >= 0,
                "None or >= 0",
                self.logprobs,
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "None or >= 0",
                self.prompt_logprobs,
            ),
            ("stop", all(self.stop_strings), "non-empty strings", self.stop),
            *(
                (name, -2 <= value <= 2, "in [-2, 2]", value)
                for name, value in (
                    ("presence_penalty", self.presence_penalty),
                    ("frequency_penalty", self.frequency_penalty),
                )
            ),
            (
                "logit_bias",
                all(
                    isinstance(t, int) and t >= 0 and -100 <= b <= 100
                    for t, b in self.logit_bias.items()
                ),
                "token ids >= 0 to biases in [-100, 100]",
                self.logit_bias,
            ),
            (
                "repetition_penalty",
                0 < self.repetition_penalty < float("inf"),
                "finite and > 0 (1: none)",
                self.repetition_penalty,
            ),
            (
                "seed",
                self.seed is None or 0 <= self.seed <= MAX_SEED - (self.n - 1),
                f"None or in [0, {MAX_SEED} - (n - 1)] (sequence i takes seed + i)",
                self.seed,
            ),
        )
        for name, ok, expected, got in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {got!r}")

    def fan_out(self) -> list[SamplingParams]:
        """One params per sequence, each with ``n`` 1; with a ``seed``,
        sequence ``i`` takes ``seed + i`` (vLLM's), so that the sequences
        differ and each is reproducible."""
        if self.n == 1:
            return [self]
        seed = self.seed
        return [
            replace(self, n=1, seed=None if seed is None else seed + i)
            for i in range(self.n)
        ]

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (one string is one stop string)."""
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
