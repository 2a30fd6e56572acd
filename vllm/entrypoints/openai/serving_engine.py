"""What the OpenAI endpoints share, over :class:`~vllm.v1.engine.async_llm.AsyncLLM`.

- Prompts: text is tokenized as the model's tokenizer does; chat messages
  are rendered with the chat template and tokenized without adding special
  tokens again (the template has them). A checkpoint without tokenizer
  files (a config for dummy weights) is served on token ids alone, as
  vLLM's ``--skip-tokenizer-init``: text prompts, chat and stop strings are
  refused by name, outputs carry token ids and empty text, and log-prob
  tokens read ``token_id:N``.
- Sampling: one :class:`SamplingParams` per choice. With a ``seed``, choice
  ``i`` samples with ``seed + i`` (as vLLM's parallel sampling does), so the
  ``n`` choices differ and the request still reproduces. A missing
  ``max_tokens`` means the rest of the context.
- Admission: a request's prompts x choices enter the engine together or not
  at all; the engine's ``ValueError`` becomes a 400 naming the field.
- Streaming: server-sent events ending in ``data: [DONE]``; however the
  response ends (finished, client gone, body never started), its engine
  requests are aborted, so a vanished client frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from vllm.entrypoints.chat_utils import render_chat
from vllm.entrypoints.openai.errors import OpenAIError, from_value_error
from vllm.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatTemplateOptions,
    PromptTokensDetails,
    SamplingRequest,
    StreamOptions,
    UsageInfo,
)
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class ChunkEvents:
    """A stream's chunk events: ``response`` (built with no choices) dumped
    once around each event's one choice, the same bytes as dumping a copy
    of it per event at a third of the cost (a busy stream's biggest share
    of server CPU after the HTTP writes)."""

    def __init__(self, response: BaseModel) -> None:
        head, tail = response.model_dump_json().split('"choices":[]', 1)
        self._head, self._tail = f'data: {head}"choices":[', f"]{tail}\n\n"

    def event(self, choice: BaseModel) -> str:
        return f"{self._head}{choice.model_dump_json()}{self._tail}"


class _AbortingStreamingResponse(StreamingResponse):
    """Aborts its requests when the response ends, whatever ends it."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


def sse_response(
    events: AsyncIterator[str], stream: RequestStream
) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError as e:  # the status is sent: report in the stream
            yield sse(OpenAIError(str(e), status=HTTPStatus.SERVICE_UNAVAILABLE).body())
        yield SSE_DONE

    return _AbortingStreamingResponse(with_done(), stream)


@dataclass
class Choice:
    """One choice's output, accumulated from the stream's deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0

    def add(self, delta: RequestOutput) -> None:
        out = delta.outputs[0]
        self.text += out.text or ""
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens


async def collect(stream: RequestStream, num_choices: int) -> list[Choice]:
    """Every choice's whole output (aborted if the caller is cancelled)."""
    choices = [Choice() for _ in range(num_choices)]
    try:
        async for index, delta in stream:
            choices[index].add(delta)
    finally:
        stream.abort()
    return choices


def usage(
    prompts: list[list[int]],
    num_completion_tokens: int,
    cached_tokens: list[int] | None = None,
) -> UsageInfo:
    """Prompt tokens count once per prompt, whatever ``n``; with
    ``cached_tokens`` (per prompt: its first choice's), their details."""
    num_prompt = sum(len(p) for p in prompts)
    details = None
    if cached_tokens is not None:
        details = PromptTokensDetails(cached_tokens=sum(cached_tokens))
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt + num_completion_tokens,
        prompt_tokens_details=details,
    )


# Tokenizing a long text takes seconds (30 MB: ~50 s): off the event loop,
# on one thread (as vLLM: a tokenizer is not safe to call from many at once).
_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="vllm-tokenizer")


async def off_the_loop(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on the tokenizer's thread, the event loop free."""
    return await asyncio.get_running_loop().run_in_executor(
        _TOKENIZER_THREAD, function, *args
    )


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        enable_prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        self.models = models
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer: Any = engine.tokenizer
        self._token_strings: dict[int, str] = {}

    def cached_tokens(self, per_prompt: list[int]) -> list[int] | None:
        """What ``usage`` reports of the prompts' cached tokens: nothing
        unless ``--enable-prompt-tokens-details``."""
        return per_prompt if self.enable_prompt_tokens_details else None

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise OpenAIError(
                f"{param}: the model has no tokenizer; send token ids", param=param
            )
        return self.tokenizer

    def token_string(self, token_id: int) -> str:
        """A token as text on its own (a partial character reads U+FFFD)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._token_strings.get(token_id)
        if text is None:
            text = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def text_prompt_ids(
        self, prompt: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        tokenizer = self.require_tokenizer(param)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON may carry lone surrogates
            raise OpenAIError(
                f"{param}: expected Unicode text, got a lone surrogate "
                f"{prompt[e.start]!a} at character {e.start}",
                param=param,
            ) from None
        return list(
            tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        )

    def chat_prompt_ids(
        self, messages: list[ChatCompletionMessageParam], options: ChatTemplateOptions
    ) -> list[int]:
        tokenizer = self.require_tokenizer("messages")
        try:
            text = render_chat(tokenizer, messages, options)
        except ValueError as e:
            raise from_value_error(e) from None
        return self.text_prompt_ids(text, False, "messages")

    @staticmethod
    def check_stream_options(request: SamplingRequest) -> StreamOptions:
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "stream_options: only allowed with stream=true", param="stream_options"
            )
        return request.stream_options or StreamOptions()

    def sampling_params(
        self,
        request: SamplingRequest,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_field: str,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> list[SamplingParams]:
        """One per choice (``request.n``); ``structured`` holds the output to
        a grammar of the server's (else the request's own, if any)."""
        if request.stop:
            self.require_tokenizer("stop")
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - len(prompt)
            if max_tokens < 1:
                raise OpenAIError(
                    f"{prompt_field}: {len(prompt)} tokens leave no room to "
                    f"generate within max_model_len={self.engine.max_model_len}",
                    param=prompt_field,
                    code="context_length_exceeded",
                )
        top_k = 0 if request.top_k == -1 else request.top_k  # vLLM's "all"
        given = {
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": top_k,
            "min_p": request.min_p,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty,
        }
        # an unset knob: the checkpoint's recommended value, else SamplingParams'
        knobs: dict[str, Any] = dict(self.engine.generation_defaults.sampling)
        knobs |= {k: v for k, v in given.items() if v is not None}
        if request.logit_bias:
            # ASCII digits only: str.isdigit() takes "²", which int() refuses;
            # and short: int() refuses 4300 digits (the engine checks the range)
            if not all(
                t.isascii() and t.isdigit() and len(t) <= 18 for t in request.logit_bias
            ):
                raise OpenAIError(
                    "logit_bias: expected token ids (strings of digits) as keys, "
                    f"got {list(request.logit_bias)}",
                    param="logit_bias",
                )
            knobs["logit_bias"] = {int(t): b for t, b in request.logit_bias.items()}
        try:
            return SamplingParams(
                **knobs,
                structured_outputs=structured or structured_outputs(request),
                n=request.n,
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop if request.stop is not None else [],
                stop_token_ids=request.stop_token_ids or [],
                ignore_eos=request.ignore_eos,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            ).fan_out()
        except ValueError as e:
            raise from_value_error(e) from None

    async def admit(
        self,
        prompts: list[list[int]],
        params: list[list[SamplingParams]],
        renames: dict[str, str] | None = None,
    ) -> RequestStream:
        """Every prompt's choices into the engine; choice ``j`` of prompt
        ``i`` is the stream's index ``i * n + j``."""
        flat_prompts = [p for p, ps in zip(prompts, params, strict=True) for _ in ps]
        flat_params = [p for ps in params for p in ps]
        try:
            return await self.engine.add_requests(flat_prompts, flat_params)
        except ValueError as e:
            raise from_value_error(e, renames) from None


def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """What ``response_format`` or ``structured_outputs`` asks of the
    output (one of them at most)."""
    given = request.structured_outputs
    response_format = request.response_format
    if given is not None and response_format is not None:
        raise OpenAIError(
            "structured_outputs: give it or response_format, not both",
            param="structured_outputs",
        )
    if given is not None:
        try:
            return StructuredOutputsParams(**given)
        except TypeError:  # an unknown field
            known = [f.name for f in fields(StructuredOutputsParams)]
            unknown = sorted(set(given) - set(known))
            raise OpenAIError(
                f"structured_outputs: expected fields of {known}, got {unknown}",
                param="structured_outputs",
            ) from None
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema
    if schema is None or schema.json_schema is None:
        raise OpenAIError(
            'response_format: type "json_schema" needs json_schema.schema',
            param="response_format",
        )
    return StructuredOutputsParams(json=schema.json_schema)


def structured_renames(request: SamplingRequest) -> dict[str, str]:
    """The engine names a grammar it cannot compile by StructuredOutputsParams'
    field: the request's spelling for it."""
    if request.response_format is None:
        return {}
    return {"structured_outputs.json": "response_format"}


def json_response(payload: BaseModel) -> Response:
    return Response(payload.model_dump_json(), media_type="application/json")
