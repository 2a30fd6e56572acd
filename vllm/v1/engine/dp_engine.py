"""Data / tensor + expert parallelism on one node: N engine ranks stepped in
lockstep.

:class:`DPEngineCore` has :class:`~vllm.v1.engine.core.EngineCore`'s
interface, so ``LLM`` and ``AsyncLLM`` drive it unchanged. The calling
process is rank 0: it *is* rank 0's ``EngineCore`` (``model``, ``device``,
``max_model_len``, ``pool``, ``runner``, ``scheduler`` are rank 0's) and
extends the request-level methods (``add_request``, ``step``,
``finish_request``, ``has_unfinished_requests``, ``stats``) to all ranks.

Contract:

- Construction spawns ranks 1..N-1 (``torch.multiprocessing``, spawn). Every
  rank joins one ``torch.distributed`` world on 127.0.0.1 (NCCL with GPU
  ``cuda:{rank}`` on CUDA, gloo on CPU), carves it with
  ``initialize_model_parallel(tp, dp)`` and builds its own ``EngineCore``
  (workspace manager, experts of its shard, profile run, KV cache, lock):
  the profile runs meet in the MoE layers' collectives, then every rank
  captures the same CUDA graphs (see ``EngineCore``). Every rank's workspace
  report at lock reaches every rank (rank 0 keeps them as
  ``workspace_reports``, in rank order).
- Rank 0 assigns each new request to the data-parallel rank with the fewest
  live requests (the lowest such rank) and holds the caller's ``Request``.
  A data-parallel rank is a tensor-parallel group of ``tp`` consecutive
  ranks (one rank without tensor parallelism): every rank of the group gets
  the request (and its abort) and runs the same steps; the group's first
  rank reports its tokens.
- Each ``step()``: one exchange over a gloo group of all ranks carries
  rank 0's commands for the step (new requests per rank, aborts per rank)
  and every other rank's report of its previous step (new tokens, finish
  reasons, scheduler state), which rank 0 appends to the caller's requests;
  then every rank applies its commands and steps its engine, or runs a
  dummy forward when it has nothing to run (a replay of padding where the
  ranks replay graphs), so that all ranks call every MoE layer once.
  ``step()`` returns the requests that finished in it on rank 0 and in the
  step before on the others (each one step later again with async
  scheduling): their tokens reach the caller one step late
  (one more step, of dummies, ends a run; under tensor parallelism it also
  checks the peers' last tokens).
- ``finish_request`` of another rank's request finishes the caller's copy
  at once and frees the rank's blocks at the next step, which ``stats()``
  shows after the step after it (pending commands and owed reports count
  as unfinished work, so callers step again).
- Scheduler limits (``max_num_seqs``, ``max_num_batched_tokens``, the KV
  cache) are per rank.
- Failures: collectives run under ``distributed_timeout_s``. When a rank dies
  or a step fails, rank 0 raises :class:`DPEngineDeadError` (naming dead
  ranks and their exit codes) within that timeout (a worker's failure in
  its step at rank 0's next step), stops the other ranks and refuses
  further steps. A worker found dead before a step fails it
  at once; on CUDA, a death during a step's NCCL collectives may instead
  end rank 0 through NCCL's watchdog at the timeout (see
  :mod:`vllm.distributed.parallel_state`). Workers waiting for the next
  step wait without a bound (an idle server sends no steps) but leave at
  once when rank 0's process goes away (its connections close).
- ``shutdown()`` (also on garbage collection and at exit) stops the workers
  and leaves the world. One ``DPEngineCore`` per process at a time: the
  ``torch.distributed`` world is process-global.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.distributed import (
    CollectiveError,
    destroy_distributed_environment,
    get_distributed_init_method,
    get_open_port,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.logger import init_logger
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore, SchedulerStats, StepShape
from vllm.v1.engine.core_client import limit_cpu_threads
from vllm.v1.engine.dp_lockstep import (
    ControlGroups,
    NewRequest,
    RankReport,
    StepCommand,
    TokenDelta,
)
from vllm.v1.request import Request

logger = init_logger(__name__)

T = TypeVar("T")

_HOST = "127.0.0.1"  # one node
_JOIN_TIMEOUT_S = 30.0  # for workers told to stop
_EXIT_GRACE_S = 1.0  # see _Workers.reap


class DPEngineDeadError(RuntimeError):
    """A rank died or a lockstep step failed: the engine is stopped."""


def _report(engine: EngineCore, deltas: list[TokenDelta]) -> RankReport:
    pool, scheduler = engine.pool, engine.scheduler
    return RankReport(
        deltas,
        len(scheduler.running),
        len(scheduler.waiting),
        pool.num_blocks - pool.num_free_blocks,
        pool.num_blocks,
        scheduler.prefix_cache_queries,
        scheduler.prefix_cache_hits,
    )


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank ``rank``'s engine config: its own GPU on CUDA."""
    if torch.device(config.device).type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def _join_world(config: EngineConfig, rank: int, port: int) -> ControlGroups:
    timeout = timedelta(seconds=config.distributed_timeout_s)
    cuda = torch.device(config.device).type == "cuda"
    init_distributed_environment(
        config.world_size,
        rank,
        get_distributed_init_method(_HOST, port),
        backend="nccl" if cuda else "gloo",
        timeout=timeout,
    )
    num_ubatches = 2 if config.enable_dbo else 1
    initialize_model_parallel(
        config.tensor_parallel_size, config.data_parallel_size, num_ubatches
    )
    return ControlGroups.create(timeout)


def _step_once(engine: EngineCore) -> list[Request]:
    """This rank's share of a lockstep step (its own engine's: rank 0
    overrides ``step``): a step, and a dummy forward where that launched
    none (no requests; with async scheduling, only the last step's to
    resolve), so that every rank calls every MoE layer once."""
    if EngineCore.has_unfinished_requests(engine):
        finished = EngineCore.step(engine)
    else:
        finished = []
        engine.last_step = StepShape(0, 0)
    if not engine.last_step.tokens:
        engine.execute_dummy_batch()
    return finished


# -- ranks 1..N-1 ------------------------------------------------------------


@dataclass
class _WorkerState:
    """A worker rank's live requests and the output tokens rank 0 has."""

    requests: dict[str, Request] = field(default_factory=dict)
    num_sent: dict[str, int] = field(default_factory=dict)

    def apply(self, engine: EngineCore, command: StepCommand, rank: int) -> None:
        # Adds first: an abort in the same command may name a new request.
        for new in command.adds[rank]:
            request = new.to_request()
            engine.add_request(request)
            self.requests[new.request_id] = request
            self.num_sent[new.request_id] = 0
        for request_id, reason in command.aborts[rank]:
            engine.finish_request(request_id, reason)  # frees its blocks
            self.requests.pop(request_id, None)
            self.num_sent.pop(request_id, None)

    def deltas(self) -> list[TokenDelta]:
        """New tokens and finishes since the last call; forgets finished
        requests."""
        out = []
        for request_id, request in list(self.requests.items()):
            start = self.num_sent[request_id]
            if len(request.output_token_ids) == start and not request.finish_reason:
                continue
            out.append(
                TokenDelta(
                    request_id,
                    request.output_token_ids[start:],
                    request.output_logprobs[start:],
                    request.top_logprobs[start:],
                    request.finish_reason,
                )
            )
            self.num_sent[request_id] = len(request.output_token_ids)
            if request.finish_reason is not None:
                del self.requests[request_id], self.num_sent[request_id]
        return out


def _worker_main(config: EngineConfig, rank: int, port: int) -> None:
    """Rank ``rank`` (>= 1): build the engine, then follow rank 0's steps
    until told to stop. Any error ends the process (rank 0 then fails its
    step with the exit code)."""
    # Rank 0 governs this process's life: a terminal's Ctrl-C reaches the
    # whole process group, and rank 0 stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if torch.device(config.device).type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    limit_cpu_threads(config)
    control = _join_world(config, rank, port)
    try:
        engine = EngineCore(_rank_config(config, rank))
        control.gather("workspace reports", engine.workspace_report)
        state = _WorkerState()
        report = _report(engine, [])
        while not (command := control.exchange(report, rank)[0]).stop:
            state.apply(engine, command, rank)
            _step_once(engine)
            report = _report(engine, state.deltas())
    except BaseException:
        # The world is broken (or rank 0 gone): leaving it could block, and
        # no one would stop this process. The traceback is the verdict.
        traceback.print_exc()
        os._exit(1)
    destroy_distributed_environment()


# -- rank 0 ------------------------------------------------------------------


@dataclass
class _Workers:
    """Ranks 1..N-1 as rank 0 sees them; ``stop`` is the finalizer (it must
    not reference the engine)."""

    processes: list[BaseProcess]
    control: ControlGroups | None = None
    stopped: bool = False

    def dead(self) -> list[str]:
        """The workers that exited, named with their exit codes."""
        return [
            f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in enumerate(self.processes, start=1)
            if not p.is_alive()
        ]

    def reap(self) -> list[str]:
        """:meth:`dead` after giving workers on their way out (one that
        raised) a moment to exit, so that errors name them."""
        deadline = time.monotonic() + _EXIT_GRACE_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        return self.dead()

    def stop(self, *, graceful: bool) -> None:
        """Stop every worker (asked to, when ``graceful`` and the world is
        sound; killed otherwise or when they do not leave) and leave the
        world."""
        if self.stopped:
            return
        self.stopped = True
        if graceful and self.control is not None and not self.dead():
            size = len(self.processes) + 1
            try:
                self.control.exchange(
                    StepCommand([[]] * size, [[]] * size, stop=True), 0
                )
            except CollectiveError:
                logger.warning("a data-parallel worker missed the stop command")
        for p in self.processes:
            p.join(_JOIN_TIMEOUT_S if graceful else 0.0)
            if p.is_alive():
                p.kill()
                p.join()
        destroy_distributed_environment()


class DPEngineCore(EngineCore):
    """``data_parallel_size`` x ``tensor_parallel_size`` engine ranks with
    sharded experts, driven from this process (rank 0); see the module
    docstring."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.expert_parallel:
            raise ValueError(
                f"data_parallel_size: DPEngineCore runs > 1 ranks with "
                f"enable_expert_parallel, got data_parallel_size="
                f"{config.data_parallel_size}, tensor_parallel_size="
                f"{config.tensor_parallel_size}, enable_expert_parallel="
                f"{config.enable_expert_parallel}; use EngineCore"
            )
        cuda = torch.device(config.device).type == "cuda"
        if cuda and config.world_size > torch.cuda.device_count():
            raise ValueError(
                f"data_parallel_size x tensor_parallel_size: expected <= the "
                f"{torch.cuda.device_count()} visible GPUs (one per rank), got "
                f"{config.world_size}"
            )
        if dist.is_initialized():
            raise RuntimeError(
                "DPEngineCore: this process is already in a torch.distributed "
                "world (another DPEngineCore?); shut that down first"
            )
        size = config.world_size
        port = get_open_port(_HOST)
        ctx = mp.get_context("spawn")
        workers = _Workers(
            [
                ctx.Process(
                    target=_worker_main,
                    args=(config, rank, port),
                    name=f"vllm-dp-rank{rank}",
                    daemon=True,  # never outlive the front process
                )
                for rank in range(1, size)
            ]
        )
        for p in workers.processes:
            p.start()
        self._workers = workers
        self._finalizer = weakref.finalize(self, workers.stop, graceful=True)
        try:
            workers.control = _join_world(config, 0, port)
            super().__init__(_rank_config(config, 0))
            self.workspace_reports = workers.control.gather(
                "workspace reports", self.workspace_report
            )
        except BaseException as e:
            dead = workers.reap()
            workers.stop(graceful=False)
            # A refused configuration fails every rank alike: say why.
            if dead and not isinstance(e, ValueError):
                raise DPEngineDeadError(
                    f"data-parallel engine: start-up failed; {'; '.join(dead)}"
                ) from e
            raise
        self._tp = config.tensor_parallel_size
        # id -> (data-parallel rank, request), for ranks other than this one's
        self._remote: dict[str, tuple[int, Request]] = {}
        self._adds: list[list[NewRequest]] = [[] for _ in range(size)]
        self._aborts: list[list[tuple[str, str]]] = [[] for _ in range(size)]
        # ranks 1..N-1 as of their previous step (their reports come with
        # the next step's exchange)
        self._peer_reports = [_report(self, [])] * (size - 1)
        # a report the caller still waits for: the one of the step that
        # carried an abort, or a tensor-parallel peer's of the last tokens
        self._report_owed = False
        self._dead: BaseException | None = None

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes of ranks 1..N-1."""
        return self._workers.processes

    def shutdown(self) -> None:
        """Stop the workers and leave the world (idempotent)."""
        self._finalizer()

    # -- requests ------------------------------------------------------------

    def _ranks(self, dp_rank: int) -> range:
        """The ranks of data-parallel rank ``dp_rank``'s tensor-parallel
        group (one rank without tensor parallelism), which all run its
        requests; this process is rank 0."""
        return range(dp_rank * self._tp, (dp_rank + 1) * self._tp)

    def _load(self, dp_rank: int) -> int:
        if dp_rank == 0:
            return len(self.scheduler.running) + len(self.scheduler.waiting)
        return sum(1 for r, _ in self._remote.values() if r == dp_rank)

    def add_request(self, request: Request) -> None:
        """Check ``request`` and queue it on the least-loaded data-parallel
        rank (every rank of its tensor-parallel group)."""
        self._check_alive()
        self.check_request(request)
        request_id = request.request_id
        if request_id in self._remote or self.scheduler.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        if any(request_id == r for aborts in self._aborts for r, _ in aborts):
            # the ranks apply a step's adds before its aborts
            raise ValueError(
                f"request_id: {request_id!r} is being aborted until the next step"
            )
        dp_rank = min(range(self.config.data_parallel_size), key=self._load)
        new = NewRequest(
            request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
        )
        for rank in self._ranks(dp_rank):
            if rank == 0:
                super().add_request(request)
            else:
                self._adds[rank].append(new)
        if dp_rank != 0:
            self._remote[request_id] = (dp_rank, request)

    def finish_request(self, request_id: str, reason: str = "abort") -> None:
        """Finish the request now; other ranks free its blocks at the next
        step. A no-op for unknown or finished requests."""
        if request_id in self._remote:
            dp_rank, request = self._remote.pop(request_id)
            request.finish(reason)
        elif self.scheduler.has_request(request_id):
            dp_rank = 0
            super().finish_request(request_id, reason)
        else:
            return
        for rank in self._ranks(dp_rank):
            if rank != 0:
                self._aborts[rank].append((request_id, reason))

    def finish_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        for request_id in request_ids:
            self.finish_request(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return (
            super().has_unfinished_requests()
            or bool(self._remote)
            or any(self._adds)
            or any(self._aborts)
            or self._report_owed
        )

    def stats(self) -> SchedulerStats:
        """All ranks' requests and KV cache usage (other ranks' as of the
        step before the last: their reports come one step late, and a step
        that changes them is followed by one that brings them)."""
        reports = [_report(self, []), *self._peer_reports[self._tp - 1 :: self._tp]]
        return SchedulerStats(
            sum(r.num_running for r in reports),
            sum(r.num_waiting for r in reports),
            sum(r.num_used_blocks for r in reports)
            / sum(r.num_blocks for r in reports),
            sum(r.prefix_cache_queries for r in reports),
            sum(r.prefix_cache_hits for r in reports),
        )

    # -- the step ------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise DPEngineDeadError(
                f"data-parallel engine: stopped after a failure: {self._dead}"
            )

    def step(self) -> list[Request]:
        """One lockstep step of every rank; the requests that finished in it
        on this rank, and in the step before on the others."""
        self._check_alive()
        if dead := self._workers.dead():  # before collectives that could hang
            self._fail(DPEngineDeadError("; ".join(dead)))
        control = self._workers.control
        assert control is not None
        size = self.config.world_size
        command = StepCommand(self._adds, self._aborts)
        self._adds = [[] for _ in range(size)]
        self._aborts = [[] for _ in range(size)]
        try:
            _, *reports = control.exchange(command, 0)
            self._peer_reports = reports
            # the other ranks' previous step, which was this rank's last one
            for rank in range(1, self._tp):
                self._check_in_step(rank, reports[rank - 1])
            # a tensor-parallel group's first rank reports for all of them
            finished = []
            for report in reports[self._tp - 1 :: self._tp]:
                finished += self._apply(report)
            self.last_tokens = {}
            finished += _step_once(self)
        except Exception as e:
            self._fail(e)
        self._report_owed = any(command.aborts) or (
            self._tp > 1 and bool(self.last_tokens)
        )
        return finished

    def _check_in_step(self, rank: int, report: RankReport) -> None:
        """Fail (rather than go on mixing two sequences' activations, or
        hang at a later collective) when a rank of this process's
        tensor-parallel group sampled other tokens than this one in the
        previous step (its report comes one step late: that step's output
        may already hold one token of the mix)."""
        for delta in report.deltas:
            mine = self.last_tokens.get(delta.request_id)
            if delta.token_ids != ([] if mine is None else [mine]):
                raise DPEngineDeadError(
                    f"tensor-parallel rank {rank} sampled {delta.token_ids} "
                    f"for request {delta.request_id!r} where rank 0 sampled "
                    f"{mine}: the ranks are out of step"
                )

    def _apply(self, report: RankReport) -> list[Request]:
        """Append a rank's new tokens to the caller's requests; those that
        finished."""
        finished = []
        for delta in report.deltas:
            if delta.request_id not in self._remote:
                continue  # finished here meanwhile (an abort in flight)
            _, request = self._remote[delta.request_id]
            for token, logprob, top in zip(
                delta.token_ids, delta.logprobs, delta.top_logprobs, strict=True
            ):
                request.append_token(token, logprob, top)
            if delta.finish_reason is not None:
                request.finish(delta.finish_reason)
                del self._remote[delta.request_id]
                finished.append(request)
        return finished

    def _fail(self, error: Exception) -> NoReturn:
        """Stop every rank and raise: the ranks are out of step now."""
        dead = self._workers.reap()
        self._dead = error
        self._workers.stop(graceful=False)
        if dead:
            raise DPEngineDeadError(
                f"data-parallel engine: {'; '.join(dead)}; stopped all ranks"
            ) from error
        raise DPEngineDeadError(
            f"data-parallel engine: a step failed on rank 0, stopped all ranks: "
            f"{error!r}"
        ) from error
