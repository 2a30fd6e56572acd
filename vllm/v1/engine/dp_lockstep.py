"""The lockstep protocol of an engine's ranks: what rank 0 orders each step
(:class:`StepCommand`: new requests and aborts per rank) and what every rank
reports back (:class:`RankReport`: its new tokens and scheduler state), over
two gloo groups of all ranks (:class:`ControlGroups`). Failures of these
collectives surface as :class:`~vllm.distributed.CollectiveError`.
"""

from __future__ import annotations

import pickle
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


@dataclass
class ControlGroups:
    """gloo groups of all ranks for the step protocol's Python objects:
    ``commands`` waits without a bound (see ``_IDLE_TIMEOUT``), ``reports``
    under the engine's collective timeout."""

    commands: ProcessGroup
    reports: ProcessGroup

    @classmethod
    def create(cls, timeout: timedelta) -> ControlGroups:
        # Every rank calls new_group in the same order.
        commands = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        reports = dist.new_group(backend="gloo", timeout=timeout)
        return cls(commands, reports)

    def broadcast_command(self, command: StepCommand | None) -> StepCommand:
        """Rank 0 sends ``command``; the others pass None and receive it. A
        command without orders (a steady decode step's) is one broadcast of
        one number; others follow it pickled (a loopback collective costs
        0.3-0.8 ms on the development machine)."""
        orders = command is not None and (
            command.stop or any(command.adds) or any(command.aborts)
        )
        flag = torch.tensor([int(orders)])
        _collective(
            "broadcast of the step's commands",
            lambda: dist.broadcast(flag, src=0, group=self.commands),
        )
        if not flag.item():
            size = dist.get_world_size(self.commands)
            return StepCommand([[] for _ in range(size)], [[] for _ in range(size)])
        box: list[Any] = [command]
        _collective(
            "broadcast of the step's commands",
            lambda: dist.broadcast_object_list(box, src=0, group=self.commands),
        )
        result = box[0]
        assert isinstance(result, StepCommand)
        return result

    def gather(self, what: str, obj: T, rank: int) -> list[T]:
        """Every rank's ``obj`` on rank 0 (in rank order); [] elsewhere.

        One all-gather of fixed-size byte blocks (a length, then the
        pickle) where every rank's object fits :data:`_GATHER_BYTES` (a
        step's report does, but for hundreds of requests with top
        log-probabilities); else a second round gathers the objects
        whole."""
        payload = pickle.dumps(obj)
        block = torch.zeros(8 + _GATHER_BYTES, dtype=torch.uint8)
        fits = len(payload) <= _GATHER_BYTES
        block[:8] = torch.tensor([len(payload) if fits else -1]).view(torch.uint8)
        if fits:
            block[8 : 8 + len(payload)] = torch.frombuffer(
                bytearray(payload), dtype=torch.uint8
            )
        size = dist.get_world_size(self.reports)
        blocks = [torch.empty_like(block) for _ in range(size)]
        _collective(
            f"gather of the ranks' {what}",
            lambda: dist.all_gather(blocks, block, group=self.reports),
        )
        lengths = [int(b[:8].view(torch.int64)) for b in blocks]
        if min(lengths) < 0:
            out: list[Any] | None = [None] * size if rank == 0 else None
            _collective(
                f"gather of the ranks' {what}",
                lambda: dist.gather_object(obj, out, dst=0, group=self.reports),
            )
            return list(out or [])
        if rank != 0:
            return []
        return [
            pickle.loads(b[8 : 8 + n].numpy().tobytes())
            for b, n in zip(blocks, lengths, strict=True)
        ]


def _collective(op: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as e:
        raise CollectiveError(
            f"{op} failed: a data-parallel rank died or stopped answering: {e}"
        ) from e
