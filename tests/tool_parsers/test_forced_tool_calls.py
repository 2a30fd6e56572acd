import json

from vllm.tool_parsers.forced_tool_calls import ANY_OBJECT, ForcedToolCalls

UNIT = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}}
TOOLS = {"convert": UNIT, "now": None}


def test_a_named_function_is_its_arguments():
    forced = ForcedToolCalls(TOOLS, "convert")
    spec = forced.structured_outputs
    assert spec.json == UNIT and spec.disable_any_whitespace
    assert ForcedToolCalls(TOOLS, "now").structured_outputs.json == ANY_OBJECT
    content, (call,) = forced.extract('{"unit": "C"}')
    assert content is None and call.name == "convert"
    assert json.loads(call.arguments) == {"unit": "C"}
    # cut off by max_tokens: the text comes back as content, nothing called
    assert forced.extract('{"unit": "') == ('{"unit": "', [])


def test_required_is_an_array_of_named_calls():
    forced = ForcedToolCalls(TOOLS, None)
    array = forced.structured_outputs.json
    assert isinstance(array, dict) and array["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in array["items"]["anyOf"]]
    assert names == [["convert"], ["now"]]
    params = [c["properties"]["parameters"] for c in array["items"]["anyOf"]]
    assert params == [UNIT, ANY_OBJECT]
    reply = json.dumps(
        [
            {"name": "now", "parameters": {}},
            {"name": "convert", "parameters": {"unit": "F"}},
        ]
    )
    content, calls = forced.extract(reply)
    assert content is None and [c.name for c in calls] == ["now", "convert"]
    assert [json.loads(c.arguments) for c in calls] == [{}, {"unit": "F"}]
    assert len({c.id for c in calls}) == 2
    # non-ASCII arguments as written, both ways (as the hermes parser's)
    for parser, reply in (
        (forced, '[{"name": "convert", "parameters": {"unit": "°C"}}]'),
        (ForcedToolCalls(TOOLS, "convert"), '{"unit": "°C"}'),
    ):
        _, (call,) = parser.extract(reply)
        assert call.arguments == '{"unit": "°C"}'


def test_a_stream_sends_every_call_at_the_end():
    stream = ForcedToolCalls(TOOLS, None).stream()
    reply = '[{"name": "now", "parameters": {}}]'
    assert [stream.feed(piece, False) for piece in reply] == [("", [])] * len(reply)
    content, (call,) = stream.feed("", True)
    assert content == "" and call.name == "now" and stream.calls == 1
    cut = ForcedToolCalls(TOOLS, "convert").stream()
    assert cut.feed('{"un', False) == ("", [])
    assert cut.feed("", True) == ('{"un', []) and cut.calls == 0
