"""``POST /v1/chat/completions``: messages rendered with the chat template.

``content`` is a string or a list of text parts (joined by newlines).
``max_completion_tokens`` wins over the older ``max_tokens``; without
either, a reply may fill the rest of the context. Streamed, each choice
first gets ``{"role": "assistant", "content": ""}``, then its new text as it
is produced (never a partial character or a possible stop string), the last
event carrying ``finish_reason``. ``logprobs: true`` reports each token's
log-prob and its ``top_logprobs`` most likely alternatives. Under a
reasoning parser (``--reasoning-parser``) a reply's thinking comes as
``reasoning`` (vLLM's name, formerly ``reasoning_content``) and its answer
as ``content`` (``null`` while there is none), streamed alike;
``include_reasoning: false`` drops the thinking (not its tokens' logprobs).

``tools`` are rendered by the chat template. Under a tool parser
(``--enable-auto-tool-choice --tool-call-parser``) and ``tool_choice``
``"auto"`` (the default with tools) the answer's calls come as
``tool_calls`` (streamed whole, one delta per call) with finish reason
``"tool_calls"`` (also when cut short, as vLLM reports it); ``"none"``
leaves them in the content; ``parallel_tool_calls: false`` keeps a reply's
first call only (vLLM's). ``"required"`` and a named function hold the
reply to JSON calls by structured outputs (:mod:`~vllm.tool_parsers.
forced_tool_calls`, no parser needed, no reasoning part: the JSON starts
the reply); a named call finishes with "stop", as OpenAI's forced calls
do. ``"auto"`` without a parser is refused (vLLM's message).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    StreamOptions,
    ToolCall,
)
from vllm.entrypoints.openai.serving_engine import (
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
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.reasoning.qwen3_reasoning_parser import (
    Qwen3ReasoningParser,
    ReasoningStream,
    prompt_opens_thinking,
)
from vllm.tool_parsers.forced_tool_calls import ForcedCallStream, ForcedToolCalls
from vllm.tool_parsers.hermes_tool_parser import (
    HermesToolParser,
    ParsedToolCall,
    ToolCallStream,
)
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

_PROMPT_TAIL_TOKENS = 16  # a closing "<think>\n", however a BPE splits it
ToolCalls = HermesToolParser | ForcedToolCalls
CallStream = ToolCallStream | ForcedCallStream


def chat_message(
    parser: Qwen3ReasoningParser | None,
    text: str,
    thinking: bool,
    include_reasoning: bool,
    tool_parser: ToolCalls | None = None,
) -> ChatMessage:
    """A whole reply as the response's message (the tool calls come from
    the answer, not the thinking)."""
    reasoning: str | None = None
    content: str | None = text
    if parser is not None:
        reasoning, content = parser.split(text, thinking)
        if reasoning is not None:
            content = content or None
    calls: list[ParsedToolCall] = []
    if tool_parser is not None and content:
        content, calls = tool_parser.extract(content)
    return ChatMessage(
        content=content,
        reasoning=reasoning if include_reasoning else None,
        tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ],
    )


def delta_message(
    stream: ReasoningStream | None,
    text: str,
    final: bool,
    include_reasoning: bool,
    calls: CallStream | None = None,
) -> DeltaMessage | None:
    """A streamed reply's new ``text`` as a delta, split by the reasoning
    ``stream`` and the tool ``calls`` stream where given; None while all of
    it is held back (a final delta is always sent, for its finish reason)."""
    reasoning, content = "", text
    if stream is not None:
        reasoning, content = stream.feed(text, final)
        if not include_reasoning:
            reasoning = ""
    tool_calls = []
    if calls is not None:
        first = calls.calls
        content, parsed = calls.feed(content, final)
        tool_calls = [
            DeltaToolCall(
                index=first + i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(parsed)
        ]
    if not reasoning and not content and not tool_calls and not final:
        return None
    if stream is None and not tool_calls:
        return DeltaMessage(content=content)
    return DeltaMessage(
        content=content or None, reasoning=reasoning or None, tool_calls=tool_calls
    )


def _named(tool_parser: ToolCalls | None) -> bool:
    return isinstance(tool_parser, ForcedToolCalls) and tool_parser.named is not None


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A finished reply that called tools finishes with "tool_calls" (cut
    short too, as in vLLM)."""
    return "tool_calls" if called and reason is not None else reason


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        reasoning_parser: Qwen3ReasoningParser | None = None,
        enable_prompt_tokens_details: bool = False,
        tool_parser: HermesToolParser | None = None,
    ) -> None:
        super().__init__(engine, models, enable_prompt_tokens_details)
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser  # with auto tool choice enabled

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolCalls | None:
        """What reads this request's calls: the server's parser under
        "auto", forced JSON calls under "required" or a named function."""
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if request.tools else "none"
        if choice == "none":
            return None
        function = choice.get("function") if isinstance(choice, dict) else None
        if choice == "required" or isinstance(function, dict):
            return self._forced_calls(request, function)
        if choice != "auto":
            raise OpenAIError(
                'tool_choice: expected "none", "auto", "required" or '
                f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
                param="tool_choice",
            )
        if not request.tools:
            raise OpenAIError('tool_choice: "auto" needs tools', param="tool_choice")
        if self.tool_parser is None:
            raise OpenAIError(
                'tool_choice: "auto" tool choice requires --enable-auto-tool-choice '
                "and --tool-call-parser to be set",
                param="tool_choice",
            )
        return self.tool_parser

    @staticmethod
    def _forced_calls(
        request: ChatCompletionRequest, function: dict[str, Any] | None
    ) -> ForcedToolCalls:
        if not request.tools:
            raise OpenAIError(
                f"tool_choice: {request.tool_choice!r} needs tools", param="tool_choice"
            )
        if request.response_format is not None or request.structured_outputs:
            raise OpenAIError(
                "tool_choice: a forced call holds the reply to its JSON; drop "
                "response_format / structured_outputs",
                param="tool_choice",
            )
        parameters = {t.function.name: t.function.parameters for t in request.tools}
        named = None
        if function is not None:
            named = function.get("name")
            if named not in parameters:
                raise OpenAIError(
                    f"tool_choice: function {named!r} is not one of the tools "
                    f"{sorted(parameters)}",
                    param="tool_choice",
                )
        return ForcedToolCalls(parameters, named)

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        self.models.check(request.model)
        options = self.check_stream_options(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(
                "top_logprobs: only allowed with logprobs=true", param="top_logprobs"
            )
        tool_parser = self._tool_parser(request)
        forced = tool_parser if isinstance(tool_parser, ForcedToolCalls) else None
        # a forced call's JSON starts the reply: no thinking to split off
        reasoning = None if forced else self.reasoning_parser
        prompt = await off_the_loop(self.chat_prompt_ids, request.messages, request)
        renames = {"prompt": "messages", **structured_renames(request)}
        if forced is not None:  # its grammar is the tools' parameter schemas
            renames["structured_outputs.json"] = "tools"
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(
            request,
            prompt,
            max_tokens,
            top,
            "messages",
            structured=forced.structured_outputs if forced else None,
        )
        thinking = reasoning is not None and prompt_opens_thinking(
            self.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:])
        )
        stream = await self.admit([prompt], [params], renames)
        response = ChatCompletionStreamResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model,
            choices=[],
        )
        if request.stream:
            events = self._events(
                stream, response, prompt, request, options, top, reasoning,
                thinking, tool_parser,
            )  # fmt: skip
            return sse_response(events, stream)
        choices = await collect(stream, request.n)
        messages = [
            chat_message(
                reasoning,
                choice.text or "",
                thinking,
                request.include_reasoning,
                tool_parser,
            )
            for choice in choices
        ]
        if not request.parallel_tool_calls:
            for message in messages:
                del message.tool_calls[1:]
        result = ChatCompletionResponse(
            id=response.id,
            created=response.created,
            model=request.model,
            choices=[
                ChatCompletionResponseChoice(
                    index=index,
                    message=message,
                    logprobs=None
                    if top is None
                    else self._logprobs(choice.token_ids, choice.logprobs, top),
                    finish_reason=_finish_reason(
                        choice.finish_reason,
                        bool(message.tool_calls) and not _named(tool_parser),
                    ),
                    stop_reason=choice.stop_reason,
                )
                for index, (choice, message) in enumerate(
                    zip(choices, messages, strict=True)
                )
            ],
            usage=usage(
                [prompt],
                sum(len(c.token_ids) for c in choices),
                self.cached_tokens([choices[0].num_cached_tokens]),
            ),
        )
        return json_response(result)

    def _entry(self, token: int, logprob: float) -> ChatCompletionLogProb:
        text = self.token_string(token)
        return ChatCompletionLogProb(
            token=text, logprob=logprob, bytes=list(text.encode())
        )

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], top: int
    ) -> ChatCompletionLogProbs:
        content = []
        for token, step in zip(token_ids, logprobs, strict=True):
            entry = self._entry(token, step[token])
            best = sorted(step.items(), key=lambda kv: kv[1], reverse=True)[:top]
            content.append(
                ChatCompletionLogProbsContent(
                    **entry.model_dump(),
                    top_logprobs=[self._entry(t, lp) for t, lp in best],
                )
            )
        return ChatCompletionLogProbs(content=content)

    async def _events(
        self,
        stream: RequestStream,
        response: ChatCompletionStreamResponse,
        prompt: list[int],
        request: ChatCompletionRequest,
        options: StreamOptions,
        top: int | None,
        parser: Qwen3ReasoningParser | None,
        thinking: bool,
        tool_parser: ToolCalls | None,
    ) -> AsyncIterator[str]:
        event = ChunkEvents(response).event
        splits: list[ReasoningStream | None] = [None] * request.n
        if parser is not None:  # one state per choice
            splits = [parser.stream(thinking) for _ in range(request.n)]
        calls: list[CallStream | None] = [None] * request.n
        if tool_parser is not None:
            calls = [tool_parser.stream() for _ in range(request.n)]

        for index in range(request.n):
            role = DeltaMessage(role="assistant", content="")
            yield event(ChatCompletionResponseStreamChoice(index=index, delta=role))
        num_tokens = 0
        cached = 0  # the first choice's, as the prompt's
        async for batch in stream.batches():
            events = []
            for index, delta in batch:
                out = delta.outputs[0]
                num_tokens += len(out.token_ids)
                if index == 0 and delta.num_cached_tokens is not None:
                    cached = delta.num_cached_tokens
                logprobs = None
                if top is not None and out.logprobs:
                    logprobs = self._logprobs(out.token_ids, out.logprobs, top)
                message = delta_message(
                    splits[index],
                    out.text or "",
                    delta.finished,
                    request.include_reasoning,
                    calls[index],
                )
                if message is not None and not request.parallel_tool_calls:
                    message.tool_calls = [c for c in message.tool_calls if c.index == 0]
                if message is None and logprobs is None:
                    continue
                called = calls[index]
                choice = ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=message or DeltaMessage(content=""),
                    logprobs=logprobs,
                    finish_reason=_finish_reason(
                        out.finish_reason,
                        called is not None
                        and called.calls > 0
                        and not _named(tool_parser),
                    ),
                    stop_reason=out.stop_reason,
                )
                events.append(event(choice))
            if events:
                yield "".join(events)  # one write for the batch
        if options.include_usage:
            yield sse(
                response.model_copy(
                    update={
                        "usage": usage(
                            [prompt], num_tokens, self.cached_tokens([cached])
                        )
                    }
                )
            )
