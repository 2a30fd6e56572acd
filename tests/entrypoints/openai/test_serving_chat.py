"""How a reply's text becomes chat messages and deltas under the reasoning
and tool-call parsers (the live server's side is ``test_reasoning.py`` and
``test_tool_calls.py``)."""

import json

from vllm.entrypoints.openai.protocol import DeltaMessage
from vllm.entrypoints.openai.serving_chat import (
    _finish_reason,
    chat_message,
    delta_message,
)
from vllm.reasoning import Qwen3ReasoningParser
from vllm.tool_parsers import HermesToolParser

PARSER = Qwen3ReasoningParser()
REPLY = "<think>plan a</think>answer"


def test_a_whole_reply_becomes_one_message():
    assert chat_message(None, REPLY, False, True).content == REPLY
    split = chat_message(PARSER, REPLY, False, True)
    assert (split.reasoning, split.content) == ("plan a", "answer")
    dropped = chat_message(PARSER, REPLY, False, False)
    assert (dropped.reasoning, dropped.content) == (None, "answer")
    thinking = chat_message(PARSER, "cut short", True, True)
    assert (thinking.reasoning, thinking.content) == ("cut short", None)
    plain = chat_message(PARSER, "no thinking", False, True)
    assert (plain.reasoning, plain.content) == (None, "no thinking")


def test_two_choices_stream_apart_and_held_text_sends_nothing():
    pieces = ["<thi", "nk>plan", " a</th", "ink>ans", "wer", ""]
    streams = [PARSER.stream(), PARSER.stream()]
    got: list[list[DeltaMessage | None]] = [[], []]
    for i, piece in enumerate(pieces):  # the choices' deltas interleaved
        for choice in (0, 1):
            final = i == len(pieces) - 1
            got[choice].append(delta_message(streams[choice], piece, final, True))
    for deltas in got:
        assert deltas[0] is None  # "<thi" may open the tag: held
        sent = [d for d in deltas if d is not None]
        assert "".join(d.reasoning or "" for d in sent) == "plan a"
        assert "".join(d.content or "" for d in sent) == "answer"
        assert deltas[-1] == DeltaMessage()  # the final one, with nothing new


def test_without_reasoning_only_the_answer_streams():
    stream = PARSER.stream()
    deltas = [delta_message(stream, p, False, False) for p in ("<think>x", "</think>")]
    assert deltas == [None, None]
    assert delta_message(stream, "y", True, False) == DeltaMessage(content="y")


def test_without_a_parser_text_streams_as_it_comes():
    assert delta_message(None, "", False, True) is None
    assert delta_message(None, "<think>", False, True) == DeltaMessage(
        content="<think>"
    )
    assert delta_message(None, "", True, True) == DeltaMessage(content="")


TOOLS = HermesToolParser()
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_a_whole_reply_with_calls_reports_them_after_its_thinking():
    message = chat_message(
        PARSER, "<think>need data</think>" + CALL, False, True, TOOLS
    )
    assert (message.reasoning, message.content) == ("need data", None)
    [call] = message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # a call inside the thinking is thinking, not a call
    thought = chat_message(PARSER, "<think>" + CALL + "</think>ok", False, True, TOOLS)
    assert (thought.content, thought.tool_calls) == ("ok", [])
    assert _finish_reason("stop", True) == "tool_calls"
    assert _finish_reason("length", True) == "tool_calls"  # as vLLM reports it
    assert _finish_reason("stop", False) == "stop"


def test_streamed_calls_are_numbered_across_deltas():
    calls = TOOLS.stream()
    pieces = ["Checking. " + CALL[:20], CALL[20:], "\n" + CALL, ""]
    deltas = [
        delta_message(None, p, i == len(pieces) - 1, True, calls)
        for i, p in enumerate(pieces)
    ]
    assert deltas[0] == DeltaMessage(content="Checking. ")
    assert deltas[1] is not None and deltas[2] is not None
    assert [c.index for c in deltas[1].tool_calls + deltas[2].tool_calls] == [0, 1]
    assert deltas[1].content is None and deltas[1].tool_calls[0].id
    assert deltas[3] == DeltaMessage(content="")  # the final one, nothing new
