"""The engine in a process of its own (``MPClient``) behind ``AsyncLLM``:
the same tokens as the in-process engine, startup errors, a dead engine
process, and an engine that outlives neither its server nor a Ctrl-C to the
process group. Tiny checkpoint, fp32, CPU."""

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core_client import (
    Added,
    AddRequests,
    Dead,
    EngineCoreLoop,
    EngineCoreOutputs,
    Event,
    Inbox,
    MPClient,
    limit_cpu_threads,
    serve_engine,
)
from vllm.v1.request import Request
from vllm.v1.worker.workspace import reset_workspace_manager

MAX_MODEL_LEN = 96
PROMPTS = [[1, 2, 3], [7] * 20, [5, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3_moe_mp")
    build_tiny_checkpoint(path)
    return path


def config(checkpoint: Path, **kw) -> EngineConfig:
    return EngineConfig(
        checkpoint, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, **kw
    )


async def generate(engine: AsyncLLM, prompts, params) -> list[tuple[list, list]]:
    stream = await engine.add_requests(prompts, [params] * len(prompts))
    out: list[tuple[list, list]] = [([], []) for _ in prompts]
    async for index, delta in stream:
        out[index][0].extend(delta.outputs[0].token_ids)
        out[index][1].extend(delta.outputs[0].logprobs or [])
    return out


def test_tokens_equal_the_in_process_engine(checkpoint):
    reset_workspace_manager()
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    want = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in llm.generate(PROMPTS, GREEDY)
    ]
    del llm
    reset_workspace_manager()

    async def run() -> list[tuple[list, list]]:
        engine = AsyncLLM(MPClient(config(checkpoint)), None)
        engine.start()
        try:
            assert engine.max_model_len == MAX_MODEL_LEN
            got = await generate(engine, PROMPTS, GREEDY)
            with pytest.raises(ValueError, match="prompt: 96 tokens"):
                await generate(engine, [[1] * MAX_MODEL_LEN], GREEDY)
            return got
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == [tuple(w) for w in want]


def test_a_refused_setting_reaches_the_caller_as_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"model: expected a .* with config.json"):
        MPClient(config(tmp_path))  # no config.json: vllm serve's usage error


def test_a_killed_engine_fails_the_streams_and_ignores_ctrl_c(checkpoint):
    async def run() -> None:
        client = MPClient(config(checkpoint))
        engine = AsyncLLM(client, None)
        engine.start()
        long = SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)
        stream = await engine.add_requests([[1, 2, 3]], [long])
        await anext(stream)
        assert client.process.pid is not None
        os.kill(client.process.pid, signal.SIGINT)  # a Ctrl-C to the group
        await asyncio.sleep(0.5)
        assert client.process.exitcode is None
        await anext(stream)  # still serving
        # A request in flight when the engine dies (the first one may have
        # finished by now on a fast CPU): its stream must fail, not hang.
        in_flight = await engine.add_requests([[4, 5, 6]], [long])
        client.process.kill()
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            async for _ in in_flight:
                pass
        assert engine.dead
        with pytest.raises(EngineDeadError):
            await engine.add_requests([[1]], [long])
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_the_engine_stops_when_its_server_goes(checkpoint):
    client = MPClient(config(checkpoint))
    client._conn.close()  # as a dead server's end of the pipe
    client.process.join(timeout=60)
    assert client.process.exitcode == 0


def test_a_gpu_engine_process_keeps_one_cpu_thread(monkeypatch, tmp_path):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        limit_cpu_threads(config(tmp_path))  # a CPU engine computes on them
        assert torch.get_num_threads() == 2
        limit_cpu_threads(dataclasses.replace(config(tmp_path), device="cuda"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
        limit_cpu_threads(dataclasses.replace(config(tmp_path), device="cuda"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_failing_event_handler_ends_the_loop_with_dead(checkpoint):
    """Not only a step: whatever raises in the loop (here the frontend's
    handler of the first outputs) reports Dead instead of leaving callers
    waiting on a loop that is gone."""
    reset_workspace_manager()
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    events: list[Event] = []

    def emit(event: Event) -> None:
        events.append(event)
        if isinstance(event, EngineCoreOutputs):
            raise RuntimeError("handler bug")

    inbox = Inbox()
    inbox.put(AddRequests(0, [Request("r", [1, 2, 3], GREEDY)]))
    serve_engine(EngineCoreLoop(llm.engine), inbox, emit)  # returns
    assert isinstance(events[0], Added) and events[0].error is None
    assert isinstance(events[-1], Dead) and "handler bug" in events[-1].error
    reset_workspace_manager()


def test_an_unstopped_client_does_not_hang_the_exit(checkpoint, tmp_path):
    """A script that builds the engine process and exits without shutting it
    down (or dies of an exception) still exits: the pipe closes first."""
    script = tmp_path / "leave.py"
    script.write_text(
        "from vllm.v1.engine.config import EngineConfig\n"
        "from vllm.v1.engine.core_client import MPClient\n"
        "if __name__ == '__main__':  # spawn re-imports the script\n"
        f"    client = MPClient(EngineConfig({str(checkpoint)!r}, dtype='float32', "
        f"device='cpu', max_model_len={MAX_MODEL_LEN}))\n"
        "    raise SystemExit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, timeout=120)
    assert done.returncode == 3
