"""Chat messages into a prompt through the checkpoint's chat template, for
``LLM.chat`` and the server's chat and tokenize endpoints alike.

Messages take the OpenAI API's form (:class:`ChatCompletionMessageParam`):
content a string or text parts (joined by newlines, as vLLM does), an
assistant's earlier tool calls with JSON arguments, which the template
gets as objects (vLLM's rule: Qwen3's template writes a string as it
is). ``chat_template_kwargs`` are the template's own variables and may not
shadow the renderer's arguments. Errors are ``ValueError`` s naming the
field.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import jinja2
from pydantic import ValidationError

from vllm.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatTemplateOptions,
)


def _field_error(error: ValidationError, prefix: str = "") -> ValueError:
    """Pydantic's first complaint as ``"field: message"``."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return ValueError(f"{prefix}{where}: {first['msg']}")


def parse_messages(messages: list[Any]) -> list[ChatCompletionMessageParam]:
    """Message dicts validated as the API validates them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list, got {messages!r:.80}")
    parsed = []
    for i, message in enumerate(messages):
        try:
            parsed.append(ChatCompletionMessageParam.model_validate(message))
        except ValidationError as e:
            raise _field_error(e, f"messages[{i}].") from None
    return parsed


def chat_options(**options: Any) -> ChatTemplateOptions:
    """:class:`ChatTemplateOptions` from keyword values, validated."""
    try:
        return ChatTemplateOptions.model_validate(options)
    except ValidationError as e:
        raise _field_error(e) from None


def template_message(message: ChatCompletionMessageParam) -> dict[str, Any]:
    """A message as chat templates read it."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except (json.JSONDecodeError, RecursionError):
                raise ValueError(
                    f"messages: a tool call's arguments are not JSON: "
                    f"{call.function.arguments[:80]!r}"
                ) from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": call.type, "function": function})
        rendered["tool_calls"] = calls
    return rendered


def render_chat(
    tokenizer: Any,
    messages: list[ChatCompletionMessageParam],
    options: ChatTemplateOptions,
    chat_template: str | None = None,
) -> str:
    """The prompt text of ``messages`` (special tokens included: encode it
    without adding them again), by ``chat_template`` if given, else the
    tokenizer's."""
    if options.continue_final_message and options.add_generation_prompt:
        raise ValueError(
            "continue_final_message: needs add_generation_prompt=false (the "
            "last message is continued, no new one starts)"
        )
    variables = options.chat_template_kwargs or {}
    if variables:  # (most requests send none: no signature to read)
        render = inspect.signature(type(tokenizer).apply_chat_template)
        # the renderer's arguments, and the messages it hands the template
        named = {n for n, p in render.parameters.items() if p.kind is not p.VAR_KEYWORD}
        if clash := sorted((named | {"messages"}) & variables.keys()):
            raise ValueError(
                f"chat_template_kwargs: {clash} are the renderer's own "
                "arguments; give the template's variables"
            )
    conversation = [template_message(m) for m in messages]
    if options.tools:
        variables = variables | {
            "tools": [t.model_dump(exclude_none=True) for t in options.tools]
        }
    try:
        text: str = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=chat_template,
            tokenize=False,
            **variables,
        )
        return text
    # no template, a broken one, one that trips on a variable's type, or
    # a message or tool nested too deep to copy
    except (jinja2.TemplateError, ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"messages: the chat template failed: {e}") from None
