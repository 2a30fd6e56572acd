"""What a checkpoint's ``generation_config.json`` recommends, applied as vLLM
applies it (``--generation-config auto``, its default).

The model's creator picks sampling values there (Qwen3: temperature 0.6,
top_k 20, top_p 0.95); a request that sets none of a knob gets the
recommended value instead of :class:`~vllm.sampling_params.SamplingParams`'
default, and ``LLM.generate`` without sampling params gets all of them.
Values equal to Hugging Face's own defaults are left out, as vLLM reads the
file's difference from them. ``max_new_tokens`` caps every request's
``max_tokens`` (vLLM: "a server-wide limit"). Its ``eos_token_id`` (one id
or a list: Qwen3's chat models end a turn with ``<|im_end|>`` and a text
with ``<|endoftext|>``) ends every request that does not ``ignore_eos``,
besides the tokenizer's EOS.

``generation_config`` ``"vllm"`` keeps SamplingParams' defaults and no cap
(the EOS ids still apply, as in vLLM); a directory reads the file there.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams

# The SamplingParams fields vLLM takes from the file, with Hugging Face's
# defaults (a value equal to its default is not a recommendation).
SAMPLING_FIELDS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the cap on every request's max_tokens
    eos_token_ids: tuple[int, ...] = ()  # ends a request besides the tokenizer's

    def default_sampling_params(self) -> SamplingParams:
        values = dict(self.sampling)
        if self.max_tokens is not None:
            values["max_tokens"] = self.max_tokens
        return SamplingParams(**values)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` stopping at the extra EOS ids too, unless they
        ``ignore_eos``, and within the cap (a copy: the caller's params
        stay as given)."""
        changes: dict[str, Any] = {}
        extra = [t for t in self.eos_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        if self.max_tokens is not None and params.max_tokens > self.max_tokens:
            changes["max_tokens"] = self.max_tokens
            changes["min_tokens"] = min(params.min_tokens, self.max_tokens)
        return dataclasses.replace(params, **changes) if changes else params


def load_generation_defaults(
    model: str | Path, generation_config: str = "auto"
) -> GenerationDefaults:
    """``generation_config``: ``"auto"`` (the model directory's file, if it
    has one), ``"vllm"`` (its EOS ids only) or a directory holding the
    file."""
    directory = model if generation_config in ("auto", "vllm") else generation_config
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        if generation_config in ("auto", "vllm"):
            return GenerationDefaults()
        raise ValueError(
            f"generation_config: expected 'auto', 'vllm' or a directory with "
            f"generation_config.json, got {generation_config!r}"
        )
    config = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(_whole(t) and t >= 0 for t in eos_ids):
        raise ValueError(f"{path}: eos_token_id: expected token ids, got {eos!r}")
    if generation_config == "vllm":
        return GenerationDefaults(eos_token_ids=tuple(eos_ids))
    sampling = {
        name: config[name]
        for name, default in SAMPLING_FIELDS.items()
        if config.get(name) is not None and config[name] != default
    }
    for name, value in sampling.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name}: expected a number, got {value!r}")
    if "top_k" in sampling:
        top_k = sampling["top_k"]
        if isinstance(top_k, float) and not top_k.is_integer():  # 20.0 is 20
            raise ValueError(f"{path}: top_k: expected a whole number, got {top_k!r}")
        sampling["top_k"] = 0 if top_k == -1 else int(top_k)  # -1: vLLM's "all"
    max_tokens = config.get("max_new_tokens")
    if max_tokens is not None and not (_whole(max_tokens) and max_tokens >= 1):
        raise ValueError(f"{path}: max_new_tokens: expected >= 1, got {max_tokens!r}")
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return GenerationDefaults(sampling, max_tokens, tuple(eos_ids))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
