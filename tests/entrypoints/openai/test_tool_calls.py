"""Tools through the official client: ``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes`` renders them with the chat template, takes a
conversation that carries earlier calls and their results, answers a reply
that calls nothing as plain content, and one that calls as ``tool_calls``,
streamed or not. The tiny model's random reply calls no tool, so a second
checkpoint's tokenizer holds a whole call as one added token, which a
``logit_bias`` makes the reply. ``tool_choice`` "required" or a named
function holds any reply to JSON calls (no parser needed). The choices the
server cannot honour are 400s naming ``tool_choice``."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import API_KEY, RemoteOpenAIServer
from vllm.model_executor.model_loader.tiny_checkpoint import (
    TINY_CONFIG,
    build_tiny_checkpoint,
    train_tokenizer,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def calling_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RemoteOpenAIServer, int]]:
    """A server whose tokenizer's last id is the whole of ``CALL``; with
    that id."""
    path = tmp_path_factory.mktemp("calling_model")
    build_tiny_checkpoint(path, with_tokenizer=False)
    tokenizer = train_tokenizer(TINY_CONFIG["vocab_size"] - 1)
    tokenizer.add_tokens([CALL])
    call_id = tokenizer.convert_tokens_to_ids(CALL)
    assert call_id == TINY_CONFIG["vocab_size"] - 1
    tokenizer.save_pretrained(path)
    with RemoteOpenAIServer(path, [*SERVER_ARGS, *TOOL_ARGS], path / "log") as remote:
        yield remote, call_id


@pytest.fixture(scope="module")
def tool_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteOpenAIServer]:
    log = tmp_path_factory.mktemp("tool_server") / "server.log"
    with RemoteOpenAIServer(tiny_model, [*SERVER_ARGS, *TOOL_ARGS], log) as remote:
        yield remote


def _prompt(server: RemoteOpenAIServer, **body: object) -> str:
    tokens = httpx.post(server.url_for("tokenize"), json=body).json()["tokens"]
    return httpx.post(server.url_for("detokenize"), json={"tokens": tokens}).json()[
        "prompt"
    ]


def test_tools_and_earlier_calls_reach_the_template(tool_server):
    listed = _prompt(tool_server, messages=ASK, tools=TOOLS)
    assert "<tools>" in listed and '"name": "get_weather"' in listed
    assert "<tools>" not in _prompt(tool_server, messages=ASK)
    answered = _prompt(tool_server, messages=ANSWERED, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in answered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in answered


@pytest.mark.parametrize("messages", [ASK, ANSWERED], ids=["ask", "answered"])
def test_a_reply_that_calls_nothing_is_content(tool_server, messages):
    client = tool_server.client()
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    prompt = httpx.post(
        tool_server.url_for("tokenize"), json={"messages": messages, "tools": TOOLS}
    ).json()["tokens"]
    plain = client.completions.create(prompt=prompt, **kwargs).choices[0]
    assert "<tool_call>" not in plain.text
    chat = client.chat.completions.create(messages=messages, tools=TOOLS, **kwargs)
    reply = chat.choices[0]
    assert (reply.message.content, reply.message.tool_calls) == (plain.text, [])
    assert reply.finish_reason == plain.finish_reason
    content = ""
    calls: list[object] = []
    reasons: list[str | None] = []
    for chunk in client.chat.completions.create(
        messages=messages, tools=TOOLS, stream=True, **kwargs
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert (content, calls, reasons[-1]) == (plain.text, [], plain.finish_reason)


def _status(server: RemoteOpenAIServer, **body: object) -> tuple[int, str | None]:
    r = httpx.post(
        server.url_for("v1", "chat/completions"),
        json={"model": MODEL, "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    return r.status_code, r.json()["error"]["param"] if r.status_code != 200 else None


def test_choices_it_cannot_honour_are_named(tool_server, server):
    unknown = {"type": "function", "function": {"name": "get_time"}}
    for body in (
        {"messages": ASK, "tools": TOOLS, "tool_choice": unknown},
        {"messages": ASK, "tool_choice": "required"},  # no tools to call
        {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        {"messages": ASK, "tool_choice": "auto"},  # no tools to call
        {"messages": ASK, "tools": TOOLS, "tool_choice": "bogus"},
        {"messages": ASK, "tools": TOOLS, "tool_choice": {}},
    ):
        assert _status(tool_server, **body) == (400, "tool_choice")
    function = {"name": "get_weather", "arguments": "{oops"}
    call = {"id": "c", "type": "function", "function": function}
    broken = {"role": "assistant", "content": "", "tool_calls": [call]}
    assert _status(tool_server, messages=[*ASK, broken]) == (400, "messages")
    # a forced call's grammar is the tools' schemas: a bad one is the tools'
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        assert _status(tool_server, messages=ASK, tools=bad, tool_choice=choice) == (
            400,
            "tools",
        )
    for depth in (600, 100_000):  # too deep to copy for the template, to parse
        function["arguments"] = "[" * depth + "]" * depth
        assert _status(tool_server, messages=[*ASK, broken]) == (400, "messages")
    # without --enable-auto-tool-choice: "auto" (the default with tools) is
    # refused, as vLLM does; "none" renders the tools and parses nothing
    assert _status(server, messages=ASK, tools=TOOLS) == (400, "tool_choice")
    assert _status(server, messages=ASK, tools=TOOLS, tool_choice="none") == (200, None)


def _calling(call_id: int, **extra: object) -> dict[str, Any]:
    """A chat request with tools whose reply is the call, token after token."""
    return dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        logit_bias={str(call_id): 100},
        **extra,
    )


def test_a_reply_that_calls_comes_back_as_tool_calls(calling_server):
    server, call_id = calling_server
    client = server.client()
    kwargs = _calling(call_id, max_tokens=1, n=2)
    reply = client.chat.completions.create(**kwargs)
    for choice in reply.choices:
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
        [call] = choice.message.tool_calls
        assert (call.type, call.function.name) == ("function", "get_weather")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert len({c.message.tool_calls[0].id for c in reply.choices}) == 2
    deltas: dict[int, list[ChoiceDeltaToolCall]] = {0: [], 1: []}
    reasons: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            deltas[choice.index] += choice.delta.tool_calls or []
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for calls in deltas.values():
        [delta] = calls  # the whole call in one delta
        function = delta.function
        assert function is not None and function.arguments is not None
        assert (delta.index, delta.type, function.name) == (
            0,
            "function",
            "get_weather",
        )
        assert json.loads(function.arguments) == {"city": "Paris"}
    # sent back with the tool's result, the call is the conversation's
    message = reply.choices[0].message
    result = {
        "role": "tool",
        "tool_call_id": message.tool_calls[0].id,
        "content": "21 C",
    }
    turn = client.chat.completions.create(
        **(kwargs | {"messages": [*ASK, message.model_dump(), result], "n": 1})
    )
    assert turn.choices[0].message.tool_calls
    # with tool_choice "none" the same reply is content
    plain = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert (plain.message.content, plain.message.tool_calls) == (CALL, [])
    assert plain.finish_reason == "length"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first(calling_server, parallel):
    server, call_id = calling_server
    client = server.client()
    # max_tokens 2: the call twice
    kwargs = _calling(call_id, max_tokens=2, parallel_tool_calls=parallel)
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert len(message.tool_calls or []) == (2 if parallel else 1)
    streamed = [
        call.index
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    assert streamed == ([0, 1] if parallel else [0])


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"enum": ["C", "F"]},
                    "round": {"type": "boolean"},
                },
                "required": ["unit", "round"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_choices_call_tools_without_a_parser(server, stream):
    """The tiny model's reply is random: only the grammar makes it calls."""
    pytest.importorskip("xgrammar")  # structured outputs' (the GPU image's lack)
    client = server.client()
    named = {"type": "function", "function": {"name": "convert"}}
    close = train_tokenizer(TINY_CONFIG["vocab_size"]).convert_tokens_to_ids("}")
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK, tools=FORCED_TOOLS, max_tokens=120, seed=4,
        # a random model's keys and strings need not end: "}" closes objects
        logit_bias={str(close): 20},
    )  # fmt: skip
    for choice, finish in ((named, "stop"), ("required", "tool_calls")):
        out = client.chat.completions.create(
            **kwargs, tool_choice=choice, n=2, stream=stream
        )
        if stream:
            replies = _gather(out, 2)
        else:
            replies = [
                (c.message.tool_calls, c.message.content, c.finish_reason)
                for c in out.choices
            ]
        for calls, content, finish_reason in replies:
            assert content is None and calls and finish_reason == finish, replies
            for call in calls:
                arguments = json.loads(call.function.arguments)
                assert isinstance(arguments, dict)
                if choice == named or call.function.name == "convert":
                    assert call.function.name == "convert"
                    assert arguments["unit"] in ("C", "F")
                    assert isinstance(arguments["round"], bool)
                else:
                    assert call.function.name == "now"


def _gather(chunks, n):
    """Each streamed choice's calls, content and finish reason."""
    calls: list[list] = [[] for _ in range(n)]
    content: list[str | None] = [None] * n
    finish: list[str | None] = [None] * n
    for chunk in chunks:
        for c in chunk.choices:
            calls[c.index] += c.delta.tool_calls or []
            if c.delta.content:
                content[c.index] = (content[c.index] or "") + c.delta.content
            finish[c.index] = c.finish_reason or finish[c.index]
    return list(zip(calls, content, finish, strict=True))
