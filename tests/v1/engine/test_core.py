"""The engine on a tiny random Qwen3-MoE (fp32, CPU): continuous batching,
chunked prefill and preemption by recompute give every request the tokens
it gets alone, and after the lock no step asks the workspace for memory."""

import dataclasses
import gc
import itertools

import pytest
import torch

from vllm.model_executor.layers import attention
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.model_executor.models import qwen3_moe
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request
from vllm.v1.worker.workspace import current_workspace_manager, reset_workspace_manager

_prefixes = (f"engine_test_{i}." for i in itertools.count())
_gen = torch.Generator().manual_seed(0)
PROMPTS = [
    torch.randint(0, 320, (int(n),), generator=_gen).tolist()
    for n in torch.randint(1, 41, (16,), generator=_gen)
]
MAX_TOKENS = [1 + i % 10 for i in range(16)]
SHARED = torch.randint(0, 320, (40,), generator=_gen).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_engine")
    build_tiny_checkpoint(path, with_tokenizer=False)
    return path


@pytest.fixture
def engine_factory(checkpoint):
    def make(**kwargs) -> EngineCore:
        reset_workspace_manager()
        args = {"max_model_len": 64, "max_num_seqs": 16} | kwargs
        return EngineCore(
            EngineConfig(
                checkpoint,
                dtype="float32",
                device="cpu",
                prefix=next(_prefixes),
                **args,
            )
        )

    yield make
    reset_workspace_manager()


def run(engine: EngineCore, indices: list[int]) -> dict[int, Request]:
    requests = {
        i: Request(
            f"r{i}",
            PROMPTS[i],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]),
        )
        for i in indices
    }
    for request in requests.values():
        engine.add_request(request)
    finished: list[Request] = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert sorted(r.request_id for r in finished) == sorted(f"r{i}" for i in indices)
    return requests


def outputs(requests: dict[int, Request]) -> dict[int, list[int]]:
    return {i: r.output_token_ids for i, r in requests.items()}


def test_batching_chunking_and_preemption_change_no_token(engine_factory):
    alone_engine = engine_factory(max_num_batched_tokens=64)
    alone = {i: outputs(run(alone_engine, [i]))[i] for i in range(16)}
    assert all(len(alone[i]) == MAX_TOKENS[i] for i in range(16))
    together = run(engine_factory(max_num_batched_tokens=64), list(range(16)))
    assert outputs(together) == alone
    chunked = run(engine_factory(max_num_batched_tokens=8), list(range(16)))
    assert outputs(chunked) == alone
    # 6 blocks of 16 tokens for 16 requests of up to 50 tokens: preemption.
    tiny = run(
        engine_factory(max_num_batched_tokens=32, num_kv_blocks=6), list(range(16))
    )
    assert sum(r.num_preemptions for r in tiny.values()) > 0
    assert outputs(tiny) == alone
    assert all(r.finish_reason == "length" for r in tiny.values())


def test_async_scheduling_changes_no_token(engine_factory):
    """Steps scheduled while the one before is on the device (its samples
    fed to the next step on the device): the tokens of the synchronous
    engine, with batching, chunked prefill, preemption, stop tokens found
    one step late and an abort with a step in flight."""
    reference = outputs(run(engine_factory(max_num_batched_tokens=64), list(range(16))))
    for kwargs in (
        {"max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 8},
        {"max_num_batched_tokens": 32, "num_kv_blocks": 6},
    ):
        engine = engine_factory(async_scheduling=True, **kwargs)
        requests = run(engine, list(range(16)))
        assert outputs(requests) == reference, kwargs
        assert all(r.num_pending_tokens == 0 for r in requests.values())
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    # a stop token: the step after it was already launched, its token dropped
    longest = max(range(16), key=lambda i: MAX_TOKENS[i])
    stop = reference[longest][2]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop])
    stopped = Request("stop", PROMPTS[longest], params)
    engine.add_request(stopped)
    while engine.has_unfinished_requests():
        engine.step()
    first = reference[longest].index(stop)
    assert stopped.output_token_ids == reference[longest][: first + 1]
    assert stopped.finish_reason == "stop"
    # an abort while its next token is in flight frees its blocks at once
    aborted = Request("abort", PROMPTS[0], SamplingParams(max_tokens=10))
    engine.add_request(aborted)
    engine.step()
    engine.step()
    engine.finish_request("abort")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.step()  # resolves the step in flight: nothing appended
    assert len(aborted.output_token_ids) == 1 and not engine.has_unfinished_requests()


def test_async_a_request_preempted_with_its_last_token_in_flight_ends(
    engine_factory,
):
    """Two blocks for two requests: the second step preempts the newer one
    while the step that samples its last token is in flight. That token
    ends it (by length or a stop token) when the step resolves: it is
    returned as finished and never runs again."""
    prompts = {"a": list(range(1, 17)), "b": list(range(20, 35))}  # 1 block each

    def serve(async_scheduling: bool, b_params: SamplingParams) -> dict:
        engine = engine_factory(
            max_model_len=32, num_kv_blocks=2, async_scheduling=async_scheduling
        )
        a_params = SamplingParams(temperature=0, max_tokens=2)
        requests = {
            "a": Request("a", prompts["a"], a_params),
            "b": Request("b", prompts["b"], b_params),
        }
        for request in requests.values():
            engine.add_request(request)
        finished = []
        while engine.has_unfinished_requests():
            finished += engine.step()
        assert sorted(r.request_id for r in finished) == ["a", "b"]
        if async_scheduling:
            assert requests["b"].num_preemptions == 1
        return {
            name: (r.output_token_ids, r.finish_reason) for name, r in requests.items()
        }

    by_length = SamplingParams(temperature=0, max_tokens=1)
    reference = serve(False, by_length)
    assert serve(True, by_length) == reference
    first = reference["b"][0][0]
    by_stop = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first])
    assert serve(True, by_stop)["b"] == ([first], "stop")


def test_async_an_id_reused_while_its_old_request_is_in_flight(engine_factory):
    """A request returned as finished may still be in the step in flight
    (that step sampled past its end); a new request may take its id at
    once, and that step's end must not retire the new one."""
    engine = engine_factory(async_scheduling=True)
    stop_at_once = SamplingParams(max_tokens=10, stop_token_ids=list(range(320)))
    old = Request("a", [5, 6, 7], stop_at_once)
    other = Request("b", [8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request(old)
    engine.add_request(other)
    new = None
    while new is None:
        if any(r is old for r in engine.step()):
            assert engine._in_flight is not None  # it still holds the old one
            assert old in [c.request for c in engine._in_flight.chunks]
            new = Request(
                "a", [5, 6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True)
            )
            engine.add_request(new)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert new in finished and other in finished
    assert len(new.output_token_ids) == 5 and new.finish_reason == "length"
    assert engine.stats().kv_cache_usage == 0


def test_async_scheduling_is_on_for_one_gpu_rank_and_refuses_tp_and_dbo(
    checkpoint,
):
    dp: dict = {"data_parallel_size": 2, "enable_expert_parallel": True}
    assert EngineConfig(checkpoint, device="cuda").async_scheduling is True
    assert EngineConfig(checkpoint, device="cpu").async_scheduling is False
    assert EngineConfig(checkpoint, device="cuda", **dp).async_scheduling is False
    assert EngineConfig(checkpoint, async_scheduling=True, **dp).async_scheduling
    off = EngineConfig(checkpoint, device="cuda", async_scheduling=False)
    assert off.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling: not supported"):
        EngineConfig(
            checkpoint, async_scheduling=True, tensor_parallel_size=2,
            enable_expert_parallel=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="async_scheduling: not supported"):
        EngineConfig(checkpoint, async_scheduling=True, enable_dbo=True, **dp)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the interpreter runs only where no CUDA device is; GPU engines "
    "take this path for real",
)
def test_the_gpu_paths_fused_kv_store_changes_no_token(engine_factory, monkeypatch):
    """The model's GPU attention path on CPU (its Triton kernels under the
    interpreter): q/k norm + RoPE and the KV-cache store in one kernel in
    steps with prefill, inside the attention kernel in decode steps,
    through chunked prefills and decodes that read the keys they stored."""
    indices = [0, 5, 9]
    reference = outputs(run(engine_factory(max_num_batched_tokens=8), indices))
    stored, attended = [], []
    real_store, real_attend = attention.qk_norm_rope_, attention.triton_paged_attention

    def store(*args, **kwargs):
        stored.append(kwargs["kv_cache"] is not None)
        return real_store(*args, **kwargs)

    def attend(*args, **kwargs):
        max_query_len, new_kv = args[6], args[-1]
        attended.append((max_query_len == 1, new_kv is not None))
        return real_attend(*args, **kwargs)

    for module in (qwen3_moe, attention):
        monkeypatch.setattr(module, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(attention, "qk_norm_rope_", store)
    monkeypatch.setattr(attention, "triton_paged_attention", attend)
    got = run(engine_factory(max_num_batched_tokens=8), indices)
    assert stored and all(stored)  # every step with prefill stored through it
    # decode steps (and only they) left it to the attention kernel
    assert {decode for decode, _ in attended} == {True, False}
    assert all(decode == fused for decode, fused in attended)
    assert len(stored) == sum(not decode for decode, _ in attended)
    assert outputs(got) == reference


def test_a_step_reading_keys_it_stores_leaves_decode_attention(
    engine_factory, monkeypatch
):
    """Request b joins while a's decode token completes the block b takes
    as its prefix: one-token chunks both, but the step stores its keys
    before attention (a bound of 2), so b never reads that block's last key
    from a slot a's attention program has not written yet."""

    def generate(engine, attended=None):
        a = Request("a", SHARED[:15], SamplingParams(temperature=0, max_tokens=3))
        engine.add_request(a)
        engine.step()  # a's prompt: its first token is position 15
        b = Request("b", [*a.all_token_ids, 11], SamplingParams(temperature=0))
        engine.add_request(b)
        if attended is not None:
            attended.clear()
        engine.step()  # a stores position 15 (block 0's last); b reads it
        step = list(attended or [])
        while engine.has_unfinished_requests():
            engine.step()
        assert b.num_cached_tokens == 16
        return (a.output_token_ids, b.output_token_ids), step

    reference, _ = generate(engine_factory(max_num_batched_tokens=32))
    attended: list[tuple[int, bool]] = []
    real = attention.triton_paged_attention

    def attend(*args, **kwargs):
        attended.append((args[6], args[-1] is not None))  # max_query_len, fused
        return real(*args, **kwargs)

    for module in (qwen3_moe, attention):
        monkeypatch.setattr(module, "runs_gpu_kernels", lambda t: True)
    monkeypatch.setattr(attention, "triton_paged_attention", attend)
    got, step = generate(engine_factory(max_num_batched_tokens=32), attended)
    assert step and all(call == (2, False) for call in step)
    assert got == reference


def test_after_the_lock_nothing_grows(engine_factory):
    engine = engine_factory(max_num_batched_tokens=48)
    manager = current_workspace_manager()
    assert manager.is_locked()
    before = manager.memory_report()
    run(engine, list(range(16)))
    after = manager.memory_report()
    assert after.total_bytes == before.total_bytes
    assert len(after.resources_of_type("MoEPermuteScratch")) == 1


def test_bad_requests_are_refused_and_others_served(engine_factory):
    engine = engine_factory(max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="exceed max_model_len=64"):
        engine.add_request(Request("long", [1] * 60, SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.add_request(Request("empty", [], SamplingParams()))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 320\)"):
        engine.add_request(Request("oov", [5, 320], SamplingParams()))
    with pytest.raises(ValueError, match="logprobs: expected <= 320"):
        engine.add_request(Request("lp", [5], SamplingParams(logprobs=321)))
    with pytest.raises(ValueError, match="logit_bias: expected token ids < 320"):
        bias = SamplingParams(logit_bias={4: 1.0, 320: 2.0})
        engine.add_request(Request("bias", [5], bias))
    engine.add_request(Request("dup", [5], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="request_id: 'dup' is already running"):
        engine.add_request(Request("dup", [6], SamplingParams()))
    engine.finish_request("dup")
    served = run(engine, [0, 1])
    assert [len(served[i].output_token_ids) for i in (0, 1)] == MAX_TOKENS[:2]


def test_abort_frees_blocks_at_once(engine_factory):
    engine = engine_factory(max_num_batched_tokens=64)
    free = engine.pool.num_free_blocks
    engine.add_request(Request("a", PROMPTS[3], SamplingParams(max_tokens=10)))
    engine.step()
    assert engine.pool.num_free_blocks < free
    engine.finish_request("a")
    assert engine.pool.num_free_blocks == free
    assert not engine.has_unfinished_requests()


def shared_prefix_requests(params: SamplingParams) -> list[Request]:
    """Prompts that share SHARED's first 40, 33, 16, 17 and 5 tokens (two
    and a half blocks of 16, two and a token, one, one and a token, none),
    some with tokens of their own after it."""
    lengths = (40, 40, 33, 16, 17, 5)
    return [
        Request(f"s{i}", SHARED[:n] + [300 + i] * (i % 3), params)
        for i, n in enumerate(lengths)
    ]


GREEDY_6 = SamplingParams(temperature=0, max_tokens=6, logprobs=0)


def run_shared_prefixes(
    engine: EngineCore, params: SamplingParams = GREEDY_6, first_alone: bool = True
) -> list[Request]:
    """The first request alone (or not), then the others together."""
    first, *others = requests = shared_prefix_requests(params)
    for batch in ([first], others) if first_alone else (requests,):
        for request in batch:
            engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
    return requests


def test_prefix_caching_changes_no_token(engine_factory):
    """Requests that find their prompt's first blocks in the cache skip
    them and get the tokens and log-probabilities of the engine without
    the cache, whether the blocks were computed in an earlier step or in
    the same one; so do requests resumed after preemption and steps
    scheduled asynchronously."""
    plain = run_shared_prefixes(engine_factory(enable_prefix_caching=False))
    assert all(r.num_cached_tokens == 0 for r in plain)
    for first_alone in (True, False):
        engine = engine_factory()
        cached = run_shared_prefixes(engine, first_alone=first_alone)
        # whole blocks, short of each prompt's last token (s3 is one block)
        assert [r.num_cached_tokens for r in cached] == [0, 32, 32, 0, 16, 0]
        stats = engine.stats()
        assert stats.prefix_cache_hits == 80
        assert stats.prefix_cache_queries == sum(
            len(r.prompt_token_ids) for r in cached
        )
        for want, got in zip(plain, cached, strict=True):
            assert got.output_token_ids == want.output_token_ids
            torch.testing.assert_close(
                torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs)
            )
    for kwargs in ({"num_kv_blocks": 4}, {"async_scheduling": True}):
        engine = engine_factory(max_num_batched_tokens=32, **kwargs)
        requests = run_shared_prefixes(engine)
        assert [r.output_token_ids for r in requests] == [
            r.output_token_ids for r in plain
        ], kwargs
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        preempted = sum(r.num_preemptions for r in requests)
        assert preempted > 0 if "num_kv_blocks" in kwargs else preempted == 0


def gpu_engine(checkpoint, **kwargs) -> EngineCore:
    """bf16 on CUDA, the KV cache from a small share of the GPU's memory."""
    config = EngineConfig(
        checkpoint,
        dtype="bfloat16",
        device="cuda",
        max_model_len=64,
        gpu_memory_utilization=0.05,
        prefix=next(_prefixes),
        **kwargs,
    )
    return EngineCore(config)


@pytest.mark.gpu
def test_engine_on_the_gpu_runs_everything_after_the_lock(checkpoint):
    """bf16 on CUDA with the GPU experts backend, the KV cache sized from
    gpu_memory_utilization: 16 requests finish and the locked manager never
    grows (batch-dependent GEMM tiles may move bf16 ties, so tokens are not
    compared with solo runs here)."""
    reset_workspace_manager()
    try:
        engine = gpu_engine(checkpoint, max_num_batched_tokens=64)
        manager = current_workspace_manager()
        before = manager.memory_report().total_bytes
        requests = run(engine, list(range(16)))
        assert [len(requests[i].output_token_ids) for i in range(16)] == MAX_TOKENS
        assert manager.memory_report().total_bytes == before
        assert engine.pool.num_blocks * 16 > 64 * 16  # sized from the GPU's memory
    finally:
        reset_workspace_manager()


@pytest.mark.gpu
def test_prefix_caching_on_the_gpu_matches_the_engine_without_it(checkpoint):
    """bf16 on CUDA (graphs, async scheduling): the first token's
    log-probabilities over the whole vocabulary of requests that start after
    cached blocks, computed in an earlier step or in the same one, are
    those of the engine without the cache, within bf16 noise (other batch
    shapes round differently, so ties may move and only the first token is
    compared)."""
    runs = {}
    for caching, first_alone in ((False, True), (True, True), (True, False)):
        reset_workspace_manager()
        try:
            engine = gpu_engine(checkpoint, enable_prefix_caching=caching)
            vocab = engine.model.config.vocab_size
            params = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)
            runs[caching, first_alone] = run_shared_prefixes(
                engine, params, first_alone
            )
            del engine  # its KV cache would count in the next engine's peak
            gc.collect()
        finally:
            reset_workspace_manager()
    plain = runs.pop((False, True))
    for cached in runs.values():
        assert [r.num_cached_tokens for r in cached] == [0, 32, 32, 0, 16, 0]
        for want, got in zip(plain, cached, strict=True):
            ids = sorted(want.top_logprobs[0])
            torch.testing.assert_close(
                torch.tensor([got.top_logprobs[0][t] for t in ids]),
                torch.tensor([want.top_logprobs[0][t] for t in ids]),
                atol=0.1,
                rtol=0,
            )


def test_a_failed_engine_leaves_the_manager_locked(
    engine_factory, checkpoint, tmp_path
):
    engine_factory(max_num_batched_tokens=16)
    manager = current_workspace_manager()
    with pytest.raises(ValueError, match="max_model_len: expected <= the model's"):
        EngineCore(EngineConfig(checkpoint, max_model_len=4096))  # 512 positions
    with pytest.raises(ValueError, match="max_num_seqs: expected >= 1, got 0"):
        EngineCore(EngineConfig(checkpoint, max_num_seqs=0))
    with pytest.raises(ValueError, match="max_model_len: expected >= 1, got 0"):
        EngineCore(EngineConfig(checkpoint, max_model_len=0))  # not "unset"
    with pytest.raises(ValueError, match="model: expected a checkpoint directory"):
        EngineCore(EngineConfig(tmp_path / "absent", device="cpu"))
    assert manager.is_locked()


def test_min_tokens_holds_the_stop_tokens_back_sync_and_async(engine_factory):
    """A stop token (of stop_token_ids, or the EOS) that greedy decoding
    reaches early cannot be sampled before min_tokens: the request goes on
    and may stop at it afterwards; async scheduling (its step in flight
    counted) gives the same tokens."""
    free = SamplingParams(temperature=0, max_tokens=10)
    engine = engine_factory()
    engine.add_request(alone := Request("alone", PROMPTS[5], free))
    while engine.has_unfinished_requests():
        engine.step()
    reference = alone.output_token_ids
    stop = reference[1] if reference[1] != reference[0] else reference[2]
    first_stop = reference.index(stop)
    runs = {}
    for async_scheduling in (False, True):
        engine = engine_factory(async_scheduling=async_scheduling)
        params = {
            "free": free,
            "stops": dataclasses.replace(free, stop_token_ids=[stop]),
            "min_stops": dataclasses.replace(free, stop_token_ids=[stop], min_tokens=5),
            "min_eos": dataclasses.replace(free, min_tokens=5),
        }
        requests = {
            name: Request(
                name, PROMPTS[5], p, eos_token_id=stop if name == "min_eos" else None
            )
            for name, p in params.items()
        }
        for request in requests.values():
            engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
        runs[async_scheduling] = {n: r.output_token_ids for n, r in requests.items()}
    assert runs[False] == runs[True]
    got = runs[False]
    assert got["free"] == reference and got["stops"] == reference[: first_stop + 1]
    for name in ("min_stops", "min_eos"):
        assert len(got[name]) >= 5 and stop not in got[name][:5], name
        assert got[name][:first_stop] == reference[:first_stop]  # then it diverges
    assert got["min_stops"] == got["min_eos"]


def test_penalties_count_every_earlier_token_sync_and_async(engine_factory):
    """Greedy with presence and frequency penalties, six requests of
    different lengths batched under a small token budget (chunked prefill:
    the rows move between steps): each token is the argmax of the model's
    raw log-probabilities (the whole vocabulary, asked as logprobs) less the
    penalties of the tokens before it. Async scheduling, where the last
    token is still on the device when the next step samples, gives the same
    tokens, with the repetition penalty too; and the penalties changed the
    output."""
    # (presence, frequency, repetition)
    cases = {"none": (0.0, 0.0, 1.0), "pf": (0.5, 1.5, 1.0), "pfr": (0.5, 1.5, 1.4)}
    runs = {}
    for async_scheduling, case in itertools.product((False, True), cases):
        engine = engine_factory(
            async_scheduling=async_scheduling, max_num_batched_tokens=16
        )
        presence, frequency, repetition = cases[case]
        requests = [
            Request(
                f"p{i}",
                PROMPTS[i],
                SamplingParams(
                    temperature=0,
                    max_tokens=4 + 3 * i,
                    logprobs=engine.model.config.vocab_size,
                    presence_penalty=presence,
                    frequency_penalty=frequency,
                    repetition_penalty=repetition,
                ),
            )
            for i in range(6)
        ]
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
        runs[async_scheduling, case] = [r.output_token_ids for r in requests]
        if case != "pf":
            continue
        for request in requests:
            for step, token in enumerate(request.output_token_ids):
                earlier = request.output_token_ids[:step]
                scores = {
                    t: lp - frequency * earlier.count(t) - presence * (t in earlier)
                    for t, lp in request.top_logprobs[step].items()
                }
                assert scores[token] >= max(scores.values()) - 1e-5, (step, token)
    for case in cases:
        assert runs[True, case] == runs[False, case], case
    assert runs[False, "pf"] != runs[False, "none"]
