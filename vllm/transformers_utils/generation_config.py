"""What a checkpoint's ``generation_config.json`` recommends, applied as vLLM
applies it (``--generation-config auto``, its default).

The model's creator picks sampling values there (Qwen3: temperature 0.6,
top_k 20, top_p 0.95); a request that sets none of a knob gets the
recommended value instead of :class:`~vllm.sampling_params.SamplingParams`'
default, and ``LLM.generate`` without sampling params gets all of them.
Its ``eos_token_id`` (one id or a list: Qwen3's chat models end a turn with
``<|im_end|>`` and a text with ``<|endoftext|>``) ends every request that
does not ``ignore_eos``, besides the tokenizer's EOS. ``"vllm"`` ignores
the file; a directory reads the file there. ``max_new_tokens`` is not
applied: a request's ``max_tokens`` stays its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams

# The SamplingParams fields vLLM takes from the file, named as there.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()  # ends a request besides the tokenizer's

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling)

    def with_eos(self, params: SamplingParams) -> SamplingParams:
        """``params`` stopping at the extra EOS ids too, unless they
        ``ignore_eos`` (a copy: the caller's params stay as given)."""
        extra = [t for t in self.eos_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(
            params, stop_token_ids=[*params.stop_token_ids, *extra]
        )


def load_generation_defaults(
    model: str | Path, generation_config: str = "auto"
) -> GenerationDefaults:
    """``generation_config``: ``"auto"`` (the model directory's file, if it
    has one), ``"vllm"`` (none) or a directory holding the file."""
    if generation_config == "vllm":
        return GenerationDefaults()
    auto = generation_config == "auto"
    path = Path(model if auto else generation_config) / "generation_config.json"
    if not path.is_file():
        if auto:
            return GenerationDefaults()
        raise ValueError(
            f"generation_config: expected 'auto', 'vllm' or a directory with "
            f"generation_config.json, got {generation_config!r}"
        )
    config = json.loads(path.read_text())
    sampling = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    eos = config.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(t, int) and t >= 0 for t in eos_ids):
        raise ValueError(f"{path}: eos_token_id: expected token ids, got {eos!r}")
    for name, value in sampling.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name}: expected a number, got {value!r}")
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return GenerationDefaults(sampling, tuple(eos_ids))
