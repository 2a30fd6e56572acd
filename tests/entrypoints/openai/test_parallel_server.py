"""``vllm serve`` over two ranks on the CPU (gloo): data parallel
(``-dp 2``, with async scheduling) and tensor parallel (``-tp 2``), both
with ``--enable-expert-parallel``. The official client gets the same greedy
completions, streamed and not, as from the shared one-rank server, and the
server stops cleanly with its ranks."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import RemoteOpenAIServer, needs_two_ranks

PARALLEL = {
    "dp2": ["--data-parallel-size", "2", "--enable-expert-parallel"],
    "tp2": ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
}
PROMPTS = ["The quick brown fox", "1 2 3 4", "Hello"]


@pytest.fixture(scope="module", params=sorted(PARALLEL))
def parallel_server(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RemoteOpenAIServer]:
    # tensor-parallel ranks check each step's tokens: no async scheduling
    args = SERVER_ARGS
    if request.param == "tp2":
        args = [a for a in SERVER_ARGS if a != "--async-scheduling"]
    log = tmp_path_factory.mktemp(f"server_{request.param}") / "server.log"
    with RemoteOpenAIServer(tiny_model, [*args, *PARALLEL[request.param]], log) as s:
        yield s


def _greedy(server: RemoteOpenAIServer, stream: bool) -> list[str]:
    client, texts = server.client(), []
    for prompt in PROMPTS:
        if stream:
            chunks = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            texts.append("".join(c.choices[0].text for c in chunks))
        else:
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0
            )
            texts.append(out.choices[0].text)
    return texts


@needs_two_ranks
def test_two_ranks_complete_as_one(parallel_server, server):
    expected = _greedy(server, stream=False)
    assert _greedy(parallel_server, stream=False) == expected
    assert _greedy(parallel_server, stream=True) == expected
    metrics = parallel_server.metrics()
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0  # every rank's blocks free
    assert parallel_server.stop() == 0  # SIGTERM: the ranks stop with it
