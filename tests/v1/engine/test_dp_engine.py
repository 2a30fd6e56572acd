"""Data + expert parallelism through ``LLM`` on 2 real gloo ranks (this
process and one spawned worker), tiny Qwen3-MoE in fp32 on the CPU: the
same greedy tokens as one process (both all2all backends, with a rank that
gets no request, with dual-batch overlap, and on 4 ranks; on 2 GPUs over
NCCL with CUDA graphs), ``AsyncLLM`` unchanged over
it, aborts freeing another rank's blocks, a killed worker failing rank 0
within the timeout, and the configuration refusals."""

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe.prepare_finalize import ALL2ALL_BACKENDS
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.engine.dp_engine import DPEngineCore, DPEngineDeadError
from vllm.v1.request import Request
from vllm.v1.worker.workspace import current_workspace_manager, reset_workspace_manager

ARGS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 64,
    "max_num_seqs": 8,
}
DP: dict[str, Any] = {"data_parallel_size": 2, "enable_expert_parallel": True}
_gen = torch.Generator().manual_seed(1)
PROMPTS = [
    torch.randint(0, 320, (int(n),), generator=_gen).tolist() for n in (5, 23, 9, 14)
]
# Uneven lengths: a rank runs dummy forwards while the other still decodes.
PARAMS = [SamplingParams(temperature=0, max_tokens=m) for m in (3, 9, 1, 6)]


def token_ids(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe_dp")
    build_tiny_checkpoint(path, with_tokenizer=False)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint) -> Iterator[list[list[int]]]:
    reset_workspace_manager()
    yield token_ids(LLM(checkpoint, **ARGS), PROMPTS, PARAMS)
    reset_workspace_manager()


def dp_engine(llm: LLM) -> DPEngineCore:
    assert isinstance(llm.engine, DPEngineCore)
    return llm.engine


@pytest.fixture(scope="class", params=ALL2ALL_BACKENDS)
def dp_llm(request, checkpoint, reference):
    """After the reference, on a fresh workspace manager; stopped after its
    class: one DP engine per process at a time."""
    reset_workspace_manager()
    llm = LLM(checkpoint, **ARGS, **DP, all2all_backend=request.param)
    yield llm
    dp_engine(llm).shutdown()
    assert not dist.is_initialized()
    assert all(p.exitcode == 0 for p in dp_engine(llm).processes)
    reset_workspace_manager()


class TestLockstep:
    def test_greedy_tokens_equal_one_process(self, dp_llm, reference):
        assert token_ids(dp_llm, PROMPTS, PARAMS) == reference
        # One request: rank 1 gets none and runs dummy forwards throughout.
        assert token_ids(dp_llm, PROMPTS[1:2], PARAMS[1:2]) == reference[1:2]
        assert not dp_llm.engine.has_unfinished_requests()

    def test_every_rank_reports_its_workspace_at_lock(self, dp_llm):
        reports = dp_engine(dp_llm).workspace_reports
        assert len(reports) == 2 and all(r.locked for r in reports)
        for report in reports:  # one scratch, sized from this rank's inputs
            (scratch,) = report.resources_of_type("MoEPermuteScratch")
            assert scratch.nbytes > 0
        assert reports[0].total_bytes == dp_engine(dp_llm).workspace_report.total_bytes

    def test_async_llm_runs_over_it_unchanged(self, dp_llm, reference):
        async def run() -> list[list[int]]:
            engine = AsyncLLM(InprocClient(dp_llm.engine), None)
            engine.start()
            try:
                stream = await engine.add_requests(PROMPTS, PARAMS)
                out: list[list[int]] = [[] for _ in PROMPTS]
                async for index, delta in stream:
                    out[index] += delta.outputs[0].token_ids
                return out
            finally:
                await engine.shutdown()

        assert asyncio.run(run()) == reference

    def test_a_grammar_it_cannot_run_is_refused_on_rank_0(self, dp_llm, reference):
        """The second prompt would go to rank 1; the error (this checkpoint
        has no tokenizer to compile with) comes before any rank runs it."""
        spec = StructuredOutputsParams(regex="[0-9]+")
        grammar = SamplingParams(max_tokens=2, structured_outputs=spec)
        with pytest.raises(
            ValueError, match=r"prompts\[1\]: structured_outputs: needs the tokenizer"
        ):
            dp_llm.generate(PROMPTS[:2], [PARAMS[0], grammar])
        assert token_ids(dp_llm, PROMPTS, PARAMS) == reference  # every rank serves

    def test_an_aborted_request_frees_its_blocks(self, dp_llm):
        engine = dp_engine(dp_llm)
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        requests = [Request(f"abort{i}", PROMPTS[1], long) for i in range(2)]
        for request in requests:
            engine.add_request(request)  # least loaded: one per rank
        with pytest.raises(ValueError, match="request_id: 'abort1' is already"):
            engine.add_request(Request("abort1", PROMPTS[0], long))
        for _ in range(3):
            engine.step()
        assert engine.stats().num_running_reqs == 2
        # rank 1's tokens reach rank 0 with the next step's exchange
        assert [len(r.output_token_ids) for r in requests] == [3, 2]
        both = engine.stats().kv_cache_usage
        engine.finish_request("abort1")  # rank 1's
        assert requests[1].finish_reason == "abort"
        assert engine.has_unfinished_requests()
        engine.step()  # carries the abort to rank 1
        engine.step()  # and rank 1's report of its step after it back
        stats = engine.stats()
        assert stats.num_running_reqs == 1 and 0 < stats.kv_cache_usage < both
        assert len(requests[1].output_token_ids) == 2  # nothing after the abort
        engine.finish_request("abort0")  # rank 0's: freed at once
        engine.step()
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0
        # Aborts as the last work: the step that carries rank 1's owes its
        # report, and the step after brings it.
        for name in ("abort2", "abort3"):  # rank 0's, rank 1's
            engine.add_request(Request(name, PROMPTS[1], long))
        for _ in range(2):
            engine.step()
        engine.finish_request("abort2")
        engine.finish_request("abort3")
        engine.step()
        assert engine.has_unfinished_requests()
        assert engine.stats().num_running_reqs == 1  # rank 1, a step ago
        engine.step()
        assert not engine.has_unfinished_requests()
        stats = engine.stats()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


def test_async_scheduling_changes_no_token(checkpoint, reference):
    """Each rank schedules its next step while its last one runs; a rank
    whose step launched nothing (only a step to resolve) still runs a
    dummy forward, so the ranks stay in step."""
    reset_workspace_manager()
    llm = LLM(checkpoint, **ARGS, **DP, async_scheduling=True)
    try:
        assert token_ids(llm, PROMPTS, PARAMS) == reference
        assert token_ids(llm, PROMPTS[1:2], PARAMS[1:2]) == reference[1:2]
        assert not llm.engine.has_unfinished_requests()
    finally:
        dp_engine(llm).shutdown()
        reset_workspace_manager()


@pytest.mark.parametrize("all2all_backend", ALL2ALL_BACKENDS)
def test_dual_batch_overlap_changes_no_token(checkpoint, reference, all2all_backend):
    """enable_dbo: every rank's step as two micro-batches on two threads,
    each with its own workspace slot and communicator (a step of one
    request leaves one micro-batch empty: it runs a dummy forward); rank 0
    holds one permute scratch per ubatch slot."""
    reset_workspace_manager()
    llm = LLM(
        checkpoint, **ARGS, **DP, enable_dbo=True, all2all_backend=all2all_backend
    )
    try:
        assert token_ids(llm, PROMPTS, PARAMS) == reference
        assert token_ids(llm, PROMPTS[1:2], PARAMS[1:2]) == reference[1:2]
        report = current_workspace_manager().memory_report()
        scratches = [
            sum(r.type_name == "MoEPermuteScratch" for r in slot.resources)
            for slot in report.slots
        ]
        assert scratches == [1, 1]
    finally:
        dp_engine(llm).shutdown()
        reset_workspace_manager()


def test_tensor_parallel_ranks_match_one_process(checkpoint, reference):
    """tensor_parallel_size=2 (heads, dense MLP and experts split; both ranks
    run every request): one process's greedy tokens; an abort reaches the
    other rank, whose blocks it frees; unseeded samples agree on both ranks,
    and a rank that samples otherwise stops the engine."""
    reset_workspace_manager()
    llm = LLM(checkpoint, **ARGS, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        engine = dp_engine(llm)
        assert token_ids(llm, PROMPTS, PARAMS) == reference
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        engine.add_request(Request("tp-abort", PROMPTS[1], long))
        for _ in range(3):
            engine.step()
        engine.finish_request("tp-abort")
        with pytest.raises(ValueError, match="'tp-abort' is being aborted"):
            engine.add_request(Request("tp-abort", PROMPTS[1], long))
        engine.step()  # carries the abort to rank 1
        assert engine.stats().kv_cache_usage == 0
        # and one more step brings rank 1's report of the step that freed them
        assert engine.has_unfinished_requests()
        engine.step()
        assert not engine.has_unfinished_requests()
        assert all(r.num_used_blocks == 0 for r in engine._peer_reports)
        # Unseeded sampling: both ranks draw alike (their engines' own
        # generators), even when the caller uses the global generator.
        hot = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        request = Request("tp-hot", PROMPTS[0], hot)
        engine.add_request(request)
        peer: list[int] = []
        while engine.has_unfinished_requests():
            torch.rand(3)
            engine.step()
            peer += [t for d in engine._peer_reports[0].deltas for t in d.token_ids]
        # the loop ran one step past the last token: rank 1's report of it
        assert peer == request.output_token_ids and len(peer) == 12
        # A rank that samples otherwise stops the engine with a named error.
        engine.generator = torch.Generator().manual_seed(12345)
        engine.add_request(Request("tp-astray", PROMPTS[0], hot))
        with pytest.raises(DPEngineDeadError, match=r"rank 1 sampled .* out of step"):
            for _ in range(12):
                engine.step()
    finally:
        dp_engine(llm).shutdown()
        reset_workspace_manager()


def test_four_ranks_match_one_process(checkpoint, reference):
    """4 gloo ranks (3 spawned), the default backend: one process's greedy
    tokens, with a rank left without requests."""
    reset_workspace_manager()
    llm = LLM(checkpoint, **ARGS, data_parallel_size=4, enable_expert_parallel=True)
    try:
        assert token_ids(llm, PROMPTS[:3], PARAMS[:3]) == reference[:3]
        scratches = [
            len(r.resources_of_type("MoEPermuteScratch"))
            for r in dp_engine(llm).workspace_reports
        ]
        assert scratches == [1, 1, 1, 1]
    finally:
        dp_engine(llm).shutdown()
        reset_workspace_manager()


TWO_RANKS = {
    "dp2": {**DP, "all2all_backend": "allgather_reducescatter"},
    "dp2-all2all": {**DP, "all2all_backend": "all2all"},
    "tp2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("parallel", sorted(TWO_RANKS))
def test_two_gpus_match_one(checkpoint, parallel):
    """bf16 over NCCL: 2 ranks (CUDA graphs but with the all2all backend:
    data-parallel ranks replay one size, an idle one padding; tensor-parallel
    ones the same steps) give one GPU's greedy tokens (bf16 ties may flip a
    late token); rank 0 never grows its workspace after the lock, and every
    rank holds one permute scratch."""
    gpu = {**ARGS, "dtype": "bfloat16", "device": "cuda", "num_kv_blocks": 64}
    reset_workspace_manager()
    one = token_ids(LLM(checkpoint, **gpu), PROMPTS, PARAMS)
    reset_workspace_manager()
    llm = LLM(checkpoint, **gpu, **TWO_RANKS[parallel])
    try:
        runner = dp_engine(llm).runner
        graphed = parallel != "dp2-all2all"
        assert bool(runner.graphs) == bool(runner.mixed_graphs) == graphed
        manager = current_workspace_manager()
        before = manager.memory_report()
        two = token_ids(llm, PROMPTS, PARAMS)
        assert token_ids(llm, PROMPTS[1:2], PARAMS[1:2]) == two[1:2]
        assert sum(a[:4] == b[:4] for a, b in zip(one, two, strict=True)) >= 3
        after = manager.memory_report()
        assert after.total_bytes == before.total_bytes
        for report in (after, *dp_engine(llm).workspace_reports):
            assert len(report.resources_of_type("MoEPermuteScratch")) == 1
    finally:
        dp_engine(llm).shutdown()
        reset_workspace_manager()


def test_a_killed_worker_makes_rank_0_raise_within_the_timeout(checkpoint):
    llm = LLM(checkpoint, **ARGS, **DP, distributed_timeout_s=10.0)
    engine = dp_engine(llm)
    try:
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        for i in range(2):
            engine.add_request(Request(str(i), PROMPTS[0], long))
        engine.step()
        (worker,) = engine.processes
        assert worker.pid is not None
        # Found dead before the next step, or by that step's collectives
        # (the kill may not have landed yet): the same error either way.
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(DPEngineDeadError, match=r"rank 1 \(pid \d+\) exited with"):
            engine.step()
        assert time.monotonic() - start < 10.0
        with pytest.raises(DPEngineDeadError, match="stopped after a failure"):
            engine.step()
        assert not dist.is_initialized()  # left the world: a new engine may start
    finally:
        engine.shutdown()
        reset_workspace_manager()


def test_configurations_are_checked(checkpoint):
    with pytest.raises(ValueError, match="data_parallel_size: 2 ranks need enable_"):
        EngineConfig(checkpoint, data_parallel_size=2)
    with pytest.raises(ValueError, match="all2all_backend: expected one of"):
        EngineConfig(checkpoint, **DP, all2all_backend="naive")
    with pytest.raises(ValueError, match="enable_dbo: needs data_parallel_size > 1"):
        EngineConfig(checkpoint, enable_dbo=True)
    with pytest.raises(ValueError, match="data_parallel_size: expected >= 1"):
        EngineConfig(checkpoint, data_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks need enable"):
        EngineConfig(checkpoint, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks need enable"):
        EngineConfig(checkpoint, **DP, tensor_parallel_size=2)  # with dp 2
    tp: dict[str, Any] = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    with pytest.raises(ValueError, match="enable_dbo: needs data_parallel_size > 1"):
        EngineConfig(checkpoint, **tp, enable_dbo=True)
    with pytest.raises(ValueError, match="all2all_backend: tensor-parallel ranks"):
        EngineConfig(checkpoint, **tp, all2all_backend="all2all")
    # One rank holds every expert: expert parallelism is a no-op.
    assert not EngineConfig(checkpoint, enable_expert_parallel=True).expert_parallel
    with pytest.raises(ValueError, match="need an initialized expert-parallel group"):
        EngineCore(EngineConfig(checkpoint, **ARGS, **DP))
    with pytest.raises(ValueError, match="DPEngineCore runs > 1 ranks"):
        DPEngineCore(EngineConfig(checkpoint, **ARGS))
