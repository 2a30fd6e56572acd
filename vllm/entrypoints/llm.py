"""``LLM``: offline generation over the engine.

``LLM(model_dir, ...)`` builds an :class:`~vllm.v1.engine.core.EngineCore`
(workspace manager, model, profile run, KV cache, lock) and a tokenizer
from the checkpoint directory when it has one; with more than one rank
(``data_parallel_size`` or ``tensor_parallel_size`` > 1, with
``enable_expert_parallel``) a
:class:`~vllm.v1.engine.dp_engine.DPEngineCore` whose ranks 1..N-1 run in
worker processes (``llm.engine.shutdown()`` stops them; so does dropping the
``LLM``). ``generation_config`` (vLLM's: ``"auto"``, ``"vllm"`` or a
directory) picks the sampling defaults and extra EOS ids of the
checkpoint's ``generation_config.json``. ``generate`` adds every
prompt as a request, steps the engine until all finish (continuous
batching: requests join and leave every step) and returns one
:class:`RequestOutput` per prompt, in order.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.generation_config import load_generation_defaults
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.dp_engine import DPEngineCore
from vllm.v1.request import Request

_engine_ids = itertools.count()


class LLM:
    def __init__(
        self, model: str | Path, generation_config: str = "auto", **engine_args: Any
    ) -> None:
        # read first: a bad file fails before minutes of loading
        self.generation_defaults = load_generation_defaults(model, generation_config)
        prefix = f"llm{next(_engine_ids)}."  # layer names unique per engine
        config = EngineConfig(model, prefix=prefix, **engine_args)
        self.engine = (
            DPEngineCore(config) if config.world_size > 1 else EngineCore(config)
        )
        self.tokenizer = get_tokenizer(model)
        self._request_ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without sampling params: the checkpoint's
        recommended values over SamplingParams' defaults."""
        return self.generation_defaults.default_sampling_params()

    def _eos(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    def _prompt_ids(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompts[{index}]: a text prompt needs a tokenizer in the "
                    f"checkpoint directory; give token ids"
                )
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Texts or token-id lists; one params for all or one per prompt.
        Every prompt is checked before any runs (a bad one raises
        ``ValueError`` naming its index)."""
        batch: list[str | list[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(str | list[int], prompts)]  # one prompt
        else:
            batch = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(
                f"sampling_params: expected one per prompt ({len(batch)}), got "
                f"{len(per_prompt)}"
            )
        requests: list[Request] = []
        try:
            for i, (prompt, p) in enumerate(zip(batch, per_prompt, strict=True)):
                try:
                    if p.stop_strings and self.tokenizer is None:
                        raise ValueError(
                            "sampling_params.stop: stop strings need a tokenizer in "
                            "the checkpoint directory; use stop_token_ids"
                        )
                    ids = self._prompt_ids(prompt, i)
                    p = self.generation_defaults.apply(p)
                    request = Request(str(next(self._request_ids)), ids, p, self._eos())
                    self.engine.add_request(request)
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                requests.append(request)
            detokenizers = self._run(requests)
        finally:  # an error leaves none of this call's requests in the engine
            for request in requests:
                self.engine.finish_request(request.request_id)
        for detok in detokenizers.values():
            detok.flush()
        return [
            self._output(r, p if isinstance(p, str) else None, detokenizers)
            for r, p in zip(requests, batch, strict=True)
        ]

    def _run(self, requests: list[Request]) -> dict[str, IncrementalDetokenizer]:
        """Step the engine until it is idle, checking stop strings on the
        text of each new token; returns the requests' detokenizers."""
        detokenizers = {
            r.request_id: IncrementalDetokenizer.for_params(
                self.tokenizer, r.sampling_params
            )
            for r in requests
            if self.tokenizer is not None
        }
        active = list(detokenizers.items())
        while self.engine.has_unfinished_requests():
            self.engine.step()
            by_id = {r.request_id: r for r in requests}
            still = []
            for request_id, detok in active:
                request = by_id[request_id]
                detok.update(request.output_token_ids[len(detok.token_ids) :])
                if detok.stopped:  # also when the last allowed token completed it
                    self.engine.finish_request(request_id, "stop")
                    request.finish_reason = "stop"
                elif request.finish_reason is None:
                    still.append((request_id, detok))
            active = still  # finished requests are decoded no more
        return detokenizers

    def _output(
        self,
        request: Request,
        prompt: str | None,
        detokenizers: dict[str, IncrementalDetokenizer],
    ) -> RequestOutput:
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = [
                {tok: lp, **top}
                for tok, lp, top in zip(
                    request.output_token_ids,
                    request.output_logprobs,
                    request.top_logprobs,
                    strict=True,
                )
            ]
        completion = CompletionOutput(
            detok.text if (detok := detokenizers.get(request.request_id)) else None,
            request.output_token_ids,
            request.finish_reason,
            logprobs,
        )
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request.request_id,
            prompt,
            request.prompt_token_ids,
            [completion],
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
        )
