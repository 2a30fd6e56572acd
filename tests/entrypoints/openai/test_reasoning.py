"""``vllm serve --reasoning-parser qwen3`` through the official client. The
tiny model's random replies never open with ``<think>``: they must come
back whole as content, streamed alike (the split itself, tags over several
tokens included, is tested in ``tests/reasoning``)."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import RemoteOpenAIServer

MESSAGES = [{"role": "user", "content": "Load a JSON file."}]


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteOpenAIServer]:
    log = tmp_path_factory.mktemp("reasoning_server") / "server.log"
    args = [*SERVER_ARGS, "--reasoning-parser", "qwen3"]
    with RemoteOpenAIServer(tiny_model, args, log) as remote:
        yield remote


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_a_reply_without_thinking_is_all_content(server, include_reasoning):
    client = server.client()
    prompt = httpx.post(server.url_for("tokenize"), json={"messages": MESSAGES})
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0)
    plain = client.completions.create(prompt=prompt.json()["tokens"], **kwargs)
    text = plain.choices[0].text
    assert text and not text.startswith("<think>")
    extra = {"include_reasoning": include_reasoning}
    reply = client.chat.completions.create(
        messages=MESSAGES, extra_body=extra, **kwargs
    )
    message = reply.choices[0].message
    assert message.content == text
    assert getattr(message, "reasoning_content", None) is None
    content = reasoning = ""
    for chunk in client.chat.completions.create(
        messages=MESSAGES, stream=True, extra_body=extra, **kwargs
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
    assert (content, reasoning) == (text, "")
