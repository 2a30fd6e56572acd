"""The scheduler alone, on a BlockPool, with requests whose tokens the test
appends itself (no model)."""

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.scheduler import Scheduler, SchedulerConfig
from vllm.v1.request import Request


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """One step; every chunk that samples gets token 7."""
    chunks = scheduler.schedule()
    for c in chunks:
        if c.samples:
            c.request.resolve_token(7, 0.0, {})
    scheduler.finish_step(chunks)
    return [(c.request.request_id, c.start, c.end) for c in chunks]


def test_budget_chunks_prefill_and_max_num_seqs_admits():
    scheduler = Scheduler(SchedulerConfig(2, 10, 64), BlockPool(16, 4))
    for rid, n in (("a", 12), ("b", 3), ("c", 2)):
        scheduler.add_request(request(rid, n))
    assert step(scheduler) == [("a", 0, 10)]  # budget 10: a's first chunk
    assert step(scheduler) == [("a", 10, 12), ("b", 0, 3)]  # then b (2 seqs max)
    assert step(scheduler) == [("a", 12, 13), ("b", 3, 4)]  # c waits: max_num_seqs
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_recomputes_the_newest_and_resumes_it_last():
    pool = BlockPool(3, 4)  # 12 token slots
    scheduler = Scheduler(SchedulerConfig(4, 64, 64), pool)
    old, new = request("old", 4, 8), request("new", 3, 8)
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert step(scheduler) == [("old", 0, 4), ("new", 0, 3)]
    # old needs a second block at its 5th token; new takes a second at its 5th.
    assert step(scheduler) == [("old", 4, 5), ("new", 3, 4)]
    assert step(scheduler) == [("old", 5, 6)]  # new preempted: no block for it
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 7]  # kept, recomputed with the prompt
    scheduler.finish_request("old")
    assert pool.num_free_blocks == 3
    assert step(scheduler) == [("new", 0, 5)]  # prompt + its 2 tokens
    assert scheduler.running == [new]


def test_abort_mid_prefill_and_while_waiting_frees_blocks():
    pool = BlockPool(8, 4)
    scheduler = Scheduler(SchedulerConfig(1, 6, 64), pool)
    scheduler.add_request(request("long", 20))
    scheduler.add_request(request("queued", 2))
    assert step(scheduler) == [("long", 0, 6)]
    assert pool.num_free_blocks == 6
    scheduler.finish_request("long")
    scheduler.finish_request("queued")
    assert pool.num_free_blocks == 8 and not scheduler.has_unfinished()
    assert step(scheduler) == []


def test_a_step_scheduled_before_the_last_one_resolves():
    """Async scheduling: step 2 is scheduled while step 1's samples are
    pending; a request whose pending tokens reach max_tokens is not."""
    scheduler = Scheduler(SchedulerConfig(4, 64, 64), BlockPool(16, 4))
    a, b = request("a", 5, max_tokens=3), request("b", 2, max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.end, c.samples) for c in first] == [
        ("a", 0, 5, True),
        ("b", 0, 2, True),
    ]
    assert a.num_pending_tokens == b.num_pending_tokens == 1
    # a decodes its pending token; b's pending token is its last: not run
    second = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in second] == [("a", 5, 6)]
    assert (a.num_pending_tokens, a.num_tokens, a.num_known_tokens) == (2, 7, 5)
    for c, token in zip(first, (11, 12), strict=True):
        c.request.resolve_token(token, 0.0, {})
    assert scheduler.finish_step(first) == [b]  # b: length
    assert a.output_token_ids == [11] and b.output_token_ids == [12]
    a.finish("stop")  # step 2's token comes after the end: dropped
    second[0].request.resolve_token(13, 0.0, {})
    assert a.output_token_ids == [11] and a.num_pending_tokens == 0
    assert scheduler.finish_step(second) == [a] and not scheduler.has_unfinished()


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
def test_bad_config_names_the_field(field):
    values = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1}
    with pytest.raises(ValueError, match=f"{field}: expected >= 1, got 0"):
        SchedulerConfig(**(values | {field: 0}))


@pytest.mark.parametrize("micro_batched", [False, True])
def test_a_joining_request_starts_after_its_cached_prefix(micro_batched):
    """Also after blocks computed in the same step, unless the step runs as
    two micro-batches (on two streams: the twin might read them first)."""
    pool = BlockPool(16, 4, enable_caching=True)
    config = SchedulerConfig(4, 64, 64, micro_batched=micro_batched)
    scheduler = Scheduler(config, pool)
    scheduler.add_request(first := request("a", 10))
    scheduler.add_request(twin := request("twin", 10))
    twin_start = 0 if micro_batched else 8
    chunks = scheduler.schedule()
    assert [c.reads_step_kv for c in chunks] == [False, not micro_batched]
    for c in chunks:
        c.request.resolve_token(7, 0.0, {})
    scheduler.finish_step(chunks)
    assert [(c.request.request_id, c.start, c.end) for c in chunks] == [
        ("a", 0, 10), ("twin", twin_start, 10)
    ]  # fmt: skip
    scheduler.add_request(later := request("b", 10))
    assert step(scheduler) == [("a", 10, 11), ("twin", 10, 11), ("b", 8, 10)]
    assert (first.num_cached_tokens, later.num_cached_tokens) == (0, 8)
    assert twin.num_cached_tokens == twin_start
    assert pool.block_table("b")[:2] == pool.block_table("a")[:2]
    assert scheduler.prefix_cache_queries == 30
    assert scheduler.prefix_cache_hits == 8 + twin_start


def test_a_chunk_says_when_it_reads_blocks_its_step_computes():
    """A decode token completing a block that a request joining in the same
    step takes as its prefix: the joiner's chunk says so (decode attention
    stores the step's keys itself, after other programs may read them)."""
    pool = BlockPool(16, 4, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(4, 64, 64), pool)
    scheduler.add_request(first := request("a", 3))
    assert step(scheduler) == [("a", 0, 3)]  # a holds [0, 1, 2] + token 7
    scheduler.add_request(Request("b", [0, 1, 2, 7, 9], SamplingParams()))
    chunks = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in chunks] == [
        ("a", 3, 4),  # completes block 0
        ("b", 4, 5),  # reads it
    ]
    assert [c.reads_step_kv for c in chunks] == [False, True]
    assert pool.block_table("b")[0] == pool.block_table("a")[0]
    for c in chunks:
        c.request.resolve_token(7, 0.0, {})
    scheduler.finish_step(chunks)
    # the next step reads that block as an earlier step's
    scheduler.add_request(Request("c", [0, 1, 2, 7, 5], SamplingParams()))
    chunks = scheduler.schedule()
    assert [(c.request.request_id, c.reads_step_kv) for c in chunks] == [
        ("a", False), ("b", False), ("c", False)
    ]  # fmt: skip
    assert first.num_computed_tokens == 5


def test_a_preempted_request_resumes_from_what_is_left_of_its_blocks():
    pool = BlockPool(4, 4, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(4, 64, 64), pool)
    old = request("old", 8, 8)
    new = Request("new", list(range(20, 28)), SamplingParams(max_tokens=8))
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert step(scheduler) == [("old", 0, 8), ("new", 0, 8)]  # the pool is full
    # old's 9th token takes new's last block; its first stays cached
    assert step(scheduler) == [("old", 8, 9)]
    assert new.num_preemptions == 1
    scheduler.finish_request("old")
    assert step(scheduler) == [("new", 4, 9)]  # prompt + its token, less a block
    assert new.num_cached_tokens == 0  # counted when it first joined
    # the counters leave resumed requests out, as vLLM's
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (16, 0)


def test_finishing_many_at_once_leaves_the_others_in_order():
    pool = BlockPool(16, 4)
    scheduler = Scheduler(SchedulerConfig(2, 64, 64), pool)
    requests = [request(f"r{i}", 3) for i in range(8)]
    for r in requests:
        scheduler.add_request(r)
    assert step(scheduler) == [("r0", 0, 3), ("r1", 0, 3)]  # max_num_seqs 2
    scheduler.finish_requests(["r1", "r3", "r5", "unknown", "r3"], "abort")
    assert [r.request_id for r in scheduler.running] == ["r0"]
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r4", "r6", "r7"]
    assert [requests[i].finish_reason for i in (1, 3, 5)] == ["abort"] * 3
    assert not scheduler.has_request("r3") and scheduler.has_request("r4")
    assert pool.num_free_blocks == 15  # r0's block; r1's freed
    scheduler.finish_requests([r.request_id for r in requests], "abort")
    assert not scheduler.has_unfinished() and pool.num_free_blocks == 16
    assert step(scheduler) == []
