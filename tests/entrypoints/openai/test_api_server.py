"""What users rely on besides the happy path: the API key, bad requests
answered with a 400 naming the field without disturbing anyone, 32
concurrent streams, and a vanished client's KV blocks freed."""

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL
from tests.entrypoints.openai.utils import API_KEY, RemoteOpenAIServer, parse_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


def test_api_key_guards_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(server.url_for("v1", "models"), headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(server.url_for("v1", "completions"), json=body).status_code == 401
    for path in ("health", "metrics"):
        assert httpx.get(server.url_for(path)).status_code == 200
    assert httpx.get(server.url_for("v1", "models"), headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url_for("v1"), api_key="wrong").models.list()


TOO_LONG = "x " * MAX_MODEL_LEN
BAD_REQUESTS = [
    # (route, body, status, param)
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": "nope", "messages": CHAT}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "prompt"),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN},
        400,
        "prompt",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        "messages",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": -3},
        400,
        "max_tokens",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": "5"},
        400,
        "max_tokens",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "temperature": -1},
        400,
        "temperature",
    ),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "frequency_penalty": 2.5},
        400,
        "frequency_penalty",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "presence_penalty": "high"},
        400,
        "presence_penalty",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "min_tokens": 2, "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}},
        400,
        "logit_bias",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"\u00b2": 1}},
        400,
        "logit_bias",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}},
        400,
        "logit_bias",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "logit_bias": {"100000": 1}},
        400,
        "logit_bias",
    ),
    ("completions", {"model": MODEL, "prompt": {"text": "x"}}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [5, 100000]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop"),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("completions", {"prompt": "x"}, 400, "model"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "chat/completions",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                }
            ],
        },
        400,
        "messages",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    # JSON may carry lone surrogates (no Unicode text) and digits past int()'s
    ("completions", {"model": MODEL, "prompt": ["ok", "\udfff"]}, 400, "prompt"),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]},
        400,
        "messages",
    ),
    ("completions", {"model": "\ud800", "prompt": "x"}, 404, "model"),
    (
        "completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"9" * 4301: 1}},
        400,
        "logit_bias",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": CHAT, "chat_template_kwargs": {"self": 1}},
        400,
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_names_its_field(server, route, body, status, param):
    r = httpx.post(
        server.url_for("v1", route),
        content=json.dumps(body),  # ASCII: lone surrogates escaped
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"


def test_an_unknown_structured_outputs_field_is_named(server):
    body = {"model": MODEL, "prompt": "x", "structured_outputs": {"regexx": "a"}}
    r = httpx.post(
        server.url_for("v1", "completions"),
        content=json.dumps(body),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("structured_outputs: expected fields of [")
    assert message.endswith("got ['regexx']") and "'regex'" in message


def test_malformed_json_is_a_400(server):
    r = httpx.post(
        server.url_for("v1", "completions"),
        content=b'{"model": "tiny", "prompt": ',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert "malformed JSON" in r.json()["error"]["message"]
    # FastAPI's own refusals, in OpenAI's shape too
    for method, path, content, status in (
        ("POST", "v1/completions", b'{"prompt": "\xff\xfe"}', 400),  # not UTF-8
        ("POST", "v1/nope", b"{}", 404),
        ("GET", "v1/completions", b"", 405),
    ):
        r = httpx.request(
            method,
            server.url_for(*path.split("/")),
            content=content,
            headers={**AUTH, "Content-Type": "application/json"},
        )
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}


def test_the_client_sees_openai_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)


def test_bad_requests_do_not_disturb_a_stream_in_flight(server):
    async def run() -> int:
        client = server.async_client()
        stream = await client.completions.create(
            model=MODEL,
            prompt="import json\n",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async with httpx.AsyncClient(headers=AUTH) as http:
            bad = [
                http.post(
                    server.url_for("v1", route),
                    content=json.dumps(body),
                    headers={"Content-Type": "application/json"},
                )
                for route, body, _, _ in BAD_REQUESTS
            ]
            statuses = [r.status_code for r in await asyncio.gather(*bad)]
        assert all(s in (400, 404) for s in statuses)
        usage = [c.usage async for c in stream if c.usage]
        await client.close()
        return usage[0].completion_tokens

    assert asyncio.run(run()) == 24


def test_32_concurrent_streams_get_their_tokens(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"value_{i} = ",
            max_tokens=3 + i % 5,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens, reason = 0, ""
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            elif chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return i, tokens, reason

    async def run() -> list[tuple[int, int, str]]:
        client = server.async_client()
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
        await client.close()
        return results

    for i, tokens, reason in asyncio.run(run()):
        assert (tokens, reason) == (3 + i % 5, "length")


async def wait_for(
    http: httpx.AsyncClient,
    server: RemoteOpenAIServer,
    check: Callable[[dict[str, float]], bool],
    timeout: float = 30.0,
) -> dict[str, float]:
    """The first ``/metrics`` that passes ``check`` (the last one on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = parse_metrics((await http.get(server.url_for("metrics"))).text)
        if check(metrics) or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.05)


def idle(metrics: dict[str, float]) -> bool:
    return (
        metrics["vllm:num_requests_running"] == 0
        and metrics["vllm:num_requests_waiting"] == 0
        and metrics["vllm:kv_cache_usage_perc"] == 0
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(server, stream):
    body = {
        "model": MODEL,
        "prompt": "import json\n",
        "max_tokens": MAX_MODEL_LEN - 32,  # seconds of steps: outlives the client
        "ignore_eos": True,
        "stream": stream,
    }
    url = server.url_for("v1", "completions")

    async def client(http: httpx.AsyncClient) -> None:
        if stream:
            async with http.stream("POST", url, json=body) as r:
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                await asyncio.Event().wait()  # reads no more, until cancelled
        else:
            await http.post(url, json=body)

    async def run() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        async with httpx.AsyncClient(headers=AUTH, timeout=None) as http:
            before = await wait_for(http, server, idle)
            request = asyncio.create_task(client(http))
            busy = await wait_for(
                http, server, lambda m: m["vllm:num_requests_running"] == 1
            )
            request.cancel()  # the client goes: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await request
            aborted = before["vllm:request_success_total/abort"]
            after = await wait_for(
                http,
                server,
                lambda m: m["vllm:request_success_total/abort"] > aborted and idle(m),
            )
            return before, busy, after

    before, busy, after = asyncio.run(run())
    assert busy["vllm:kv_cache_usage_perc"] > 0 and not request_done(busy, before)
    aborted = before["vllm:request_success_total/abort"]
    assert after["vllm:request_success_total/abort"] == aborted + 1
    assert idle(after) and not request_done(after, before)


def request_done(now: dict[str, float], before: dict[str, float]) -> bool:
    """Whether a request finished on its own (not aborted) since ``before``."""
    return any(
        now[f"vllm:request_success_total/{r}"]
        > before[f"vllm:request_success_total/{r}"]
        for r in ("stop", "length")
    )


def test_min_tokens_and_include_stop_str_in_output_with_a_stop_string(server):
    client = server.client()

    def complete(**extra) -> str:
        body = {"ignore_eos": True, **extra}
        completion = client.completions.create(
            model=MODEL, prompt="x", max_tokens=8, temperature=0, extra_body=body
        )
        return completion.choices[0].text

    text = complete()
    stop = text.lstrip()[:2]
    assert len(stop) == 2 and complete(stop=[stop]) != text
    assert complete(stop=[stop], min_tokens=8) == text
    cut = complete(stop=[stop])
    kept = complete(stop=[stop], include_stop_str_in_output=True)
    assert kept == cut + stop and text.startswith(kept)


def test_a_repeated_prompt_hits_the_prefix_cache_and_gets_the_same_text(server):
    client = server.client()
    prompt = "def fibonacci(n):\n    " * 12  # several blocks of 16 tokens
    before = server.metrics()
    completions = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0
        )
        for _ in range(2)
    ]
    after = server.metrics()
    assert completions[0].choices[0].text == completions[1].choices[0].text
    queried = after["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"]
    assert queried - before["vllm:prefix_cache_queries_total"] >= 2 * 32
    # the second request found the first's whole blocks (one may be the last)
    assert hits - before["vllm:prefix_cache_hits_total"] >= 32
    assert hits <= queried


def test_metrics_have_vllm_names(server):
    server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    metrics = server.metrics()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in metrics
    assert metrics["vllm:generation_tokens_total"] >= 2
    assert metrics["vllm:e2e_request_latency_seconds_count"] >= 1


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url_for("tokenize"), json={"prompt": "import json"})
    body = r.json()
    assert (
        body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    )
    back = httpx.post(server.url_for("detokenize"), json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": "import json"}
    chat = httpx.post(server.url_for("tokenize"), json={"messages": CHAT}).json()
    assert chat["count"] > body["count"]  # the template's markers
    for bad, param in (
        ({"prompt": "x", "messages": CHAT}, "prompt"),
        ({"prompt": "x", "model": "nope"}, "model"),
    ):
        r = httpx.post(server.url_for("tokenize"), json=bad)
        assert r.json()["error"]["param"] == param
    r = httpx.post(server.url_for("detokenize"), json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
