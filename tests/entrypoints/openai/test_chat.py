"""``/v1/chat/completions`` through the official client."""

import asyncio

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL
from tests.entrypoints.openai.utils import API_KEY, RemoteOpenAIServer

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Load a JSON file."},
]


@pytest.fixture(scope="module")
def client(server: RemoteOpenAIServer) -> openai.OpenAI:
    return server.client()


def test_chat_reply_and_usage(client, server):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content is not None
    tokens = httpx.post(server.url_for("tokenize"), json={"messages": MESSAGES})
    assert out.usage.prompt_tokens == tokens.json()["count"]
    assert 1 <= out.usage.completion_tokens <= 6
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 6


def test_a_stop_string_is_the_stop_reason(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    stop = text[len(text) // 2 :][:2]
    assert stop and full.choices[0].model_extra["stop_reason"] is None
    cut = client.chat.completions.create(**kwargs, stop=stop)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_content_parts_read_as_joined_text(client):
    parts = [
        {"type": "text", "text": "Load a JSON"},
        {"type": "text", "text": "file."},
    ]
    joined = [{"role": "user", "content": "Load a JSON\nfile."}]
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0)
    by_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **kwargs
    )
    by_text = client.chat.completions.create(messages=joined, **kwargs)
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content
    assert by_parts.usage == by_text.usage


def test_template_options_shape_the_prompt(client, server):
    def tokenize(**body) -> dict:
        r = httpx.post(server.url_for("tokenize"), json={"messages": MESSAGES, **body})
        return r.json()

    def text(tokens: list[int]) -> str:
        r = httpx.post(server.url_for("detokenize"), json={"tokens": tokens})
        return r.json()["prompt"]

    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain, off = tokenize(), tokenize(**thinking_off)
    assert text(off["tokens"]) == text(plain["tokens"]) + "<think>\n\n</think>\n\n"
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=thinking_off
    )
    assert reply.usage.prompt_tokens == off["count"]
    partial = [*MESSAGES, {"role": "assistant", "content": "import json\nwith"}]
    opened = tokenize(
        messages=partial, add_generation_prompt=False, continue_final_message=True
    )
    assert text(opened["tokens"]).endswith("assistant\nimport json\nwith")
    for body, param in (
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ):
        r = httpx.post(
            server.url_for("v1", "chat/completions"),
            json={"model": MODEL, "messages": partial, "max_tokens": 2, **body},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("top_logprobs", [None, 2])
def test_streamed_reply_is_the_non_streamed_reply(client, top_logprobs):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 10
    if top_logprobs is not None:
        streamed = [
            entry
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for entry in c.choices[0].logprobs.content
        ]
        assert streamed == whole.choices[0].logprobs.content


def test_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy: the best


def test_n_streamed_choices(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, n=2, seed=1, stream=True
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert roles == [0, 1] and sorted(finished) == [0, 1]


def test_async_client_stream(server):
    async def run() -> str:
        client = server.async_client()
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return text

    text = asyncio.run(run())
    whole = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].message.content
