"""The lockstep protocol of an engine's ranks: what rank 0 orders each step
(:class:`StepCommand`: new requests and aborts per rank) and what every
other rank reports (:class:`RankReport`: its new tokens and scheduler
state), both in one exchange per step over a gloo group of all ranks
(:class:`ControlGroups`): a worker's report of step N travels with rank 0's
command for step N + 1. Failures of these collectives surface as
:class:`~vllm.distributed.CollectiveError`.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from vllm.distributed import CollectiveError
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

T = TypeVar("T")

_GATHER_BYTES = 64 * 1024
_IDLE_TIMEOUT = timedelta(days=365)
"""Workers wait this long for rank 0's next step: a server may idle for
hours between requests; a dead rank 0 still ends the wait at once."""


@dataclass(frozen=True)
class NewRequest:
    """What a rank needs to rebuild a request (no generator: the owning
    rank seeds its own)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_id,
        )


@dataclass(frozen=True)
class StepCommand:
    """Rank 0's orders for one step, per rank; ``stop`` ends the workers."""

    adds: list[list[NewRequest]]
    aborts: list[list[tuple[str, str]]]  # (request_id, reason)
    stop: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """A request's tokens produced in a step (and its finish reason)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None


@dataclass(frozen=True)
class RankReport:
    deltas: list[TokenDelta]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # the rank's scheduler's, since the start
    prefix_cache_hits: int


@dataclass
class ControlGroups:
    """gloo groups of all ranks for the step protocol's Python objects:
    ``steps`` carries the exchanges of every step (workers wait for rank 0
    without a bound, see ``_IDLE_TIMEOUT``; rank 0 waits at most
    ``timeout``), ``startup`` the gathers before the first step (under
    ``timeout``)."""

    steps: ProcessGroup
    startup: ProcessGroup
    timeout: timedelta

    @classmethod
    def create(cls, timeout: timedelta) -> ControlGroups:
        # Every rank calls new_group in the same order.
        steps = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        startup = dist.new_group(backend="gloo", timeout=timeout)
        return cls(steps, startup, timeout)

    def exchange(self, message: Any, rank: int) -> list[Any]:
        """Every rank's ``message`` on every rank, in rank order: rank 0's
        :class:`StepCommand` and the others' :class:`RankReport` of their
        previous step. One collective per step (a loopback one costs
        0.3-1.5 ms on the development machine; two did before)."""
        wait = self.timeout if rank == 0 else None
        return _all_gather_objects(self.steps, "step exchange", message, wait)

    def gather(self, what: str, obj: T) -> list[T]:
        """Every rank's ``obj`` on every rank, in rank order (start-up)."""
        return _all_gather_objects(self.startup, what, obj, None)


def _all_gather_objects(
    group: ProcessGroup, what: str, obj: Any, wait: timedelta | None
) -> list[Any]:
    """One all-gather of fixed-size byte blocks (a length, then the pickle)
    where every rank's object fits :data:`_GATHER_BYTES` (a step's does, but
    for hundreds of new requests or requests with top log-probabilities);
    else a second round of the longest's size. ``wait``: the longest wait
    for both rounds together (None: the group's timeout for each)."""
    deadline = None if wait is None else time.monotonic() + wait.total_seconds()
    payload = pickle.dumps(obj)
    block = torch.zeros(8 + _GATHER_BYTES, dtype=torch.uint8)
    block[:8] = torch.tensor([len(payload)]).view(torch.uint8)
    fits = len(payload) <= _GATHER_BYTES
    if fits:
        block[8 : 8 + len(payload)] = _bytes(payload)
    blocks = _all_gather(group, what, block, deadline)
    lengths = [int(b[:8].view(torch.int64)) for b in blocks]
    bodies = [b[8:] for b in blocks]
    if max(lengths) > _GATHER_BYTES:
        whole = torch.zeros(max(lengths), dtype=torch.uint8)
        whole[: len(payload)] = _bytes(payload)
        bodies = _all_gather(group, what, whole, deadline)
    return [
        pickle.loads(body[:n].numpy().tobytes())
        for body, n in zip(bodies, lengths, strict=True)
    ]


def _bytes(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _all_gather(
    group: ProcessGroup, what: str, tensor: torch.Tensor, deadline: float | None
) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    op = f"{what} of the ranks"

    def gather() -> None:
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        assert work is not None
        if deadline is None:
            work.wait()
        else:
            left = max(0.0, deadline - time.monotonic())
            work.wait(timedelta(seconds=left))

    _collective(op, gather)
    return out


def _collective(op: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as e:
        raise CollectiveError(
            f"{op} failed: a data-parallel rank died or stopped answering: {e}"
        ) from e
