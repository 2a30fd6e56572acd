"""``--enable-prompt-tokens-details``: usage says how many prompt tokens the
prefix cache held, streamed or not, for completions and chat; without the
flag (the shared server) ``prompt_tokens_details`` is null (as vLLM's)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import RemoteOpenAIServer

# about 60 tokens of the tiny tokenizer: three whole blocks of 16 to share
PROMPT = "def load(fp, *, cls=None, object_hook=None, parse_float=None): " * 3


@pytest.fixture(scope="module")
def details_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteOpenAIServer]:
    log = tmp_path_factory.mktemp("details_server") / "server.log"
    args = [*SERVER_ARGS, "--enable-prompt-tokens-details"]
    with RemoteOpenAIServer(tiny_model, args, log) as remote:
        yield remote


def test_usage_counts_the_cached_prompt_tokens(details_server, server):
    client = details_server.client()
    kwargs = dict(model=MODEL, max_tokens=2, temperature=0)
    first = client.completions.create(prompt=PROMPT, **kwargs).usage
    assert first.prompt_tokens >= 48
    assert first.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(prompt=PROMPT, **kwargs).usage
    cached = again.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.prompt_tokens - 16 <= cached < first.prompt_tokens
    with_usage = dict(stream=True, stream_options={"include_usage": True}, **kwargs)
    streamed = [
        chunk.usage
        for chunk in client.completions.create(prompt=PROMPT, **with_usage)
        if chunk.usage is not None
    ]
    assert [u.prompt_tokens_details.cached_tokens for u in streamed] == [cached]
    messages = [{"role": "user", "content": PROMPT}]
    chat = [client.chat.completions.create(messages=messages, **kwargs).usage]
    chat += [
        chunk.usage
        for chunk in client.chat.completions.create(messages=messages, **with_usage)
        if chunk.usage is not None
    ]
    assert chat[0].prompt_tokens_details.cached_tokens == 0
    assert chat[1].prompt_tokens_details.cached_tokens >= 48
    plain = server.client().completions.create(prompt=PROMPT, **kwargs).usage
    assert plain.prompt_tokens_details is None
