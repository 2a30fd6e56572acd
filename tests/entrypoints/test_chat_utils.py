"""Chat messages through the tiny checkpoint's chat template (Qwen's layout);
the server's tests check the same errors as 400s naming the field."""

import copy

import pytest

from vllm.entrypoints.chat_utils import (
    chat_options,
    parse_messages,
    render_chat,
    template_message,
)
from vllm.model_executor.model_loader.tiny_checkpoint import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(320)


def test_messages_are_validated_with_their_index_and_field():
    ok = {"role": "user", "content": "hi"}
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role: Input should be"):
        parse_messages([ok, {"role": "bot", "content": "x"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role: Field required"):
        parse_messages([{"content": "x"}])
    with pytest.raises(ValueError, match=r"^messages: expected a non-empty list"):
        parse_messages({"role": "user"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tools\.0\.function: Field required"):
        chat_options(tools=[{"type": "function"}])


def test_template_messages_join_text_parts_and_parse_call_arguments():
    (call,) = parse_messages(
        [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": "b"},
                ],
                "tool_calls": [
                    {"id": "c1", "function": {"name": "f", "arguments": '{"x": [1]}'}}
                ],
            }
        ]
    )
    assert template_message(call) == {
        "role": "assistant",
        "content": "a\nb",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": {"x": [1]}},
            }
        ],
    }
    (bad,) = parse_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": "{x"}}
                ],
            }
        ]
    )
    with pytest.raises(
        ValueError, match=r"^messages: a tool call's arguments are not JSON"
    ):
        template_message(bad)


def test_render_lays_out_tools_and_names_template_failures(tokenizer):
    messages = parse_messages([{"role": "user", "content": "hi"}])
    tool = {"type": "function", "function": {"name": "clock", "parameters": {}}}
    text = render_chat(tokenizer, messages, chat_options(tools=[tool]))
    # tojson keeps the tool's own key order
    tools = (
        '<tools>{"type": "function", "function": {"name": "clock", "parameters": {}}}'
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\n" + tools + "</tools>")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = "{% if %}"
    with pytest.raises(ValueError, match=r"^messages: the chat template failed"):
        render_chat(broken, messages, chat_options())
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: \['messages'\]"):
        render_chat(
            tokenizer, messages, chat_options(chat_template_kwargs={"messages": []})
        )
