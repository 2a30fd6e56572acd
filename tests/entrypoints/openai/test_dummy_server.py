"""A second server, set up as the H200 serving benchmark runs: dummy
weights and a checkpoint without tokenizer files, so it serves token ids
only; its sampling defaults come from a generation_config.json in another
directory (``--generation-config DIR``). The benchmark client runs against
it; its last test ends it with SIGTERM while requests are in flight."""

import asyncio
import json
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from benchmarks import benchmark_serving
from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.openai.utils import API_KEY, RemoteOpenAIServer, parse_metrics
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_STREAMS = 4
# Requests long enough to be in flight when SIGTERM lands (GPU steps are
# fast)
IN_FLIGHT_TOKENS = 400 if torch.cuda.is_available() else 150


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteOpenAIServer]:
    path = tmp_path_factory.mktemp("tiny_qwen3_moe_no_tokenizer")
    build_tiny_checkpoint(path, with_tokenizer=False)
    log = path / "server.log"
    generation = tmp_path_factory.mktemp("generation_config")
    (generation / "generation_config.json").write_text(json.dumps({"temperature": 0}))
    # uvicorn at info: the log shows the graceful drain
    args = [*SERVER_ARGS, "--load-format", "dummy", "--uvicorn-log-level", "info"]
    args += ["--generation-config", str(generation)]
    with RemoteOpenAIServer(path, args, log) as remote:
        yield remote


def test_token_ids_stream_one_event_per_token(server):
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=5,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert [c.choices[0].text for c in chunks] == [""] * 5
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 5 and all(t.startswith("token_id:") for t in tokens)


def test_unset_knobs_take_the_generation_config(server):
    """temperature 0 from the file: requests that set none are greedy
    whatever their seed; those that set one sample."""

    def tokens(**body) -> list[str]:
        completion = server.client().completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=8, logprobs=0, **body
        )
        return completion.choices[0].logprobs.tokens

    greedy = tokens(extra_body={"ignore_eos": True, "temperature": 0})
    assert tokens(seed=1, extra_body={"ignore_eos": True}) == greedy
    assert tokens(seed=2, extra_body={"ignore_eos": True}) == greedy
    sampled = [
        tokens(seed=s, temperature=1.0, extra_body={"ignore_eos": True}) for s in (1, 2)
    ]
    assert sampled[0] != sampled[1]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("v1/completions", {"model": MODEL, "prompt": "text"}, "prompt"),
        ("v1/completions", {"model": MODEL, "prompt": [1], "stop": "x"}, "stop"),
        (
            "v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            "messages",
        ),
        ("tokenize", {"prompt": "text"}, "prompt"),
        ("detokenize", {"tokens": [1, 2]}, "tokens"),
    ],
)
def test_text_needs_a_tokenizer(server, path, body, param):
    r = httpx.post(server.url_for(path), json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "no tokenizer" in r.json()["error"]["message"]


def test_benchmark_client_runs_and_reports(server, tmp_path, capsys):
    out = tmp_path / "serving.json"
    summary = benchmark_serving.main(
        [
            "--base-url", server.base_url,
            "--api-key", API_KEY,
            "--num-prompts", "8",
            "--input-len", "12",
            "--range-ratio", "0.5",
            "--output-len", "4",
            "--request-rate", "100",
            "--max-concurrency", "3",
            "--result-json", str(out),
            "--disable-tqdm",
        ]
    )  # fmt: skip
    assert summary.num_requests == 8 and summary.num_failed == 0
    assert summary.output_throughput > 0 and summary.tpot_ms["p99"] > 0
    table = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in table and "P99 ITL (ms)" in table
    saved = json.loads(out.read_text())
    requests = saved["requests"]
    assert [r["output_len"] for r in requests] == [4] * 8
    assert all(len(r["itl_s"]) == 3 for r in requests)  # an event per token
    assert all(6 <= r["prompt_len"] <= 18 for r in requests)


async def streamed(client: openai.AsyncOpenAI, max_tokens: int) -> int:
    stream = await client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def whole(client: openai.AsyncOpenAI, max_tokens: int) -> int:
    out = await client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None
    return out.usage.completion_tokens


def test_sigterm_finishes_requests_in_flight_and_exits_0(server):
    async def run() -> list[int]:
        client = server.async_client()
        lengths = [IN_FLIGHT_TOKENS + i for i in range(NUM_STREAMS + 1)]
        tasks = [
            asyncio.create_task(streamed(client, n)) for n in lengths[:NUM_STREAMS]
        ]
        tasks.append(asyncio.create_task(whole(client, lengths[-1])))
        async with httpx.AsyncClient() as http:  # until all of them run
            while True:
                metrics = parse_metrics(
                    (await http.get(server.url_for("metrics"))).text
                )
                if metrics["vllm:num_requests_running"] == NUM_STREAMS + 1:
                    break
                await asyncio.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        # Soon no longer accepting: refused, or (a connection accepted as the
        # listener closes) closed without a response or reset.
        refused = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
        with pytest.raises(refused):
            async with httpx.AsyncClient() as fresh:
                for _ in range(100):
                    await fresh.get(server.url_for("health"))
                    await asyncio.sleep(0.01)
        tokens = await asyncio.gather(*tasks)
        await client.close()
        return list(tokens)

    expected = [IN_FLIGHT_TOKENS + i for i in range(NUM_STREAMS + 1)]
    assert asyncio.run(run()) == expected
    assert server.proc.wait(60) == 0
    log = server.log.read_text()
    assert "Waiting for connections to close" in log
    assert "Application shutdown complete" in log
