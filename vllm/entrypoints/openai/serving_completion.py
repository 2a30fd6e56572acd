"""``POST /v1/completions``: text or token-id prompts, one or several.

Choice ``j`` of prompt ``i`` has index ``i * n + j``. Streamed, each event
carries one choice's new text (and its tokens' log-probs); an event is
skipped while a choice's text is held back (a partial character, a possible
stop string), so the events' texts concatenate to exactly the non-streamed
text. ``logprobs: k`` reports each token's log-prob and, in
``top_logprobs``, the ``k`` most likely tokens plus the sampled one (as
vLLM does). ``echo: true`` puts the prompt before each choice's text (a
stream's first event of the choice carries it) and, with ``logprobs``, the
prompt tokens' log-probs before the generated ones', the first ``null``
(nothing predicts it): what evaluation harnesses score prompts with.
``max_tokens: 0`` is allowed with ``echo`` alone (vLLM's): the engine
samples one token, which the response leaves out (its text, log-probs,
usage and finish reason: "length"), so it holds the prompt and its
log-probs only; the prompt must leave that token room in
``max_model_len`` (vLLM's does not need to).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
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
    Choice,
    ChunkEvents,
    OpenAIServing,
    collect,
    json_response,
    off_the_loop,
    sse,
    sse_response,
    structured_renames,
    usage,
)
from vllm.v1.engine.async_llm import RequestStream


@dataclass
class _Echo:
    text: str
    logprobs: CompletionLogProbs | None
    end: int  # the text offset the generated tokens' log-probs start at


def _text_end(logprobs: CompletionLogProbs) -> int:
    """The text offset just past these tokens'."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Response:
        self.models.check(request.model)
        options = self.check_stream_options(request)
        prompts = await off_the_loop(self._prompt_ids, request.prompt)
        echoes = None
        if request.echo:
            echoes = await off_the_loop(self._echoes, request.prompt, prompts)
        logprobs = request.logprobs
        prompt_logprobs = logprobs if request.echo else None
        prompt_only = request.max_tokens == 0
        if prompt_only and (not request.echo or request.min_tokens):
            raise OpenAIError(
                "max_tokens: expected >= 1 (0 only with echo and no min_tokens: "
                "the prompt alone)",
                param="max_tokens",
            )
        max_tokens = 1 if prompt_only else request.max_tokens
        params = [
            self.sampling_params(
                request, p, max_tokens, logprobs, "prompt", prompt_logprobs
            )
            for p in prompts
        ]
        stream = await self.admit(prompts, params, structured_renames(request))
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model,
            choices=[],
        )
        if request.stream:
            events = self._events(
                stream,
                response,
                prompts,
                n=request.n,
                options=options,
                logprobs=logprobs,
                echoes=echoes,
                prompt_only=prompt_only,
            )
            return sse_response(events, stream)
        choices = await collect(stream, len(prompts) * request.n)
        if prompt_only:
            choices = [
                replace(
                    c,
                    text="",
                    token_ids=[],
                    logprobs=[],
                    finish_reason="length",
                    stop_reason=None,
                )
                for c in choices
            ]
        for index, choice in enumerate(choices):
            echo = self._echo(index // request.n, prompts, echoes, choice, logprobs)
            choice_logprobs = None
            if logprobs is not None:
                choice_logprobs = self._logprobs(
                    choice.token_ids, choice.logprobs, echo.end, echo.logprobs
                )
            response.choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=echo.text + choice.text,
                    logprobs=choice_logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        num_tokens = sum(len(c.token_ids) for c in choices)
        cached = [choices[i * request.n].num_cached_tokens for i in range(len(prompts))]
        response.usage = usage(prompts, num_tokens, self.cached_tokens(cached))
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

    def _echoes(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        prompts: list[list[int]],
    ) -> list[str]:
        """Each prompt's text as echoed: as sent, or its tokens decoded."""
        tokenizer = self.require_tokenizer("echo")
        one = isinstance(prompt, str) or isinstance(prompt[0], int)
        sent = [prompt] if one else cast(list[str] | list[list[int]], prompt)
        return [
            p if isinstance(p, str) else tokenizer.decode(ids)
            for p, ids in zip(sent, prompts, strict=True)
        ]

    def _echo(
        self,
        prompt_index: int,
        prompts: list[list[int]],
        echoes: list[str] | None,
        choice: Choice,
        logprobs: int | None,
    ) -> _Echo:
        """What a choice's first text and log-probs start with (an aborted
        request's may lack prompt log-probs)."""
        if echoes is None:
            return _Echo("", None, 0)
        text, ids = echoes[prompt_index], prompts[prompt_index]
        entries = choice.prompt_logprobs
        if logprobs is None or entries is None or len(entries) != len(ids):
            return _Echo(text, None, len(text))
        echoed = self._logprobs(ids, entries, 0)
        # the generated tokens' offsets go on from the prompt tokens' texts
        # (vLLM's), which a character split over tokens makes longer
        return _Echo(text, echoed, _text_end(echoed))

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None] | list[dict[int, float]],
        offset: int,
        before: CompletionLogProbs | None = None,
    ) -> CompletionLogProbs:
        """Log-probs of tokens whose text starts at ``offset`` in the choice,
        after ``before``'s (an echoed prompt's)."""
        result = before.model_copy(deep=True) if before else CompletionLogProbs()
        for token, step in zip(token_ids, logprobs, strict=True):
            text = self.token_string(token)
            result.text_offset.append(offset)
            result.tokens.append(text)
            result.token_logprobs.append(None if step is None else step[token])
            result.top_logprobs.append(
                None
                if step is None
                else {self.token_string(t): lp for t, lp in step.items()}
            )
            offset += len(text)
        return result

    async def _events(
        self,
        stream: RequestStream,
        response: CompletionResponse,
        prompts: list[list[int]],
        n: int,
        options: StreamOptions,
        logprobs: int | None,
        echoes: list[str] | None,
        prompt_only: bool,
    ) -> AsyncIterator[str]:
        num_tokens = 0
        cached: dict[int, int] = {}
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        chunks = ChunkEvents(response)
        async for batch in stream.batches():
            events = []
            for index, delta in batch:
                out = delta.outputs[0]
                if delta.num_cached_tokens is not None:
                    cached[index] = delta.num_cached_tokens
                if prompt_only:
                    reason = out.finish_reason and "length"
                    out = replace(
                        out,
                        text="",
                        token_ids=[],
                        logprobs=None,
                        finish_reason=reason,
                        stop_reason=None,
                    )
                num_tokens += len(out.token_ids)
                echo = _Echo("", None, offsets.get(index, 0))
                if echoes is not None and index not in echoed:
                    echoed.add(index)
                    first = Choice(prompt_logprobs=delta.prompt_logprobs)
                    echo = self._echo(index // n, prompts, echoes, first, logprobs)
                choice_logprobs = echo.logprobs
                start = echo.end
                if logprobs is not None and out.logprobs:
                    choice_logprobs = self._logprobs(
                        out.token_ids, out.logprobs, start, echo.logprobs
                    )
                    start = _text_end(choice_logprobs)
                offsets[index] = start
                text = echo.text + (out.text or "")
                held = text == "" and choice_logprobs is None
                if held and out.text is not None and not delta.finished:
                    continue  # held back (with no tokenizer text is None: always sent)
                choice = CompletionResponseChoice(
                    index=index,
                    text=text,
                    logprobs=choice_logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
                events.append(chunks.event(choice))
            if events:
                yield "".join(events)  # one write for the batch
        if options.include_usage:
            per_prompt = [cached.get(i * n, 0) for i in range(len(prompts))]
            total = usage(prompts, num_tokens, self.cached_tokens(per_prompt))
            yield sse(response.model_copy(update={"usage": total}))
