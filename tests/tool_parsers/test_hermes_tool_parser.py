"""Hermes tool calls split from a reply, whole and streamed (every split of
the text into deltas gives the same content and calls)."""

import json

import pytest

from vllm.tool_parsers import HermesToolParser

PARSER = HermesToolParser()
WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TIME = '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("reply", "content", "calls"),
    [
        ("no calls at all", "no calls at all", []),
        (WEATHER, None, [("get_weather", {"city": "Paris"})]),
        (
            "Let me check.\n" + WEATHER + "\n" + TIME,
            "Let me check.\n",
            [("get_weather", {"city": "Paris"}), ("now", {})],
        ),
        (WEATHER + "\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),
        # cut off by max_tokens after a whole call: it still counts
        (WEATHER[: -len("</tool_call>")], None, [("get_weather", {"city": "Paris"})]),
    ],
)
def test_a_whole_reply(reply, content, calls):
    got_content, got_calls = PARSER.extract(reply)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert all(c.id.startswith("chatcmpl-tool-") for c in got_calls)


@pytest.mark.parametrize(
    "reply",
    [
        "<tool_call>{not json}</tool_call>",
        WEATHER + '<tool_call>{"arguments": {}}</tool_call>',  # a call without name
        '<tool_call>{"name": "get_weather", "argu',  # cut off inside the JSON
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_a_call_that_does_not_parse_leaves_all_as_content(reply):
    assert PARSER.extract(reply) == (reply, [])


@pytest.mark.parametrize(
    "reply", ["Let me check.\n" + WEATHER + "\n" + TIME, "plain <tool text", WEATHER]
)
def test_every_split_streams_like_the_whole_reply(reply):
    content, calls = PARSER.extract(reply)
    for cut in range(len(reply) + 1):
        stream = PARSER.stream()
        first = stream.feed(reply[:cut], False)
        last = stream.feed(reply[cut:], True)
        assert first[0] + last[0] == (content or "")
        assert _calls(first[1] + last[1]) == _calls(calls)
        assert stream.calls == len(calls)


def test_a_possible_tag_is_held_until_the_text_decides():
    stream = PARSER.stream()
    assert stream.feed("Sure <tool", False) == ("Sure ", [])
    assert stream.feed("bag", False) == ("<toolbag", [])
    assert stream.feed("<tool_call>{", False) == ("", [])
    content, calls = stream.feed('"name": "now"}</tool_call>', False)
    assert (content, _calls(calls)) == ("", [("now", {})])


def test_a_stream_that_ends_inside_a_broken_call_sends_its_text():
    stream = PARSER.stream()
    assert stream.feed("<tool_call>{broken", False) == ("", [])
    assert stream.feed("", True) == ("<tool_call>{broken", [])
