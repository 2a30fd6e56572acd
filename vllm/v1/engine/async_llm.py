"""The async engine front: asyncio callers over one engine loop.

``AsyncLLM`` reaches its engine through an
:class:`~vllm.v1.engine.core_client.EngineCoreClient`: ``vllm serve``'s runs
in a process of its own (:class:`~vllm.v1.engine.core_client.MPClient`),
tests may keep it on a thread (``InprocClient``). Either way the engine is
synchronous and steps alone; callers send it commands in order (add a
group, abort) and its events come back on one client thread, where this
front tracks the requests, detokenizes, applies stop strings and feeds one
asyncio queue per group with a single ``call_soon_threadsafe`` per step.

Contract:

- ``await add_requests(prompts, params)`` admits a group (an OpenAI
  request's prompts x ``n`` choices) whole or not at all: a bad request
  raises ``ValueError`` naming the field (the engine's message) and leaves
  the engine and every other request as they were.
- The returned :class:`RequestStream` yields ``(index, RequestOutput)``
  *deltas* as the engine produces them: the new token ids, the new text
  (stop strings applied; a partial character or a possible stop-string
  prefix held back until resolved) and their log-probabilities. Each
  member's last delta has ``finished=True`` and its finish reason, so the
  deltas concatenate to exactly what a blocking generation returns.
- ``stream.abort()`` (the client went away), or dropping a stream whose
  requests are unfinished, aborts them: the engine frees their KV blocks
  before its next step. A stop string found in the text finishes the
  request here at once and aborts it in the engine (tokens it made in the
  meantime are dropped).
- ``await shutdown()`` refuses new requests, lets those in flight finish and
  stops the engine. A step that raises (or an engine process that dies)
  fails every request in flight and marks the engine dead (``dead``); adds
  then raise :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.generation_config import GenerationDefaults
from vllm.v1.engine.core_client import (
    AbortRequests,
    Added,
    AddRequests,
    Dead,
    EngineCoreClient,
    EngineCoreOutput,
    EngineCoreOutputs,
    Event,
    Shutdown,
)
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.request import Request

logger = init_logger(__name__)

StreamItem = tuple[int, RequestOutput] | BaseException


class EngineDeadError(RuntimeError):
    """The engine loop is shut down or failed; no request can be served."""


@dataclass
class _Group:
    """An add the engine has not answered yet."""

    requests: list[Request]
    queue: asyncio.Queue[StreamItem]
    admitted: asyncio.Future[None]
    arrival: float  # time.monotonic() when the caller asked (TTFT counts from it)


@dataclass
class _Tracked:
    """One engine request as this front follows it (client thread only)."""

    request: Request  # as sent: prompt and sampling parameters
    index: int  # in its group
    queue: asyncio.Queue[StreamItem]
    detokenizer: IncrementalDetokenizer | None
    arrival: float
    last_token_time: float | None = None


class RequestStream:
    """A group's outputs: ``async for index, delta in stream`` (or
    :meth:`batches`). Ends when every member has finished; raises what
    killed the engine if it died."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_ids: list[str],
        queue: asyncio.Queue[StreamItem],
    ) -> None:
        self.request_ids = request_ids
        self._queue = queue
        self._open = set(request_ids)
        # A consumer that vanishes without aborting (an unstarted response
        # body, a dropped task) must not leave its requests running.
        self._finalizer = weakref.finalize(self, engine._abort, list(request_ids))
        self._finalizer.atexit = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """The deltas in batches: each one everything waiting when the last
        was taken (at least one). A server that writes a batch at once
        spends one write on however many steps it fell behind."""
        while self._open:
            batch = [self._take(await self._queue.get())]
            while self._open and not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, BaseException):
                    self._queue.put_nowait(item)  # raised after this batch
                    break
                batch.append(self._take(item))
            yield batch

    def _take(self, item: StreamItem) -> tuple[int, RequestOutput]:
        if isinstance(item, BaseException):
            self._open.clear()
            self._finalizer.detach()
            raise item
        if item[1].finished:
            self._open.discard(item[1].request_id)
            if not self._open:
                self._finalizer.detach()
        return item

    def abort(self) -> None:
        """Abort the unfinished members (a no-op once all finished)."""
        self._open.clear()
        if self._finalizer.alive:
            self._finalizer()


class AsyncLLM:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Any,
        stat_logger: PrometheusStatLogger | None = None,
        generation_defaults: GenerationDefaults | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        # the checkpoint's recommendations (the server fills requests' unset
        # knobs with them; its EOS ids and max_tokens cap apply to every
        # request here)
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.stat_logger = stat_logger
        self._lock = threading.Lock()  # guards the three below
        self._groups: dict[int, _Group] = {}
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._group_ids = itertools.count()
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def dead(self) -> bool:
        return self._dead is not None

    # -- the asyncio side ----------------------------------------------------

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will read
        the streams."""
        self._loop = asyncio.get_running_loop()
        self.client.start(self._on_event)

    async def shutdown(self) -> None:
        """Refuse new requests, finish those in flight, stop the engine."""
        with self._lock:
            closing, self._closing = self._closing, True
        if not closing:
            self.client.send(Shutdown())
        await asyncio.to_thread(self.client.join)

    async def add_requests(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> RequestStream:
        """Admit one request per (prompt, params) pair, all or none."""
        assert self._loop is not None, "AsyncLLM.start() first"
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        with_defaults = self.generation_defaults.apply
        requests = [
            Request(str(next(self._ids)), list(ids), with_defaults(p), eos)
            for ids, p in zip(prompts, params, strict=True)
        ]
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        admitted = self._loop.create_future()
        ids = [r.request_id for r in requests]
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._closing:
                raise EngineDeadError("the server is shutting down")
            group_id = next(self._group_ids)
            self._groups[group_id] = _Group(requests, queue, admitted, time.monotonic())
            self.client.send(AddRequests(group_id, requests))
        try:
            await admitted
        except asyncio.CancelledError:
            self._abort(ids)  # sent after the add: undoes it
            raise
        return RequestStream(self, ids, queue)

    def _abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """Thread-safe: abort these requests (unknown or finished ones are
        ignored)."""
        if not self.dead:
            self.client.send(AbortRequests(request_ids, reason))

    # -- the client thread -----------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, Added):
            self._on_added(event)
        elif isinstance(event, EngineCoreOutputs):
            # the step's state first: a client that saw a token finds it in /metrics
            self._record_scheduler(event)
            self._publish(event.outputs)
        else:
            self._fail_all(event)

    def _on_added(self, added: Added) -> None:
        with self._lock:
            group = self._groups.pop(added.group_id)
        if added.error is None:
            for index, request in enumerate(group.requests):
                detokenizer = (
                    None
                    if self.tokenizer is None
                    else IncrementalDetokenizer.for_params(
                        self.tokenizer, request.sampling_params
                    )
                )
                self._tracked[request.request_id] = _Tracked(
                    request, index, group.queue, detokenizer, group.arrival
                )
        self._call_soon(_resolve, group.admitted, added.error)

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand every request's new tokens and text to its stream."""
        now = time.monotonic()
        deliveries: list[tuple[asyncio.Queue[StreamItem], StreamItem]] = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue  # finished here already (a stop string)
            new, finish_reason = output.new_token_ids, output.finish_reason
            stop_reason: int | str | None = output.stop_token
            text = None
            if tracked.detokenizer is not None:
                text = tracked.detokenizer.update(new, finish_reason == "stop")
                if tracked.detokenizer.stopped:
                    self._abort([output.request_id], "stop")
                elif finish_reason is not None:
                    # held-back text may still complete a stop string
                    text += tracked.detokenizer.flush()
                if tracked.detokenizer.stopped:
                    finish_reason, stop_reason = "stop", tracked.detokenizer.stop_string
            self._record_tokens(tracked, len(new), now)
            logprobs = None
            if output.new_logprobs is not None:
                assert output.new_top_logprobs is not None
                logprobs = [
                    {token: lp, **top}
                    for token, lp, top in zip(
                        new, output.new_logprobs, output.new_top_logprobs, strict=True
                    )
                ]
            request = tracked.request
            finished = finish_reason is not None
            delta = RequestOutput(
                output.request_id,
                None,
                request.prompt_token_ids,
                [
                    CompletionOutput(
                        text, new, finish_reason, logprobs, stop_reason=stop_reason
                    )
                ],
                finished,
                output.prompt_logprobs,
                output.num_cached_tokens,
            )
            deliveries.append((tracked.queue, (tracked.index, delta)))
            if finished:
                del self._tracked[output.request_id]
                if self.stat_logger is not None:
                    latency = now - tracked.arrival
                    self.stat_logger.record_finished(latency, finish_reason or "abort")
        if deliveries:
            self._call_soon(_deliver, deliveries)

    def _record_tokens(self, tracked: _Tracked, num_new: int, now: float) -> None:
        if self.stat_logger is None or num_new == 0:
            return
        if tracked.last_token_time is None:
            num_prompt = len(tracked.request.prompt_token_ids)
            self.stat_logger.record_first_token(now - tracked.arrival, num_prompt)
            if num_new > 1:
                self.stat_logger.record_next_tokens(num_new - 1, 0.0)
        else:
            latency = now - tracked.last_token_time
            self.stat_logger.record_next_tokens(num_new, latency)
        tracked.last_token_time = now

    def _record_scheduler(self, outputs: EngineCoreOutputs) -> None:
        if self.stat_logger is not None:
            self.stat_logger.record_scheduler(outputs.stats)

    def _fail_all(self, dead: Dead) -> None:
        """Every request in flight and every pending add gets the error."""
        error = EngineDeadError(f"engine loop failed: {dead.error}")
        with self._lock:
            self._dead = error
            pending, self._groups = self._groups, {}
        queues = {id(t.queue): t.queue for t in self._tracked.values()}
        self._tracked.clear()
        self._call_soon(_deliver, [(q, error) for q in queues.values()])
        for group in pending.values():
            self._call_soon(_resolve, group.admitted, error)

    def _call_soon(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.cancelled():
        return  # the caller gave up; its abort follows the add
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(
    deliveries: list[tuple[asyncio.Queue[StreamItem], StreamItem]],
) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
