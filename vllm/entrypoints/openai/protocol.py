"""The OpenAI API's request and response bodies, as pydantic models.

Requests validate strictly (a string where a number belongs is an error, not
coerced), so wrong types become a 400 naming the field; unknown fields are
ignored, as OpenAI's and vLLM's servers do. Value ranges that
:class:`~vllm.sampling_params.SamplingParams` checks (temperature, top_p,
...) are left to it: one place states them. Besides OpenAI's fields, the
sampling knobs vLLM adds are accepted: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens`` (and
:class:`ChatTemplateOptions` for chat).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm.sampling_params import MAX_SEED


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(RequestModel):
    include_usage: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details (vLLM's)
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaFormat(RequestModel):
    name: str
    # ("schema" itself would shadow pydantic's BaseModel.schema)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestModel):
    """What completions and chat share: the model, ``n``, streaming and
    sampling; the output's structure as OpenAI's ``response_format`` or
    vLLM's ``structured_outputs`` (the fields of
    :class:`~vllm.sampling_params.StructuredOutputsParams`)."""

    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED - 128)  # choice i: seed + i
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: every token (vLLM's spelling)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None


# -- completions ---------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # None: the rest of the context; 0 only with echo (the prompt alone)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    # None for an echoed prompt's first token, which nothing predicts
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token that ended it (None at EOS)
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# -- chat ----------------------------------------------------------------------


class ChatCompletionContentPartText(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON


class ToolCall(RequestModel):
    """A reply's call; also an assistant message's earlier one, sent back in
    the conversation (validated as requests are)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessageParam(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatCompletionContentPartText] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's reply to that call
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as
        vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatCompletionToolsParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatTemplateOptions(RequestModel):
    """How the messages become the prompt (vLLM's fields): the generation
    prompt after them, or the last (assistant) message left open to be
    continued; ``chat_template_kwargs`` are the template's own variables
    (Qwen3: ``{"enable_thinking": false}``); ``tools`` are rendered as
    the template lays them out."""

    tools: list[ChatCompletionToolsParam] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still sent
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include_reasoning: bool = True  # under a reasoning parser (vLLM's field)
    # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: a reply's first call only


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # under a reasoning parser
    tool_calls: list[ToolCall] = Field(default_factory=list)  # under a tool parser


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token that ended it (None at EOS)
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int  # of the call in the reply
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token that ended it (None at EOS)
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- tokenizer -----------------------------------------------------------------


class TokenizeRequest(ChatTemplateOptions):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat
    template), as vLLM's ``/tokenize``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatCompletionMessageParam] | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
