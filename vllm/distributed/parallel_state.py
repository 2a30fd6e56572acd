"""Process groups of one engine: world, tensor-, data- and expert-parallel.

One process per device. :func:`init_distributed_environment` joins the world
(NCCL on CUDA, gloo on CPU); :func:`initialize_model_parallel` carves it into
groups laid out as vLLM's, ranks = dp x tp:

- tensor-parallel groups: runs of ``tp`` consecutive ranks;
- data-parallel groups: one rank of each tensor-parallel group (stride tp);
- the expert-parallel group: all dp x tp ranks.

Dual-batch overlap runs two micro-batches (ubatches) of a step on two
threads, each calling the MoE layers' collectives. Collectives on one
communicator from two threads could pair ubatch 0 of one rank with ubatch 1
of another, so ``initialize_model_parallel(num_ubatches=2)`` gives the
expert-parallel group (the only one a forward pass calls) a communicator per
ubatch, and a collective runs on the one of the calling thread's ubatch
(:func:`~vllm.v1.worker.ubatching.dbo_current_ubatch_id`).

Each group is a :class:`GroupCoordinator`, read with ``get_world_group()``,
``get_tp_group()``, ``get_dp_group()``, ``get_ep_group()``;
:func:`destroy_model_parallel` and :func:`destroy_distributed_environment`
tear them down.

Every collective runs under the world's timeout. A peer that died or stopped
answering surfaces as :class:`CollectiveError` naming the group, the operation
and the rank, never as a hang. On gloo the call itself raises (at once for a
closed connection, after the timeout for a silent peer). NCCL collectives are
asynchronous: torch's watchdog aborts the communicator after the timeout, and
with its default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` ends the process with an
error naming the collective; a host-synchronising call on the aborted
communicator raises :class:`CollectiveError` first where it can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.worker.ubatching import collective_turn, dbo_current_ubatch_id

logger = init_logger(__name__)

T = TypeVar("T")

BACKENDS = ("nccl", "gloo")

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""torch's NCCL default: long enough for a peer that JIT-compiles kernels in
its first forward while the others already wait in a collective."""

# torch >= 2.13 renamed the single-tensor collectives; 2.11 (the GPU machine)
# has only the old names, which 2.13 deprecates.
_all_gather_single = getattr(dist, "all_gather_single", None) or (
    dist.all_gather_into_tensor
)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or (
    dist.reduce_scatter_tensor
)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, stopped answering within the
    timeout, or the ranks disagreed on the call."""


def _bytes_for_transport(t: torch.Tensor) -> torch.Tensor:
    """1-byte floats (fp8) as uint8: backends move bytes, but gloo rejects
    the float8 dtypes."""
    if t.dtype.itemsize == 1 and t.is_floating_point():
        return t.view(torch.uint8)
    return t


@dataclass
class GroupCoordinator:
    """One process group as this process sees it.

    ``ranks`` are global ranks in group order; ``device_group`` is None for a
    single-rank group (its collectives are identities).
    """

    name: str
    ranks: list[int]
    rank: int
    device_group: ProcessGroup | None
    backend: str
    device: torch.device
    timeout: timedelta
    # The communicators of ubatches 1, 2, ... (ubatch 0 has device_group).
    ubatch_groups: tuple[ProcessGroup, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    def _group(self) -> ProcessGroup:
        """The communicator of the calling thread's ubatch."""
        assert self.device_group is not None
        ubatch = dbo_current_ubatch_id()
        if ubatch == 0:
            return self.device_group
        if ubatch > len(self.ubatch_groups):
            raise RuntimeError(
                f"ubatch {ubatch}: the {self.name} group has communicators for "
                f"{1 + len(self.ubatch_groups)} ubatches; dual-batch overlap "
                f"needs initialize_model_parallel(num_ubatches=2)"
            )
        return self.ubatch_groups[ubatch - 1]

    def _run(self, op: str, call: Callable[[ProcessGroup], T]) -> T:
        group = self._group()
        try:
            with collective_turn():  # one issue order on every rank
                return call(group)
        except RuntimeError as e:
            raise CollectiveError(
                f"{op} in the {self.name} group (ranks {self.ranks}) failed on "
                f"rank {self.rank} ({self.backend}, timeout "
                f"{self.timeout.total_seconds():g}s): a peer died, stopped "
                f"answering, or called another collective: {e}"
            ) from e

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (a new tensor)."""
        if self.world_size == 1:
            return input_.clone()
        out = input_.clone()
        self._run("all_reduce", lambda g: dist.all_reduce(out, group=g))
        return out

    def all_gather(self, input_: torch.Tensor) -> torch.Tensor:
        """Every rank's ``input_`` (same shape on all ranks) concatenated along
        dim 0 in group order."""
        if self.world_size == 1:
            return input_.clone()
        out = input_.new_empty((self.world_size * input_.shape[0], *input_.shape[1:]))
        send, recv = (
            _bytes_for_transport(input_.contiguous()),
            _bytes_for_transport(out),
        )
        if self.backend == "gloo":
            # gloo's single-tensor all-gather exists only in some torch
            # versions: gather into the output's per-rank row blocks instead
            # (views of one contiguous tensor, so no copy afterwards).
            n = input_.shape[0]
            chunks = [recv[r * n : (r + 1) * n] for r in range(self.world_size)]
            self._run("all_gather", lambda g: dist.all_gather(chunks, send, group=g))
        else:
            self._run("all_gather", lambda g: _all_gather_single(recv, send, group=g))
        return out

    def reduce_scatter(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``input_`` [world_size * n, ...], this
        rank's n rows of it."""
        if self.world_size == 1:
            return input_.clone()
        if input_.shape[0] % self.world_size:
            raise ValueError(
                f"input_: expected a multiple of {self.world_size} rows for "
                f"reduce_scatter in the {self.name} group, got {input_.shape[0]}"
            )
        n = input_.shape[0] // self.world_size
        if self.backend == "gloo":
            # gloo's reduce-scatter exists only in some torch versions:
            # all-reduce and keep this rank's rows (the CPU test transport,
            # where the extra traffic does not matter).
            start = self.rank_in_group * n
            return self.all_reduce(input_)[start : start + n]
        out = input_.new_empty((n, *input_.shape[1:]))
        self._run(
            "reduce_scatter",
            lambda g: _reduce_scatter_single(out, input_.contiguous(), group=g),
        )
        return out

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> None:
        """Rows ``input_[sum(input_split_sizes[:r]):][:input_split_sizes[r]]``
        go to rank r; ``output`` receives rank r's rows in its r-th split."""
        if self.world_size == 1:
            output.copy_(input_)
            return
        for name, splits, t in (
            ("output_split_sizes", output_split_sizes, output),
            ("input_split_sizes", input_split_sizes, input_),
        ):
            if len(splits) != self.world_size or sum(splits) != t.shape[0]:
                raise ValueError(
                    f"{name}: expected {self.world_size} sizes summing to "
                    f"{t.shape[0]} rows, got {splits}"
                )
        recv, send = _bytes_for_transport(output), _bytes_for_transport(input_)
        self._run(
            "all_to_all_single",
            lambda g: dist.all_to_all_single(
                recv,
                send.contiguous(),
                output_split_sizes,
                input_split_sizes,
                group=g,
            ),
        )

    def barrier(self) -> None:
        if self.world_size > 1:
            self._run("barrier", lambda g: dist.barrier(group=g))

    def destroy(self) -> None:
        """Release the process group (the world's default group is released
        by :func:`destroy_distributed_environment`)."""
        if self.device_group is not None and self.device_group is not (
            dist.group.WORLD
        ):
            dist.destroy_process_group(self.device_group)
        for group in self.ubatch_groups:
            dist.destroy_process_group(group)
        self.device_group, self.ubatch_groups = None, ()


@dataclass
class _ParallelGroups:
    tp: GroupCoordinator
    dp: GroupCoordinator
    ep: GroupCoordinator


_WORLD: GroupCoordinator | None = None
_GROUPS: _ParallelGroups | None = None


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str | None = None,
    local_rank: int = -1,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> GroupCoordinator:
    """Join the world as ``rank`` of ``world_size`` processes.

    ``distributed_init_method`` is a torch init URL (``tcp://host:port``,
    ``file://...``); None rendezvouses at ``MASTER_ADDR``:``MASTER_PORT``
    (``env://``). ``backend`` defaults to NCCL where CUDA is available, gloo
    elsewhere. ``local_rank`` picks the CUDA device (default: ``rank``, one
    node). ``timeout`` bounds every collective of every group.
    """
    global _WORLD
    if _WORLD is not None:
        raise RuntimeError(
            "init_distributed_environment: already initialized; call "
            "destroy_distributed_environment() first"
        )
    _check_positive("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0..{world_size - 1}, got {rank}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if distributed_init_method is None:
        missing = [
            name
            for name, value in (
                ("MASTER_ADDR", envs.master_addr()),
                ("MASTER_PORT", envs.master_port()),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"distributed_init_method: None rendezvouses at MASTER_ADDR:"
                f"MASTER_PORT, but {' and '.join(missing)} is not set"
            )
        distributed_init_method = "env://"
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    if backend == "nccl":
        device = torch.device("cuda", rank if local_rank == -1 else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend=backend,
        init_method=distributed_init_method,
        world_size=world_size,
        rank=rank,
        timeout=timeout,
    )
    _WORLD = GroupCoordinator(
        name="world",
        ranks=list(range(world_size)),
        rank=rank,
        device_group=dist.group.WORLD if world_size > 1 else None,
        backend=backend,
        device=device,
        timeout=timeout,
    )
    logger.debug("rank %d of %d joined (%s)", rank, world_size, backend)
    return _WORLD


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError(
            "world group: not initialized; call init_distributed_environment()"
        )
    return _WORLD


def _make_groups(
    name: str,
    rank_lists: list[list[int]],
    world: GroupCoordinator,
    num_ubatches: int = 1,
) -> GroupCoordinator:
    """This process's group among ``rank_lists``, with a communicator per
    ubatch. Every rank walks every list in the same order, as ``new_group``
    requires."""
    mine: GroupCoordinator | None = None

    def new_group(ranks: list[int]) -> ProcessGroup:
        return dist.new_group(ranks, timeout=world.timeout, backend=world.backend)

    for ranks in rank_lists:
        extra: tuple[ProcessGroup, ...] = ()
        if len(ranks) == 1:
            pg = None  # no peers: collectives are identities
        else:
            # the world's ranks: its communicator, not a second one
            pg = world.device_group if ranks == world.ranks else new_group(ranks)
            extra = tuple(new_group(ranks) for _ in range(num_ubatches - 1))
        if world.rank in ranks:
            mine = GroupCoordinator(
                name=name,
                ranks=ranks,
                rank=world.rank,
                device_group=pg,
                backend=world.backend,
                device=world.device,
                timeout=world.timeout,
                ubatch_groups=extra,
            )
    assert mine is not None
    return mine


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    num_ubatches: int = 1,
) -> None:
    """Carve the world into tensor-, data- and expert-parallel groups
    (ranks = dp x tp), the expert-parallel one with a communicator per
    ubatch (see the module docstring)."""
    global _GROUPS
    world = get_world_group()
    if _GROUPS is not None:
        raise RuntimeError(
            "initialize_model_parallel: already initialized; call "
            "destroy_model_parallel() first"
        )
    tp, dp = tensor_model_parallel_size, data_parallel_size
    _check_positive("tensor_model_parallel_size", tp)
    _check_positive("data_parallel_size", dp)
    _check_positive("num_ubatches", num_ubatches)
    if tp * dp != world.world_size:
        raise ValueError(
            f"tensor_model_parallel_size x data_parallel_size: expected the "
            f"world size {world.world_size}, got {tp} x {dp} = {tp * dp}"
        )
    grid = torch.arange(world.world_size).view(dp, tp)
    _GROUPS = _ParallelGroups(
        tp=_make_groups("tp", grid.tolist(), world),
        dp=_make_groups("dp", grid.t().tolist(), world),
        ep=_make_groups("ep", [grid.flatten().tolist()], world, num_ubatches),
    )


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def _parallel_groups() -> _ParallelGroups:
    if _GROUPS is None:
        raise RuntimeError(
            "model parallel groups: not initialized; call initialize_model_parallel()"
        )
    return _GROUPS


def get_tp_group() -> GroupCoordinator:
    return _parallel_groups().tp


def get_dp_group() -> GroupCoordinator:
    return _parallel_groups().dp


def get_ep_group() -> GroupCoordinator:
    return _parallel_groups().ep


def destroy_model_parallel() -> None:
    """Release the tensor-, data- and expert-parallel groups (idempotent)."""
    global _GROUPS
    if _GROUPS is not None:
        for group in (_GROUPS.tp, _GROUPS.dp, _GROUPS.ep):
            group.destroy()
    _GROUPS = None


def destroy_distributed_environment() -> None:
    """Release every group and leave the world (idempotent)."""
    global _WORLD
    destroy_model_parallel()
    if _WORLD is not None and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
