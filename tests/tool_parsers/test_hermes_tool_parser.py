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
            [("get_weather", {"city": "Paris"}), ("now", "{}")],  # a string stays one
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
        '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
    ],
)
def test_a_call_that_does_not_parse_leaves_all_as_content(reply):
    assert PARSER.extract(reply) == (reply, [])


@pytest.mark.parametrize(
    "reply",
    [
        "Let me check.\n" + WEATHER + "\n" + TIME,
        "plain <tool text",
        WEATHER,
        "<tool_call>oops</tool_call>\n\nThe answer",  # blanks after a non-call kept
    ],
)
def test_every_split_streams_like_the_whole_reply(reply):
    content, calls = PARSER.extract(reply)
    step = max(1, len(reply) // 12)
    for first_cut in range(0, len(reply) + 1, step):
        for second_cut in range(first_cut, len(reply) + 1, step):
            stream = PARSER.stream()
            pieces = [
                stream.feed(reply[:first_cut], False),
                stream.feed(reply[first_cut:second_cut], False),
                stream.feed(reply[second_cut:], True),
            ]
            assert "".join(p[0] for p in pieces) == (content or "")
            assert _calls([c for p in pieces for c in p[1]]) == _calls(calls)
            assert stream.calls == len(calls)


def test_a_call_after_a_sent_one_that_does_not_parse_streams_as_text():
    """Streamed, the first call is out before the second fails (the whole
    reply would be all content)."""
    reply = WEATHER + "<tool_call>{bad}</tool_call>"
    content, calls = PARSER.stream().feed(reply, True)
    assert (content, _calls(calls)) == (
        "<tool_call>{bad}</tool_call>",
        [_calls(PARSER.extract(WEATHER)[1])[0]],
    )
    assert PARSER.extract(reply) == (reply, [])


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
