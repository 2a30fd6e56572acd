"""The engine's model runner: its step inputs equal the metadata built from
the block pool, and (GPU) CUDA-graph steps, decode and with prefill, equal
the same steps run eagerly."""

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata
from vllm.v1.core.scheduler import ScheduledChunk
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request
from vllm.v1.worker.gpu_model_runner import GPUModelRunner, query_bound
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    init_workspace_manager,
    reset_workspace_manager,
)

_prefixes = (f"runner_test_{i}." for i in itertools.count())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_runner")
    build_tiny_checkpoint(path, with_tokenizer=False)
    return path


def _engine(checkpoint, **kwargs: Any) -> EngineCore:
    reset_workspace_manager()
    args: dict[str, Any] = {
        "max_model_len": 96,
        "max_num_seqs": 12,
        "num_kv_blocks": 96,  # tests share the GPU: not sized from its memory
        "prefix": next(_prefixes),
        "async_scheduling": False,  # the tests schedule and resolve steps by hand
    }
    return EngineCore(EngineConfig(checkpoint, **args | kwargs))


def _requests(engine: EngineCore, n: int, max_tokens: int) -> list[Request]:
    gen = torch.Generator().manual_seed(n)
    requests = [
        Request(
            f"r{i}",
            torch.randint(0, 320, (5 + 6 * i,), generator=gen).tolist(),
            SamplingParams(temperature=0, max_tokens=max_tokens),
        )
        for i in range(n)
    ]
    for request in requests:
        engine.add_request(request)
    return requests


def test_a_step_reading_its_own_keys_is_not_a_decode_batch():
    """Decode attention (max_query_len 1) stores the step's keys inside its
    own launch: a chunk reading a block the step completes keeps the step
    on the kernels that store first (a bound of 2), whatever its length."""
    one = Request("a", [1, 2, 3], SamplingParams())
    decode = [ScheduledChunk(one, 2, 3, True), ScheduledChunk(one, 5, 6, True)]
    assert query_bound(decode) == 1
    reads = dataclasses.replace(decode[1], reads_step_kv=True)
    assert query_bound([decode[0], reads]) == 2
    longer = ScheduledChunk(one, 0, 3, True, reads_step_kv=True)
    assert query_bound([longer]) == 3


def test_step_inputs_match_the_pool(checkpoint):
    """Chunked prefill continuing a cached prefix beside fresh prompts: the
    persistent buffers hold what the pool-built metadata says."""
    engine = _engine(checkpoint, dtype="float32", device="cpu")
    try:
        requests = _requests(engine, 3, 4)
        engine.step()
        pool, runner = engine.pool, engine.runner
        chunks = [
            ScheduledChunk(requests[0], 2, 5, samples=False),
            ScheduledChunk(requests[2], 0, 17, samples=False),
            ScheduledChunk(requests[1], 10, 11, samples=False),
        ]
        num_tokens = runner._fill_inputs(chunks, pool)
        ref = PagedAttentionMetadata.build(
            pool, [(c.request.request_id, c.start, c.end) for c in chunks], "cpu"
        )
        assert num_tokens == 21
        torch.testing.assert_close(runner.slot_mapping[:21], ref.slot_mapping)
        torch.testing.assert_close(runner.query_start_loc[:4], ref.query_start_loc)
        torch.testing.assert_close(runner.seq_lens[:3], ref.seq_lens)
        width = ref.block_table.shape[1]
        torch.testing.assert_close(runner.block_table[:3, :width], ref.block_table)
        expected = [*range(2, 5), *range(17), 10]
        assert runner.positions[:21].tolist() == expected
    finally:
        reset_workspace_manager()


def test_micro_batches_give_the_steps_logits(checkpoint):
    """Dual-batch overlap's split (fp32, CPU, one process): a decode, a
    recomputed prefix that samples nothing and another decode, cut after the
    first (the tokens' nearest half), run as two micro-batches on two
    threads, give the logits of the step run whole."""
    reset_workspace_manager()
    init_workspace_manager(torch.device("cpu"), num_ubatches=2)
    config = EngineConfig(checkpoint, dtype="float32", device="cpu", max_model_len=96)
    engine = EngineCore(dataclasses.replace(config, prefix=next(_prefixes)))
    try:
        requests = _requests(engine, 3, 4)  # prompts of 5, 11 and 17 tokens
        engine.step()  # the prefills: their keys and values are cached
        chunks = [
            ScheduledChunk(requests[0], 5, 6, samples=True),
            ScheduledChunk(requests[2], 10, 17, samples=False),
            ScheduledChunk(requests[1], 11, 12, samples=True),
        ]
        whole = engine.runner.execute(chunks, engine.pool)
        runner = GPUModelRunner(
            engine.model, engine.device, 16, 12, 64, 96, enforce_eager=True, dbo=True
        )
        current_workspace_manager().unlock()  # ubatch 1's slot is new here
        split = runner.execute(chunks, engine.pool)
        assert split.shape == whole.shape == (2, whole.shape[1])
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
        report = current_workspace_manager().memory_report()
        assert [len(slot.resources) > 0 for slot in report.slots] == [True, True]
    finally:
        reset_workspace_manager()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_decode_equals_eager_decode(checkpoint):
    """bf16 on CUDA: every decode step of 5 requests (replayed at the
    captured size 8, 3 padding rows) gives the logits of the same step run
    eagerly at 5 rows; the manager never grows after the lock."""
    engine = _engine(checkpoint, dtype="bfloat16", device="cuda")
    try:
        runner = engine.runner
        assert sorted(runner.graphs) == [1, 2, 4, 8, 12]
        manager = current_workspace_manager()
        before = manager.memory_report().total_bytes
        requests = _requests(engine, 5, 12)
        engine.step()  # the prefills
        for _ in range(10):
            chunks = engine.scheduler.schedule()
            assert all(c.end - c.start == 1 for c in chunks) and len(chunks) == 5
            with runner.on_stream():
                graphed = runner.execute(chunks, engine.pool).float()
                eager = _run_eagerly(runner, chunks, engine.pool).float()
            torch.testing.assert_close(graphed, eager, atol=3e-2, rtol=3e-2)
            assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.8
            for chunk, token in zip(chunks, graphed.argmax(-1).tolist(), strict=True):
                chunk.request.resolve_token(token, 0.0, {})
            engine.scheduler.finish_step(chunks)
        assert all(len(r.output_token_ids) == 11 for r in requests)
        assert manager.memory_report().total_bytes == before
    finally:
        reset_workspace_manager()


def _run_eagerly(runner, chunks, pool) -> torch.Tensor:
    graphs, runner.graphs = runner.graphs, {}
    mixed, runner.mixed_graphs = runner.mixed_graphs, {}
    try:
        return runner.execute(chunks, pool)
    finally:
        runner.graphs, runner.mixed_graphs = graphs, mixed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_prefill_equals_eager_prefill(checkpoint):
    """bf16 on CUDA: a step with prefill replayed at a larger captured token
    count (7 tokens at 64: padding tokens and requests) gives the logits of
    the same step run eagerly, and its padding tokens write no key or value
    outside the null block, although the slots a larger earlier step left
    in the input buffers point into live requests' blocks."""
    engine = _engine(
        checkpoint, dtype="bfloat16", device="cuda", max_num_batched_tokens=160
    )
    try:
        runner, pool = engine.runner, engine.pool
        assert sorted(runner.mixed_graphs) == [64, 128, 160]
        manager = current_workspace_manager()
        before = manager.memory_report().total_bytes
        first = _requests(engine, 2, 8)  # prompts of 5 and 11 tokens
        engine.step()  # one step of 16 prompt tokens
        engine.step()  # decode: the input buffers keep the prompts' slots
        late = Request("late", list(range(7, 12)), SamplingParams(max_tokens=2))
        engine.add_request(late)
        chunks = engine.scheduler.schedule()
        assert [c.end - c.start for c in chunks] == [1, 1, 5]
        layers = runner._attention_layers()
        caches = [layer.kv_cache for layer in layers if layer.kv_cache is not None]
        assert len(caches) == len(layers)
        saved = [cache.clone() for cache in caches]
        with runner.on_stream():
            graphed = runner.execute(chunks, pool).float()
            written = runner.slot_mapping[:7].clone()
            torch.cuda.synchronize()
        changed = torch.zeros(pool.num_blocks * 16, dtype=torch.bool, device="cuda")
        for cache, old in zip(caches, saved, strict=True):
            diff = torch.ne(cache, old).flatten(3).any(-1).any(0).flatten()
            changed |= diff[: pool.num_blocks * 16]  # the null block comes last
        assert changed.nonzero().flatten().tolist() == sorted(written.tolist())
        with runner.on_stream():
            eager = _run_eagerly(runner, chunks, pool).float()
        torch.testing.assert_close(graphed, eager, atol=3e-2, rtol=3e-2)
        assert graphed.shape == (3, eager.shape[1])
        assert manager.memory_report().total_bytes == before
        assert all(len(r.output_token_ids) == 2 for r in first)
    finally:
        reset_workspace_manager()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_and_eager_engines_agree(checkpoint):
    """Whole greedy generations of 12 requests (decode batches shrink as
    they finish, so several graph sizes replay) mostly match an engine with
    ``enforce_eager`` (bf16 ties may flip a late token)."""
    outputs = []
    for eager in (False, True):
        engine = _engine(
            checkpoint, dtype="bfloat16", device="cuda", enforce_eager=eager
        )
        try:
            assert bool(engine.runner.graphs) != eager
            assert bool(engine.runner.mixed_graphs) != eager
            requests = _requests(engine, 12, 16)
            while engine.has_unfinished_requests():
                engine.step()
            outputs.append([r.output_token_ids for r in requests])
        finally:
            reset_workspace_manager()
    same = sum(a[:4] == b[:4] for a, b in zip(*outputs, strict=True))
    assert same >= 10
