"""The async engine front: one engine step loop serving every caller.

``AsyncLLM`` owns an :class:`~vllm.v1.engine.core.EngineCore` and drives it
from ONE background thread, the engine loop: ``EngineCore`` is synchronous
and not thread-safe and a step is blocking compute, so it never runs on the
event loop and nothing else touches the engine. Callers on the asyncio loop
reach the engine loop through an ordered inbox (add and abort commands); it
answers through one asyncio queue per group of requests, fed with a single
``call_soon_threadsafe`` per step.

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
  requests are unfinished, aborts them: the engine loop frees their KV
  blocks right after the step in flight, the first moment the engine may be
  touched.
- ``await shutdown()`` refuses new requests, lets those in flight finish and
  stops the loop. An exception in a step fails every request in flight and
  marks the engine dead (``dead``); adds then raise :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.request import Request

logger = init_logger(__name__)

StreamItem = tuple[int, RequestOutput] | BaseException


class EngineDeadError(RuntimeError):
    """The engine loop is shut down or failed; no request can be served."""


@dataclass
class _Add:
    requests: list[Request]
    queue: asyncio.Queue[StreamItem]
    admitted: asyncio.Future[None]
    arrival: float  # time.monotonic() when the caller asked (TTFT counts from it)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Tracked:
    """One engine request as the engine loop follows it."""

    request: Request
    index: int  # in its group
    queue: asyncio.Queue[StreamItem]
    detokenizer: IncrementalDetokenizer | None
    arrival: float
    num_sent: int = 0  # output tokens delivered so far
    last_token_time: float | None = None


@dataclass
class _Inbox:
    """Commands for the engine loop, in the order they were given, and its
    state; guarded by ``AsyncLLM._cond``."""

    commands: list[_Add | _Abort] = field(default_factory=list)
    closing: bool = False
    dead: BaseException | None = None


class RequestStream:
    """A group's outputs: ``async for index, delta in stream``. Ends when
    every member has finished; raises what killed the engine if it died."""

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
        item = await self._queue.get()
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
        engine: EngineCore,
        tokenizer: Any,
        stat_logger: PrometheusStatLogger | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.stat_logger = stat_logger
        self._inbox = _Inbox()
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(
            target=self._run, name="vllm-engine-loop", daemon=True
        )

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def dead(self) -> bool:
        return self._inbox.dead is not None

    # -- the asyncio side ----------------------------------------------------

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will read
        the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def shutdown(self) -> None:
        """Refuse new requests, finish those in flight, stop the loop."""
        with self._cond:
            self._inbox.closing = True
            self._cond.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    async def add_requests(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> RequestStream:
        """Admit one request per (prompt, params) pair, all or none."""
        assert self._loop is not None, "AsyncLLM.start() first"
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        requests = [
            Request(str(next(self._ids)), list(ids), p, eos)
            for ids, p in zip(prompts, params, strict=True)
        ]
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        admitted = self._loop.create_future()
        ids = [r.request_id for r in requests]
        with self._cond:
            if self._inbox.dead is not None:
                raise EngineDeadError(str(self._inbox.dead))
            if self._inbox.closing:
                raise EngineDeadError("the server is shutting down")
            arrival = time.monotonic()
            self._inbox.commands.append(_Add(requests, queue, admitted, arrival))
            self._cond.notify()
        try:
            await admitted
        except asyncio.CancelledError:
            self._abort(ids)  # queued after the add: undoes it
            raise
        return RequestStream(self, ids, queue)

    def _abort(self, request_ids: list[str]) -> None:
        """Thread-safe: abort these requests (unknown or finished ones are
        ignored)."""
        with self._cond:
            self._inbox.commands.append(_Abort(request_ids))
            self._cond.notify()

    # -- the engine loop -----------------------------------------------------

    def _run(self) -> None:
        try:
            while (commands := self._next_commands()) is not None:
                for command in commands:
                    if isinstance(command, _Add):
                        self._admit(command)
                    else:
                        self._apply_abort(command)
                if self.engine.has_unfinished_requests():
                    self.engine.step()
                    self._publish()
                self._record_scheduler()
        except Exception as e:
            logger.exception("engine loop failed; failing every request")
            self._fail_all(e)

    def _next_commands(self) -> list[_Add | _Abort] | None:
        """Wait for work; None once closing and nothing is left."""
        with self._cond:
            inbox = self._inbox
            while not inbox.commands and not self.engine.has_unfinished_requests():
                if inbox.closing:
                    return None
                self._cond.wait()
            commands, inbox.commands = inbox.commands, []
            return commands

    def _admit(self, add: _Add) -> None:
        added: list[Request] = []
        error: Exception | None = None
        try:
            for request in add.requests:
                self.engine.add_request(request)
                added.append(request)
        except Exception as e:  # ValueError: a bad request; others: reported too
            error = e
            for request in added:
                self.engine.finish_request(request.request_id, "abort")
        if error is None:
            for index, request in enumerate(add.requests):
                stop = request.sampling_params.stop_strings
                detokenizer = (
                    None
                    if self.tokenizer is None
                    else IncrementalDetokenizer(self.tokenizer, stop)
                )
                self._tracked[request.request_id] = _Tracked(
                    request, index, add.queue, detokenizer, add.arrival
                )
        self._call_soon(_resolve, add.admitted, error)

    def _apply_abort(self, abort: _Abort) -> None:
        now = time.monotonic()
        for request_id in abort.request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                continue  # finished already, or never admitted
            self.engine.finish_request(request_id, "abort")  # frees its blocks
            if self.stat_logger is not None:
                self.stat_logger.record_finished(now - tracked.arrival, "abort")

    def _publish(self) -> None:
        """Hand every request's new tokens and text to its stream."""
        now = time.monotonic()
        deliveries: list[tuple[asyncio.Queue[StreamItem], StreamItem]] = []
        for request_id, tracked in list(self._tracked.items()):
            request = tracked.request
            new = request.output_token_ids[tracked.num_sent :]
            if not new and request.finish_reason is None:
                continue  # still in prefill, or preempted
            text = self._detokenize(tracked, new)
            self._record_tokens(tracked, len(new), now)
            tracked.num_sent += len(new)
            finished = request.finish_reason is not None
            logprobs = None
            if request.sampling_params.logprobs is not None:
                start = tracked.num_sent - len(new)
                logprobs = [
                    {token: lp, **top}
                    for token, lp, top in zip(
                        new,
                        request.output_logprobs[start:],
                        request.top_logprobs[start:],
                        strict=True,
                    )
                ]
            output = CompletionOutput(text, new, request.finish_reason, logprobs)
            delta = RequestOutput(
                request_id, None, request.prompt_token_ids, [output], finished
            )
            deliveries.append((tracked.queue, (tracked.index, delta)))
            if finished:
                del self._tracked[request_id]
                if self.stat_logger is not None:
                    reason = request.finish_reason or "abort"
                    self.stat_logger.record_finished(now - tracked.arrival, reason)
        if deliveries:
            self._call_soon(_deliver, deliveries)

    def _detokenize(self, tracked: _Tracked, new: list[int]) -> str | None:
        """The new text; finishes the request when a stop string appears
        (also when the token that completed it was its last)."""
        detokenizer, request = tracked.detokenizer, tracked.request
        if detokenizer is None:
            return None
        text = detokenizer.update(new)
        if detokenizer.stopped:
            self.engine.finish_request(request.request_id, "stop")
            request.finish_reason = "stop"
        elif request.finish_reason is not None:
            text += detokenizer.flush()
        return text

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

    def _record_scheduler(self) -> None:
        if self.stat_logger is None:
            return
        stats = self.engine.stats()
        self.stat_logger.record_scheduler(
            stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage
        )

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight and every pending add gets the error."""
        dead = EngineDeadError(f"engine loop failed: {error!r}")
        with self._cond:
            self._inbox.dead = dead
            pending, self._inbox.commands = self._inbox.commands, []
        queues = {id(t.queue): t.queue for t in self._tracked.values()}
        self._tracked.clear()
        self._call_soon(_deliver, [(q, dead) for q in queues.values()])
        for command in pending:
            if isinstance(command, _Add):
                self._call_soon(_resolve, command.admitted, dead)

    def _call_soon(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.cancelled():
        return  # the caller gave up; its abort follows the add in the inbox
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(
    deliveries: list[tuple[asyncio.Queue[StreamItem], StreamItem]],
) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
