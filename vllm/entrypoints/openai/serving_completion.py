"""``POST /v1/completions``: text or token-id prompts, one or several.

Choice ``j`` of prompt ``i`` has index ``i * n + j``. Streamed, each event
carries one choice's new text (and its tokens' log-probs); an event is
skipped while a choice's text is held back (a partial character, a possible
stop string), so the events' texts concatenate to exactly the non-streamed
text. ``logprobs: k`` reports each token's log-prob and, in
``top_logprobs``, the ``k`` most likely tokens plus the sampled one (as
vLLM does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

from fastapi.responses import Response

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    StreamOptions,
)
from vllm.entrypoints.openai.serving_engine import (
    ChunkEvents,
    OpenAIServing,
    collect,
    json_response,
    off_the_loop,
    sse,
    sse_response,
    usage,
)
from vllm.v1.engine.async_llm import RequestStream


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Response:
        self.models.check(request.model)
        if request.echo:
            raise OpenAIError("echo: not supported", param="echo")
        options = self.check_stream_options(request)
        prompts = await off_the_loop(self._prompt_ids, request.prompt)
        logprobs = request.logprobs
        params = [
            self.sampling_params(request, p, request.max_tokens, logprobs, "prompt")
            for p in prompts
        ]
        stream = await self.admit(prompts, params)
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model,
            choices=[],
        )
        if request.stream:
            events = self._events(stream, response, prompts, options, logprobs)
            return sse_response(events, stream)
        choices = await collect(stream, len(prompts) * request.n)
        for index, choice in enumerate(choices):
            response.choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=choice.text,
                    logprobs=None
                    if logprobs is None
                    else self._logprobs(choice.token_ids, choice.logprobs, 0),
                    finish_reason=choice.finish_reason,
                )
            )
        num_tokens = sum(len(c.token_ids) for c in choices)
        response.usage = usage(prompts, num_tokens)
        return json_response(response)

    def _prompt_ids(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.text_prompt_ids(prompt)]
        if not prompt:
            raise OpenAIError("prompt: expected at least one prompt", param="prompt")
        if isinstance(prompt[0], int):
            return [list(cast(list[int], prompt))]
        many = cast(list[str] | list[list[int]], prompt)
        return [
            self.text_prompt_ids(p) if isinstance(p, str) else list(p) for p in many
        ]

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int
    ) -> CompletionLogProbs:
        """Log-probs of tokens whose text starts at ``offset`` in the choice."""
        result = CompletionLogProbs()
        for token, step in zip(token_ids, logprobs, strict=True):
            text = self.token_string(token)
            result.text_offset.append(offset)
            result.tokens.append(text)
            result.token_logprobs.append(step[token])
            result.top_logprobs.append(
                {self.token_string(t): lp for t, lp in step.items()}
            )
            offset += len(text)
        return result

    async def _events(
        self,
        stream: RequestStream,
        response: CompletionResponse,
        prompts: list[list[int]],
        options: StreamOptions,
        logprobs: int | None,
    ) -> AsyncIterator[str]:
        num_tokens = 0
        offsets: dict[int, int] = {}
        chunks = ChunkEvents(response)
        async for batch in stream.batches():
            events = []
            for index, delta in batch:
                out = delta.outputs[0]
                num_tokens += len(out.token_ids)
                choice_logprobs = None
                if logprobs is not None and out.logprobs:
                    start = offsets.get(index, 0)
                    choice_logprobs = self._logprobs(out.token_ids, out.logprobs, start)
                    offsets[index] = start + sum(len(t) for t in choice_logprobs.tokens)
                if out.text == "" and choice_logprobs is None and not delta.finished:
                    continue  # held back (with no tokenizer text is None: always sent)
                choice = CompletionResponseChoice(
                    index=index,
                    text=out.text or "",
                    logprobs=choice_logprobs,
                    finish_reason=out.finish_reason,
                )
                events.append(chunks.event(choice))
            if events:
                yield "".join(events)  # one write for the batch
        if options.include_usage:
            yield sse(response.model_copy(update={"usage": usage(prompts, num_tokens)}))
