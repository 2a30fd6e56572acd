"""``vllm serve --reasoning-parser qwen3`` through the official client, with
a chat template that opens ``<think>`` at the end of the prompt, as Qwen3's
thinking-only models do, unless ``enable_thinking`` is false (then it
closes an empty one, as Qwen3's hybrid template does). The tiny model's
random reply never writes ``</think>``: opened, it is all reasoning;
closed, all content; streamed alike. The split itself, tags over several
tokens included, is tested in ``tests/reasoning``."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import RemoteOpenAIServer
from vllm.model_executor.model_loader.tiny_checkpoint import CHAT_TEMPLATE

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% endif %}{% endif %}", "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Load a JSON file."}]


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteOpenAIServer]:
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    log = tmp_path_factory.mktemp("reasoning_server") / "server.log"
    args = [
        *SERVER_ARGS,
        "--reasoning-parser", "qwen3",
        "--chat-template", THINKING_TEMPLATE,
    ]  # fmt: skip
    with RemoteOpenAIServer(tiny_model, args, log) as remote:
        yield remote


@pytest.mark.parametrize(
    ("thinking", "include_reasoning"), [(True, True), (True, False), (False, True)]
)
def test_the_reply_splits_alike_streamed_or_not(server, thinking, include_reasoning):
    client = server.client()
    template = {"chat_template_kwargs": {"enable_thinking": thinking}}
    prompt = httpx.post(
        server.url_for("tokenize"), json={"messages": MESSAGES, **template}
    ).json()["tokens"]
    opened = httpx.post(server.url_for("detokenize"), json={"tokens": prompt})
    assert opened.json()["prompt"].endswith("<think>\n") is thinking
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0)
    text = client.completions.create(prompt=prompt, **kwargs).choices[0].text
    assert text and "</think>" not in text and not text.startswith("<think>")
    want = (text if include_reasoning else None, None) if thinking else (None, text)
    extra = {**template, "include_reasoning": include_reasoning}
    message = (
        client.chat.completions.create(messages=MESSAGES, extra_body=extra, **kwargs)
        .choices[0]
        .message
    )
    assert (getattr(message, "reasoning", None), message.content) == want
    reasoning = content = ""
    for chunk in client.chat.completions.create(
        messages=MESSAGES, stream=True, extra_body=extra, **kwargs
    ):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == tuple(part or "" for part in want)
