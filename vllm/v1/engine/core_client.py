"""The engine behind :class:`~vllm.v1.engine.async_llm.AsyncLLM`: on a
thread of the caller's process, or in a process of its own.

Why a process: the engine's step loop is Python between the GPU's work
(scheduling, the batch's inputs, the sampled tokens) and so is a server's
per-token work (one server-sent event per request per step). In one
interpreter they share the GIL, so a loaded server's event writes would
delay its own steps. In a process of its own (vLLM v1's
``EngineCoreProc``) the engine has its own interpreter and core.

Both clients run the same loop (:func:`serve_engine`) over the same engine
side (:class:`EngineCoreLoop`): commands in order (add a group of
requests, abort requests, shut down), a step whenever work is left, and
events out: :class:`Added` per group (all admitted, or the error that
refused them all), :class:`EngineCoreOutputs` per step (each request's new
tokens, log-probs and finish reason; aborted requests end with "abort") and
:class:`Dead` if a step raised. ``Shutdown`` lets the requests in flight
finish first. :class:`InprocClient` calls the frontend's handler on its
loop thread; :class:`MPClient` pickles the events through a pipe to a
reader thread that calls it. The engine process ignores SIGINT and SIGTERM
(the server drains and then stops it) and exits when the pipe closes (the
server died).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from vllm.logger import init_logger
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore, SchedulerStats, StepShape
from vllm.v1.request import Request

logger = init_logger(__name__)

# -- commands (frontend -> engine) and events (engine -> frontend) ------------


@dataclass
class AddRequests:
    group_id: int
    requests: list[Request]


@dataclass
class AbortRequests:
    request_ids: list[str]
    reason: str = "abort"  # "stop": the frontend found a stop string


@dataclass
class Shutdown:
    drain: bool = True  # finish the requests in flight first


Command = AddRequests | AbortRequests | Shutdown


@dataclass
class Added:
    group_id: int
    error: Exception | None  # None: every request of the group was admitted


@dataclass
class EngineCoreOutput:
    """One request's progress since its last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None  # None unless the request asked for them
    new_top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    # In a request's first output: under prompt_logprobs, those; and the
    # prompt tokens found in the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int | None = None
    stop_token: int | None = None  # of stop_token_ids, that finished it


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


@dataclass
class Dead:
    error: str  # what a step raised (or how the engine process ended)


Event = Added | EngineCoreOutputs | Dead

# -- the engine side ------------------------------------------------------------


class EngineCoreLoop:
    """An engine and the requests it reports on."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._sent: dict[str, tuple[Request, int]] = {}  # request, tokens reported

    def add(self, requests: list[Request]) -> Exception | None:
        """Admit the group whole, or none of it and return why."""
        added: list[Request] = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request)
        except Exception as e:  # ValueError: a bad request; others reported too
            self.engine.finish_requests([r.request_id for r in added], "abort")
            return e
        self._sent.update((r.request_id, (r, 0)) for r in requests)
        return None

    def abort(self, request_ids: list[str], reason: str) -> None:
        """Finish these requests (unknown or finished ones are ignored); the
        next outputs end them with ``reason``."""
        known = [request_id for request_id in request_ids if request_id in self._sent]
        self.engine.finish_requests(known, reason)

    def abort_all(self) -> None:
        self.abort(list(self._sent), "abort")

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def outputs(self) -> EngineCoreOutputs:
        """Every request's news since the last call."""
        outputs = []
        for request_id, (request, num_sent) in list(self._sent.items()):
            new = request.output_token_ids[num_sent:]
            if not new and request.finish_reason is None:
                continue  # still in prefill, or preempted
            params = request.sampling_params
            wants_logprobs = params.logprobs is not None
            first_with_prompt = num_sent == 0 and params.prompt_logprobs is not None
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new,
                    request.output_logprobs[num_sent:] if wants_logprobs else None,
                    request.top_logprobs[num_sent:] if wants_logprobs else None,
                    request.finish_reason,
                    # a copy: an abort may come before the last rows resolve
                    list(request.prompt_logprobs) if first_with_prompt else None,
                    request.num_cached_tokens if num_sent == 0 else None,
                    # (stop strings are the client's: it detokenizes)
                    request.stop_reason
                    if isinstance(request.stop_reason, int)
                    else None,
                )
            )
            if request.finish_reason is None:
                self._sent[request_id] = (request, num_sent + len(new))
            else:
                del self._sent[request_id]
        return EngineCoreOutputs(outputs, self.engine.stats())


class Inbox:
    """Commands in the order they were sent, from any thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def put(self, command: Command) -> None:
        self._queue.put(command)

    def take(self, block: bool) -> list[Command]:
        """Every command waiting (at least one when ``block``)."""
        commands = [self._queue.get()] if block else []
        while True:
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                return commands


@dataclass
class LoopTimes:
    """Where the engine loop's time went since the last report: steps (and
    of them the decode-only ones, which replay CUDA graphs, and the tokens
    computed), the events out (building and sending: a frontend that falls
    behind shows here, its pipe full), and waiting for commands."""

    steps: int = 0
    step_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    tokens: int = 0
    emit_s: float = 0.0
    wait_s: float = 0.0
    since: float = field(default_factory=time.monotonic)

    def add_step(self, shape: StepShape, seconds: float) -> None:
        self.steps += 1
        self.step_s += seconds
        self.tokens += shape.tokens
        if shape.decode_only:
            self.decode_steps += 1
            self.decode_s += seconds

    def report_due(self, now: float) -> bool:
        return now - self.since >= LOG_INTERVAL_S

    def log(self, stats: SchedulerStats, now: float) -> None:
        per_step = 1e3 / max(self.steps, 1)
        queries = stats.prefix_cache_queries  # none: caching off, or no request yet
        hit_rate = f"{100 * stats.prefix_cache_hits / queries:.1f}%" if queries else "-"
        logger.info(
            "engine loop: %d steps in %.1f s (step %.1f ms, %d decode-only at "
            "%.1f ms, %.0f tokens/step; events out %.1f ms, waiting %.1f s); "
            "%d running, %d waiting, KV cache %.0f%% used, prefix cache hit "
            "rate %s since start",
            self.steps, now - self.since, self.step_s * per_step,
            self.decode_steps, self.decode_s * 1e3 / max(self.decode_steps, 1),
            self.tokens / max(self.steps, 1), self.emit_s * per_step, self.wait_s,
            stats.num_running_reqs, stats.num_waiting_reqs,
            100 * stats.kv_cache_usage,
            hit_rate,
        )  # fmt: skip


LOG_INTERVAL_S = 10.0


def serve_engine(
    core: EngineCoreLoop, inbox: Inbox, emit: Callable[[Event], None]
) -> None:
    """The engine loop, until a ``Shutdown`` with nothing left to finish (or
    without draining). Anything that raises in it (a step, the handler of
    an event) emits :class:`Dead` and ends it: callers never wait on a loop
    that is gone. While busy it logs :class:`LoopTimes` every
    ``LOG_INTERVAL_S``."""
    try:
        _loop(core, inbox, emit)
    except Exception as e:
        logger.exception("engine loop failed")
        with contextlib.suppress(Exception):  # the handler may be what failed
            emit(Dead(repr(e)))


def _loop(core: EngineCoreLoop, inbox: Inbox, emit: Callable[[Event], None]) -> None:
    closing = False
    times = LoopTimes()
    while not (closing and not core.has_work()):
        start = time.monotonic()
        commands = inbox.take(block=not core.has_work())
        times.wait_s += time.monotonic() - start
        for command in commands:
            if isinstance(command, AddRequests):
                emit(Added(command.group_id, core.add(command.requests)))
            elif isinstance(command, AbortRequests):
                core.abort(command.request_ids, command.reason)
            else:
                closing = True
                if not command.drain:
                    core.abort_all()
        start = time.monotonic()
        if core.has_work():
            core.engine.step()
            times.add_step(core.engine.last_step, time.monotonic() - start)
        stepped = time.monotonic()
        outputs = core.outputs()
        emit(outputs)
        now = time.monotonic()
        times.emit_s += now - stepped
        if times.report_due(now):
            if times.steps:
                times.log(outputs.stats, now)
            times = LoopTimes(since=now)


# -- the clients ------------------------------------------------------------------


class EngineCoreClient(ABC):
    """How :class:`~vllm.v1.engine.async_llm.AsyncLLM` reaches its engine."""

    max_model_len: int

    @abstractmethod
    def start(self, on_event: Callable[[Event], None]) -> None:
        """Start the loop; ``on_event`` is called with every event in
        order, on one thread that is not the caller's."""

    @abstractmethod
    def send(self, command: Command) -> None:
        """Thread-safe, never blocks for long."""

    @abstractmethod
    def join(self) -> None:
        """Wait for the loop to end (after a ``Shutdown``, or death)."""


class InprocClient(EngineCoreClient):
    """The engine on a thread of this process (tests; the engine stays
    inspectable)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self._inbox = Inbox()
        self._thread: threading.Thread | None = None

    def start(self, on_event: Callable[[Event], None]) -> None:
        core = EngineCoreLoop(self.engine)
        self._thread = threading.Thread(
            target=serve_engine,
            args=(core, self._inbox, on_event),
            name="vllm-engine-loop",
            daemon=True,
        )
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


@dataclass
class _Ready:
    max_model_len: int


@dataclass
class _StartupError:
    error: Exception  # a ValueError names the setting the engine refused


def limit_cpu_threads(config: EngineConfig) -> None:
    """A GPU engine's host tensors are a step's few hundred ids: one CPU
    thread each op. More only spin (OpenMP waits busy) on the cores the
    server and its clients need, as vLLM's engine processes avoid too;
    ``OMP_NUM_THREADS`` overrides."""
    if (
        torch.device(config.device).type == "cuda"
        and "OMP_NUM_THREADS" not in os.environ
    ):
        logger.info(
            "engine process: torch CPU threads %d -> 1", torch.get_num_threads()
        )
        torch.set_num_threads(1)


def _engine_process_main(config: EngineConfig, conn: Connection) -> None:
    """The engine process: build the engine, then serve the pipe."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    limit_cpu_threads(config)
    from vllm.v1.engine.dp_engine import DPEngineCore

    try:
        engine_cls = DPEngineCore if config.world_size > 1 else EngineCore
        engine = engine_cls(config)
    except Exception as e:
        if not isinstance(e, ValueError):  # a bad setting needs no traceback
            logger.exception("engine startup failed")
        conn.send(_StartupError(e))
        return
    conn.send(_Ready(engine.max_model_len))
    inbox = Inbox()

    def read_commands() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError):  # the server is gone: stop at once
                inbox.put(Shutdown(drain=False))
                return

    threading.Thread(
        target=read_commands, name="vllm-engine-input", daemon=True
    ).start()

    def emit(event: Event) -> None:
        try:
            conn.send(event)
        except (BrokenPipeError, OSError):
            inbox.put(Shutdown(drain=False))

    try:
        serve_engine(EngineCoreLoop(engine), inbox, emit)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:  # data-parallel ranks
            shutdown()


class MPClient(EngineCoreClient):
    """The engine in a spawned process of its own; construction returns
    once the engine is built, or raises what stopped it: the engine's
    ``ValueError`` (a setting it refused, by name) as is, anything else as
    a ``RuntimeError``.

    :meth:`send` only queues: one writer thread owns the pipe's sending end,
    so a send never blocks the event loop and a stream's finalizer may send
    an abort from anywhere (even inside another send). At interpreter exit
    the pipe is closed first, so the engine stops and the exit's join of
    child processes does not wait on it."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        # Not a daemon: a data-parallel engine starts processes of its own.
        self.process = context.Process(
            target=_engine_process_main, args=(config, child), name="vllm-engine"
        )
        self.process.start()
        child.close()
        atexit.register(_close_at_exit, self._conn, self.process)
        try:
            ready = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine process exited with code {self.process.exitcode} "
                "before it was ready"
            ) from None
        except BaseException:  # a signal while the model loads: stop it now
            self.process.kill()
            self.process.join()
            raise
        if isinstance(ready, _StartupError):
            self.process.join()
            if isinstance(ready.error, ValueError):  # vllm serve: a usage error
                raise ValueError(str(ready.error))
            raise RuntimeError(f"the engine failed to start: {ready.error!r}")
        self.max_model_len = ready.max_model_len
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_commands, name="vllm-engine-commands", daemon=True
        )
        self._writer.start()
        self._reader: threading.Thread | None = None

    def _write_commands(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError):
                return  # the engine is gone: the reader reports its death

    def start(self, on_event: Callable[[Event], None]) -> None:
        def read_events() -> None:
            try:
                while True:
                    on_event(self._conn.recv())
            except (EOFError, OSError):  # the engine process ended
                self.process.join(timeout=5)
                code = self.process.exitcode
                if code != 0:
                    on_event(Dead(f"the engine process exited with code {code}"))
            except Exception as e:  # a bad event, or a handler that raised
                logger.exception("engine events: reading failed")
                self.process.kill()
                with contextlib.suppress(Exception):
                    on_event(Dead(f"reading the engine's events failed: {e!r}"))

        self._reader = threading.Thread(
            target=read_events, name="vllm-engine-output", daemon=True
        )
        self._reader.start()

    def send(self, command: Command) -> None:
        self._outbox.put(command)

    def join(self) -> None:
        # The reader reaps the process once its pipe ends; joining it first
        # leaves one thread waiting on the process.
        if self._reader is not None:
            self._reader.join()
        self.process.join()
        self._outbox.put(None)
        self._writer.join()
        self._conn.close()


def _close_at_exit(conn: Connection, process: BaseProcess) -> None:
    """At interpreter exit: end the engine (its pipe closes) before the
    exit's join of child processes, killing it if it does not stop."""
    if process.is_alive():
        conn.close()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
