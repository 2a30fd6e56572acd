"""``AsyncLLM``: one engine loop thread serving asyncio callers, on the tiny
checkpoint with its tokenizer (fp32, CPU)."""

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.outputs import CompletionOutput
from vllm.v1.engine import core_client
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.worker.workspace import reset_workspace_manager

T = TypeVar("T")
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe_async")
    build_tiny_checkpoint(path)
    reset_workspace_manager()
    engine = LLM(path, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    yield engine
    reset_workspace_manager()


def serve(llm: LLM, body: Callable[[AsyncLLM], Awaitable[T]]) -> T:
    """Run ``body`` against an AsyncLLM over ``llm``'s engine, then stop it
    (the blocking ``LLM`` must not step while the loop runs)."""

    async def run() -> T:
        client = InprocClient(llm.engine)
        engine = AsyncLLM(client, llm.tokenizer, PrometheusStatLogger("tiny"))
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


async def drain(stream: RequestStream, num: int) -> list[list[CompletionOutput]]:
    deltas: list[list[CompletionOutput]] = [[] for _ in range(num)]
    async for index, delta in stream:
        assert not deltas[index] or not deltas[index][-1].finish_reason
        deltas[index].append(delta.outputs[0])
        assert delta.finished == (delta.outputs[0].finish_reason is not None)
    return deltas


def ids(llm: LLM, text: str) -> list[int]:
    return list(llm.tokenizer(text)["input_ids"])


def test_deltas_add_up_to_the_blocking_generation(llm):
    prompts = ["def load(fp):", "import json\n"]
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    blocking = llm.generate(prompts, greedy)
    text = blocking[0].outputs[0].text
    assert text
    stop = text[len(text) // 2 :][:2]
    with_stop = SamplingParams(temperature=0, max_tokens=8, stop=[stop])
    (cut,) = llm.generate(prompts[:1], with_stop)

    async def body(engine: AsyncLLM) -> None:
        stream = await engine.add_requests([ids(llm, p) for p in prompts], [greedy] * 2)
        for deltas, want in zip(await drain(stream, 2), blocking, strict=True):
            expected = want.outputs[0]
            assert "".join(d.text or "" for d in deltas) == expected.text
            assert [t for d in deltas for t in d.token_ids] == expected.token_ids
            assert [lp for d in deltas for lp in d.logprobs or []] == expected.logprobs
            assert deltas[-1].finish_reason == "length"
        stream = await engine.add_requests([ids(llm, prompts[0])], [with_stop])
        (deltas,) = await drain(stream, 1)
        assert "".join(d.text or "" for d in deltas) == cut.outputs[0].text
        assert deltas[-1].finish_reason == "stop"

    serve(llm, body)


def test_a_bad_member_refuses_the_whole_group(llm):
    async def body(engine: AsyncLLM) -> None:
        ok, too_long = [1, 2, 3], [5] * MAX_MODEL_LEN
        params = SamplingParams(max_tokens=4)
        with pytest.raises(ValueError, match="prompt: 96 tokens"):
            await engine.add_requests([ok, too_long], [params, params])
        await asyncio.sleep(0)
        assert not llm.engine.has_unfinished_requests()
        stream = await engine.add_requests([ok], [params])
        (deltas,) = await drain(stream, 1)
        assert sum(len(d.token_ids) for d in deltas) >= 1

    serve(llm, body)


def test_abort_and_a_dropped_stream_free_the_blocks(llm):
    pool = llm.engine.pool
    long = SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)

    async def freed() -> None:
        for _ in range(1000):
            if pool.num_free_blocks == pool.num_blocks:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("blocks were not freed")

    async def body(engine: AsyncLLM) -> str:
        stream = await engine.add_requests([[1, 2, 3]], [long])
        await anext(stream)
        assert pool.num_free_blocks < pool.num_blocks
        stream.abort()
        await freed()
        assert [item async for item in stream] == []  # an aborted stream ends
        stream = await engine.add_requests([[4, 5, 6]], [long])
        await anext(stream)
        del stream  # its consumer vanished without a word
        gc.collect()
        await freed()
        assert not llm.engine.has_unfinished_requests()
        assert engine.stat_logger is not None
        return engine.stat_logger.render().decode()

    metrics = serve(llm, body)
    assert 'vllm:request_success_total{finished_reason="abort",' in metrics
    assert 'finished_reason="abort",model_name="tiny"} 2.0' in metrics


def test_shutdown_finishes_requests_then_refuses(llm):
    async def body(engine: AsyncLLM) -> None:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        stream = await engine.add_requests([[1, 2], [3, 4, 5]], [params] * 2)
        stopping = asyncio.create_task(engine.shutdown())
        deltas = await drain(stream, 2)
        await stopping
        assert [sum(len(d.token_ids) for d in ds) for ds in deltas] == [6, 6]
        with pytest.raises(EngineDeadError, match="shutting down"):
            await engine.add_requests([[1]], [params])

    serve(llm, body)


def test_a_failing_step_fails_every_stream(llm, monkeypatch):
    def broken() -> None:
        raise RuntimeError("device lost")

    async def body(engine: AsyncLLM) -> None:
        monkeypatch.setattr(llm.engine, "step", broken)
        stream = await engine.add_requests([[1, 2]], [SamplingParams(max_tokens=3)])
        with pytest.raises(EngineDeadError, match="device lost"):
            await anext(stream)
        assert engine.dead
        with pytest.raises(EngineDeadError):
            await engine.add_requests([[1]], [SamplingParams()])
        for request_id in stream.request_ids:  # the engine itself is fine
            llm.engine.finish_request(request_id)

    serve(llm, body)
    assert not llm.engine.has_unfinished_requests()


def test_a_consumer_that_falls_behind_gets_the_deltas_in_one_batch(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (want,) = llm.generate(["def load(fp):"], greedy)

    async def body(engine: AsyncLLM) -> None:
        stream = await engine.add_requests([ids(llm, "def load(fp):")], [greedy])
        while llm.engine.has_unfinished_requests():  # read nothing meanwhile
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last step's deltas reach the queue
        batches = [batch async for batch in stream.batches()]
        assert len(batches) == 1 and len(batches[0]) > 1
        outputs = [delta.outputs[0] for _, delta in batches[0]]
        assert [t for o in outputs for t in o.token_ids] == want.outputs[0].token_ids
        assert "".join(o.text or "" for o in outputs) == want.outputs[0].text
        assert [o.finish_reason for o in outputs][-1] == "length"

    serve(llm, body)


def test_the_busy_engine_loop_reports_where_its_time_went(llm, monkeypatch, caplog):
    monkeypatch.setattr(core_client, "LOG_INTERVAL_S", 0.0)  # every iteration
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def body(engine: AsyncLLM) -> None:
        (deltas,) = await drain(await engine.add_requests([[1, 2, 3]], [params]), 1)
        assert sum(len(d.token_ids) for d in deltas) == 3

    with caplog.at_level(logging.INFO, logger="vllm"):
        serve(llm, body)
    lines = [r.getMessage() for r in caplog.records if "engine loop:" in r.message]
    assert lines and all("1 steps in" in line for line in lines)
    assert "step " in lines[0] and "events out " in lines[0]
    # the prompt's step, then decode-only ones
    prompt = [x for x in lines if "0 decode-only" in x]
    assert prompt and all("3 tokens/step" in x for x in prompt)
    decode = [x for x in lines if "1 decode-only" in x]
    assert len(decode) >= 2 and all("1 tokens/step" in x for x in decode)
