"""Continuous batching: which tokens of which requests each step computes.

Every step has a token budget (``max_num_batched_tokens``). Running requests
come first, in the order they were admitted (a resumed request joins last):
a decoding one needs one token, one still in prefill takes what is left of
its prompt up to the budget (chunked prefill). A request whose grammar still
compiles (structured outputs) computes its prompt but the last token, whose
step would sample: it waits there, and a waiting one that cannot start
otherwise lets those behind it pass.
Then waiting requests join while budget, ``max_num_seqs`` and free KV-cache
blocks allow. When a running request needs a block and none is free, the
newest running request is preempted: its blocks are freed and it waits to be
recomputed from its prompt and the tokens it has produced, so nothing is lost
and greedy output does not change.
With prefix caching, a request joining takes its prompt's cached blocks
and starts computing after them (a preempted one too: its own blocks may
still be cached), also blocks that another request computes in the same
step: every layer stores the whole batch's keys and values before its
attention reads any. Its chunk says so (``reads_step_kv``): decode
attention stores the keys it computes itself, while other programs of the
same launch may read, so the runner keeps such a step off that path. A
step split into micro-batches (dual-batch overlap) runs them on two
streams, so there the blocks a step computes are registered once the
whole step is scheduled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    micro_batched: bool = False  # each step runs as two overlapping micro-batches

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions ``start:end`` of ``request``'s tokens computed this step;
    ``samples``: the chunk reaches the end of the sequence (its last
    token's logits give the next token)."""

    request: Request
    start: int
    end: int
    samples: bool
    # its cached prefix holds blocks that this step computes
    reads_step_kv: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config, self.pool = config, pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._queued: dict[str, Request] = {}  # waiting or running, by id
        self._step_blocks: set[int] = set()  # registered by the step scheduled
        # Prompt tokens of new requests that the prefix cache was asked for,
        # and those it held (vLLM's hit-rate counters leave out resumed ones).
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self._queued[request.request_id] = request

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        """Finish the request now (an abort, or a stop string the engine saw
        in its text) and free its blocks; a no-op when it is done."""
        self.finish_requests([request_id], reason)

    def finish_requests(
        self, request_ids: Iterable[str], reason: str = "abort"
    ) -> None:
        """:meth:`finish_request` for many, with one pass over the waiting
        queue (a client that sent thousands of requests goes at once)."""
        waiting = set()
        for request_id in request_ids:
            if (request := self._queued.pop(request_id, None)) is None:
                continue
            request.finish(reason)
            self.pool.free(request_id)
            if request in self.running:  # (max_num_seqs at most)
                self.running.remove(request)
            else:
                waiting.add(request)
        if waiting:
            self.waiting = deque(r for r in self.waiting if r not in waiting)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queued

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        self._step_blocks.clear()
        preempted: set[str] = set()  # this step, by an older request
        for request in list(self.running):
            if (
                request.request_id in preempted
                or budget == 0
                or request.max_tokens_scheduled  # (only with tokens pending)
            ):
                continue
            start = request.num_computed_tokens
            end = self._chunk_end(request, start, budget)
            if end <= start:  # its grammar still compiles
                continue
            while self.pool.allocate(request.request_id, end) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                chunks.append(self._scheduled(request, start, end))
                budget -= end - start
        held: list[Request] = []  # passed over: their grammars compile
        while (
            self.waiting
            and not preempted  # the freed blocks go to the running first
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted with a step in flight
                break
            wants_rows = request.missing_prompt_logprobs  # every row's logits
            cached = [] if wants_rows else self.pool.cached_prefix(request)
            start = len(cached) * self.pool.block_size
            end = self._chunk_end(request, start, budget)
            if end <= start:
                held.append(self.waiting.popleft())
                continue
            if self.pool.allocate(request.request_id, end, cached) is None:
                break
            if request.num_cached_tokens is None:  # not a resumed request
                request.num_cached_tokens = start
                if self.pool.enable_caching and not wants_rows:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += start
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            reads = not self._step_blocks.isdisjoint(cached)
            chunks.append(self._scheduled(request, start, end, reads))
            budget -= end - start
        self.waiting.extendleft(reversed(held))
        if self.config.micro_batched:
            for chunk in chunks:
                self.pool.cache_blocks(chunk.request, chunk.end)
        return chunks

    @staticmethod
    def _chunk_end(request: Request, start: int, budget: int) -> int:
        """Where ``request``'s chunk from ``start`` ends: within the budget,
        and short of the token that samples while its grammar compiles."""
        last = request.num_tokens - (request.compiling is not None)
        return min(last, start + budget)

    def _scheduled(
        self, request: Request, start: int, end: int, reads_step_kv: bool = False
    ) -> ScheduledChunk:
        """The chunk, counted as computed (and its sample as pending) from
        now: the next schedule may come before the step's results do."""
        samples = end == request.num_tokens
        request.num_computed_tokens = end
        request.num_pending_tokens += samples
        if not self.config.micro_batched:
            self._step_blocks.update(self.pool.cache_blocks(request, end))
        return ScheduledChunk(request, start, end, samples, reads_step_kv)

    def finish_step(self, chunks: list[ScheduledChunk]) -> list[Request]:
        """After ``chunks``' sampled tokens are resolved: retire finished
        requests, whose blocks are freed at once; returns them."""
        finished = []
        for chunk in chunks:
            request = chunk.request
            if request.status is not RequestStatus.FINISHED:
                continue
            if self._queued.get(request.request_id) is not request:
                # finished and removed meanwhile (an abort), its id perhaps
                # taken since by a new request
                continue
            del self._queued[request.request_id]
            if request in self.running:
                self.running.remove(request)
            else:  # preempted while this step (its last token) was in flight
                self.waiting.remove(request)
            self.pool.free(request.request_id)
            finished.append(request)
        return finished
