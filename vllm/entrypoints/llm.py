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
prompt's ``n`` sequences as requests (``SamplingParams.fan_out``), steps
the engine until all finish (continuous batching: requests join and leave
every step) and returns one :class:`RequestOutput` per prompt, in order,
its sequences in ``outputs``. ``chat`` renders conversations with the
checkpoint's chat template (:mod:`vllm.entrypoints.chat_utils`, as the
server does) and generates from them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

from vllm.inputs import PromptType, TextPrompt, TokensPrompt
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


def _prompt_text(prompt: PromptType) -> str | None:
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        return cast(TextPrompt, prompt)["prompt"]
    return prompt if isinstance(prompt, str) else None


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

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None for a checkpoint without one:
        prompts are token ids then), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without sampling params: the checkpoint's
        recommended values over SamplingParams' defaults."""
        return self.generation_defaults.default_sampling_params()

    def _eos(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    def _prompt_ids(self, prompt: PromptType, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(cast(TokensPrompt, prompt)["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError(
                    f"expected a TextPrompt ('prompt') or a TokensPrompt "
                    f"('prompt_token_ids'), got keys {sorted(prompt)}"
                )
            prompt = cast(TextPrompt, prompt)["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs a tokenizer in the checkpoint directory; "
                    "give token ids"
                )
            encoded = self.tokenizer(prompt, add_special_tokens=add_special_tokens)
            return list(encoded["input_ids"])
        return list(prompt)

    def generate(
        self,
        prompts: PromptType | list[PromptType] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Texts, token-id lists or vLLM's ``TextPrompt`` / ``TokensPrompt``
        dicts (:mod:`vllm.inputs`); one params for all or one per prompt.
        Every prompt is checked before any runs (a bad one raises
        ``ValueError`` naming its index)."""
        batch: list[PromptType]
        one = isinstance(prompts, str | dict)
        if one or (prompts and isinstance(cast(list, prompts)[0], int)):
            batch = [cast(PromptType, prompts)]
        else:
            batch = list(cast(list[PromptType], prompts))
        return self._generate(batch, sampling_params, "prompts", True)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (OpenAI-style message dicts) or a list of them,
        rendered with the checkpoint's chat template or ``chat_template``
        (options as the server's chat requests take them), then generated as
        ``generate`` does; one output per conversation, its ``prompt`` the
        rendered text. Errors name the conversation's index."""
        # (pydantic's, which generation alone does not need)
        from vllm.entrypoints.chat_utils import (
            chat_options,
            parse_messages,
            render_chat,
        )

        if self.tokenizer is None:
            raise ValueError(
                "messages: chat needs a tokenizer and its chat template in the "
                "checkpoint directory"
            )
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else cast(list[Any], messages)
        options = chat_options(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        texts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            try:
                parsed = parse_messages(conversation)
                texts.append(
                    render_chat(self.tokenizer, parsed, options, chat_template)
                )
            except ValueError as e:
                raise ValueError(f"conversations[{i}]: {e}") from None
        # the template wrote the special tokens
        return self._generate(texts, sampling_params, "conversations", False)

    def _generate(
        self,
        batch: list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        name: str,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        """Each prompt's requests into the engine, or none of them (errors
        name ``name[index]``), then all of them run."""
        params = (
            self.get_default_sampling_params()
            if sampling_params is None
            else sampling_params
        )
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(
                f"sampling_params: expected one per prompt ({len(batch)}), got "
                f"{len(per_prompt)}"
            )
        prompt_requests: list[tuple[str, list[Request]]] = []  # its id, sequences
        requests: list[Request] = []
        try:
            for i, (prompt, p) in enumerate(zip(batch, per_prompt, strict=True)):
                try:
                    if p.stop_strings and self.tokenizer is None:
                        raise ValueError(
                            "sampling_params.stop: stop strings need a tokenizer in "
                            "the checkpoint directory; use stop_token_ids"
                        )
                    ids = self._prompt_ids(prompt, add_special_tokens)
                    children = self.generation_defaults.apply(p).fan_out()
                    parent = str(next(self._request_ids))
                    sequences = []
                    for j, child in enumerate(children):
                        request = Request(f"{j}_{parent}", ids, child, self._eos())
                        self.engine.add_request(request)
                        requests.append(request)
                        sequences.append(request)
                except ValueError as e:
                    raise ValueError(f"{name}[{i}]: {e}") from None
                prompt_requests.append((parent, sequences))
            detokenizers = self._run(requests)
        finally:  # an error leaves none of this call's requests in the engine
            for request in requests:
                self.engine.finish_request(request.request_id)
        for request in requests:
            if (detok := detokenizers.get(request.request_id)) is not None:
                detok.flush()  # held-back text may still complete a stop string
                if detok.stopped and request.stop_reason is None:
                    request.finish_reason = "stop"
                    request.stop_reason = detok.stop_string
        return [
            self._output(*sequences, _prompt_text(p), detokenizers)
            for sequences, p in zip(prompt_requests, batch, strict=True)
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
                new = request.output_token_ids[len(detok.token_ids) :]
                detok.update(new, request.finish_reason == "stop")
                if detok.stopped:  # also when the last allowed token completed it
                    self.engine.finish_request(request_id, "stop")
                    request.finish_reason = "stop"
                    request.stop_reason = detok.stop_string
                elif request.finish_reason is None:
                    still.append((request_id, detok))
            active = still  # finished requests are decoded no more
        return detokenizers

    def _output(
        self,
        request_id: str,
        sequences: list[Request],
        prompt: str | None,
        detokenizers: dict[str, IncrementalDetokenizer],
    ) -> RequestOutput:
        """A prompt's output: its sequences' completions, in order."""
        completions = []
        for index, request in enumerate(sequences):
            logprobs = cumulative = None
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
                cumulative = sum(request.output_logprobs)
            detok = detokenizers.get(request.request_id)
            completions.append(
                CompletionOutput(
                    None if detok is None else detok.text,
                    request.output_token_ids,
                    request.finish_reason,
                    logprobs,
                    index,
                    cumulative,
                    request.stop_reason,
                )
            )
        first = sequences[0]
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = first.prompt_logprobs
        return RequestOutput(
            request_id,
            prompt,
            first.prompt_token_ids,
            completions,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )
