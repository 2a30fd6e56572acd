"""Workspace manager: scratch arenas and persistent resources per execution slot.

A slot is the pair (ubatch, lane): a place where model execution runs without
overlapping any other. Each slot owns

- one byte arena, carved by :meth:`WorkspaceManager.get_simultaneous` into
  disjoint, 256-byte aligned views that are reused by every later call, and
- a cache of persistent resources: objects (:meth:`get_persistent_resource`)
  and fixed-shape tensors (:meth:`get_persistent`) that keep stable storage for
  the manager's lifetime, across layers, CUDA-graph replays and weight reloads.

Everything is created while the manager is unlocked (warm-up); after
:meth:`lock` any growth or new resource raises :class:`WorkspaceLockedError`.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from vllm import envs
from vllm.logger import init_logger
from vllm.utils import align_up, canonical_device
from vllm.v1.worker.ubatching import dbo_current_ubatch_id
from vllm.v1.worker.workspace_report import (
    ResourceReport,
    SlotReport,
    WorkspaceReport,
    tensor_storage_bytes,
)

logger = init_logger(__name__)

T = TypeVar("T")

ALIGNMENT = 256
"""Byte alignment of every view handed out by ``get_simultaneous``."""

AllocContext = Callable[[], AbstractContextManager[Any]]
# Allocations run with inference mode off: warm-up often runs under
# torch.inference_mode(), and inference tensors could not be updated in
# place later outside it.


class WorkspaceLockedError(AssertionError):
    """A request needed new workspace memory after the manager was locked."""


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * dtype.itemsize


def _external_caller(*skip_files: str) -> str:
    """file:line of the first stack frame outside this module (and outside
    ``skip_files``, the modules of resource owners reporting through us)."""
    skipped = {os.path.abspath(__file__), *map(os.path.abspath, skip_files)}
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in skipped:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _stream_key(device: torch.device) -> Hashable:
    """Identity of the current stream on ``device`` (a constant on CPU)."""
    if device.type != "cuda":
        return ("stream", device.type)
    # (stream_id, device_index, device_type) without building a Stream object:
    # this runs on every per-stream lookup, i.e. on every GEMM call.
    stream_id, device_index, _ = torch._C._cuda_getCurrentStream(device.index)
    return ("stream", device_index, stream_id)


@dataclass
class _Slot:
    ubatch: int
    lane: int
    arena: torch.Tensor | None = None
    tensors: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    objects: dict[Hashable, object] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    @property
    def arena_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.untyped_storage().nbytes()

    def describe(self) -> str:
        tensors = ", ".join(
            f"{k!r}: {tuple(t.shape)} {t.dtype}" for k, t in self.tensors.items()
        )
        objects = ", ".join(
            f"{k!r}: {type(o).__name__}" for k, o in self.objects.items()
        )
        return (
            f"arena {self.arena_bytes} B; persistent tensors {{{tensors}}}; "
            f"persistent objects {{{objects}}}"
        )


class WorkspaceManager:
    """Scratch arenas and persistent resources, one set per (ubatch, lane)."""

    def __init__(
        self,
        device: torch.device | str,
        num_ubatches: int | None = None,
        num_lanes: int = 1,
        alloc_context: AllocContext = nullcontext,
    ) -> None:
        num_ubatches = 1 if num_ubatches is None else num_ubatches
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        if num_lanes < 1:
            raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
        self.device = canonical_device(device)
        self.num_ubatches = num_ubatches
        self.num_lanes = num_lanes
        self._alloc_context = alloc_context
        self._locked = False
        self._slots = [
            _Slot(ubatch=u, lane=lane)
            for u in range(num_ubatches)
            for lane in range(num_lanes)
        ]

    # -- slots ---------------------------------------------------------------

    def _current_slot(self) -> _Slot:
        ubatch = dbo_current_ubatch_id()
        lane = current_workspace_lane()
        if ubatch >= self.num_ubatches:
            raise ValueError(
                f"ubatch {ubatch} is running but the workspace manager was "
                f"initialized with num_ubatches={self.num_ubatches}"
            )
        if lane >= self.num_lanes:
            raise ValueError(
                f"workspace lane {lane} is selected but the workspace manager was "
                f"initialized with num_lanes={self.num_lanes}"
            )
        return self._slots[ubatch * self.num_lanes + lane]

    def _locked_error(
        self, slot: _Slot, request: str, owner_file: str | None = None
    ) -> WorkspaceLockedError:
        state = "locked" if self._locked else "capturing a CUDA graph"
        caller = _external_caller(*([owner_file] if owner_file else []))
        return WorkspaceLockedError(
            f"Workspace is {state}: {caller} requested {request} in "
            f"slot (ubatch={slot.ubatch}, lane={slot.lane}); that slot has "
            f"{slot.describe()}. Warm up every size and slot, on the stream "
            f"that captures, before capturing and lock_workspace()."
        )

    def _growth_forbidden(self) -> bool:
        """Locked, or a CUDA graph is being captured: new memory would either
        break the lock or outlive its zero-fill / free what graphs point to."""
        return self._locked or (
            self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        )

    def locked_error(self, request: str, owner_file: str) -> WorkspaceLockedError:
        """The error for ``request`` in the current slot, for owners of
        resources that grow on their own (e.g. the MoE permute scratch); the
        caller named is the first frame outside ``owner_file``."""
        return self._locked_error(self._current_slot(), request, owner_file)

    def growth_allowed(self) -> bool:
        return not self._growth_forbidden()

    def require_device(self, device: torch.device | str, what: str) -> None:
        """Resources are allocated on the manager's device: refuse others."""
        if canonical_device(device) != self.device:
            raise ValueError(
                f"device: the workspace manager owns {self.device}, but {what} was "
                f"asked for on {canonical_device(device)}"
            )

    # -- scratch arena -------------------------------------------------------

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype]
    ) -> list[torch.Tensor]:
        """Disjoint views of the slot's arena, one per (shape, dtype).

        Each view starts on a 256-byte boundary. A later call in the same
        slot reuses the same bytes, so views are only valid until then.
        """
        offsets = []
        total = 0
        for shape, dtype in shapes_and_dtypes:
            offsets.append(total)
            total += align_up(_nbytes(shape, dtype), ALIGNMENT)
        slot = self._current_slot()
        if total > slot.capacity:
            self._grow_arena(slot, total, shapes_and_dtypes)
        assert slot.arena is not None or total == 0
        views = []
        for (shape, dtype), offset in zip(shapes_and_dtypes, offsets, strict=True):
            if slot.arena is None:
                views.append(torch.empty(shape, dtype=dtype, device=self.device))
                continue
            nbytes = _nbytes(shape, dtype)
            raw = slot.arena[offset : offset + nbytes]
            views.append(raw.view(dtype).view(tuple(shape)))
        return views

    def _grow_arena(
        self,
        slot: _Slot,
        nbytes: int,
        request: Sequence[tuple[Sequence[int], torch.dtype]],
    ) -> None:
        if self._growth_forbidden():
            shapes = ", ".join(f"{tuple(s)} {d}" for s, d in request)
            raise self._locked_error(
                slot, f"{nbytes} arena bytes for [{shapes}] (arena growth)"
            )
        if envs.debug_workspace():
            logger.info(
                "workspace slot (ubatch=%d, lane=%d) arena %d -> %d bytes (%s)",
                slot.ubatch,
                slot.lane,
                slot.capacity,
                nbytes,
                _external_caller(),
            )
        # Release the old block first so the allocator can reuse it.
        slot.arena = None
        with self._alloc_context(), torch.inference_mode(False):
            arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            misalignment = arena.data_ptr() % ALIGNMENT
            if misalignment:  # the CUDA allocator aligns; CPU may not
                arena = torch.empty(
                    nbytes + ALIGNMENT, dtype=torch.uint8, device=self.device
                )
                start = -arena.data_ptr() % ALIGNMENT
                arena = arena[start : start + nbytes]
        slot.arena = arena

    # -- persistent resources ------------------------------------------------

    def _resource_key(self, key: Hashable, per_stream: bool) -> Hashable:
        return (key, _stream_key(self.device)) if per_stream else key

    def get_persistent_resource(
        self, key: Hashable, factory: Callable[[], T], *, per_stream: bool = False
    ) -> T:
        """The slot's object for ``key``; ``factory()`` runs on first request.

        ``per_stream=True`` adds the current CUDA stream to the key, for
        resources (locks, semaphores) that kernels running concurrently on
        different streams must not share.
        """
        slot = self._current_slot()
        full_key = self._resource_key(key, per_stream)
        try:
            return slot.objects[full_key]  # type: ignore[return-value]
        except KeyError:
            pass
        if self._growth_forbidden():
            raise self._locked_error(slot, f"a new persistent resource {full_key!r}")
        with self._alloc_context(), torch.inference_mode(False):
            value = factory()
        slot.objects[full_key] = value
        if envs.debug_workspace():
            logger.info(
                "workspace slot (ubatch=%d, lane=%d) new resource %r: %s, %d bytes",
                slot.ubatch,
                slot.lane,
                full_key,
                type(value).__name__,
                tensor_storage_bytes(value),
            )
        return value

    def get_persistent(
        self,
        key: Hashable,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        zero_init: bool = False,
        per_stream: bool = False,
    ) -> torch.Tensor:
        """The slot's fixed-shape tensor for ``key`` (zeroed once if asked).

        A later request must name the same shape and dtype. ``per_stream``
        works as in :meth:`get_persistent_resource`.
        """
        slot = self._current_slot()
        full_key = self._resource_key(key, per_stream)
        tensor = slot.tensors.get(full_key)
        shape = tuple(shape)
        if tensor is not None:
            if tensor.shape != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"persistent tensor {full_key!r} exists as {tuple(tensor.shape)} "
                    f"{tensor.dtype}, but {shape} {dtype} was requested"
                )
            return tensor
        if self._growth_forbidden():
            raise self._locked_error(
                slot, f"a new persistent tensor {full_key!r} of {shape} {dtype}"
            )
        with self._alloc_context(), torch.inference_mode(False):
            factory = torch.zeros if zero_init else torch.empty
            tensor = factory(shape, dtype=dtype, device=self.device)
        slot.tensors[full_key] = tensor
        if envs.debug_workspace():
            logger.info(
                "workspace slot (ubatch=%d, lane=%d) new tensor %r: %s %s, %d bytes",
                slot.ubatch,
                slot.lane,
                full_key,
                shape,
                dtype,
                tensor.nbytes,
            )
        return tensor

    def get_lock_buffer(
        self, name: str, numel: int, device: torch.device | str
    ) -> torch.Tensor:
        """The zeroed int32 lock (semaphore) buffer ``name`` of the current
        slot and CUDA stream, keyed ``(name, device)``: kernels that leave
        their counters at zero need no memset between calls."""
        device = canonical_device(device)
        if device != self.device:
            self.require_device(device, f"lock buffer {name!r}")
        return self.get_persistent(
            (name, str(device)), (numel,), torch.int32, zero_init=True, per_stream=True
        )

    # -- lock ----------------------------------------------------------------

    def lock(self) -> None:
        """Forbid any new workspace memory; existing memory stays usable."""
        self._locked = True
        if envs.debug_workspace():
            logger.info("workspace locked:\n%s", self.memory_report().format())

    def unlock(self) -> None:
        self._locked = False
        if envs.debug_workspace():
            logger.info("workspace unlocked")

    def is_locked(self) -> bool:
        return self._locked

    # -- accounting ----------------------------------------------------------

    def memory_report(self) -> WorkspaceReport:
        """Arena bytes and every persistent resource with its bytes, per slot."""
        slots = []
        for s in self._slots:
            resources = [
                ResourceReport("tensor", k, "Tensor", t.untyped_storage().nbytes())
                for k, t in s.tensors.items()
            ] + [
                ResourceReport("object", k, type(o).__name__, tensor_storage_bytes(o))
                for k, o in s.objects.items()
            ]
            slots.append(SlotReport(s.ubatch, s.lane, s.arena_bytes, resources))
        return WorkspaceReport(str(self.device), self._locked, slots)


# -- lanes -------------------------------------------------------------------

# A context variable: a new thread starts on lane 0, and run_ubatches() hands
# the caller's lane to its ubatch threads by copying the context.
_lane: contextvars.ContextVar[int] = contextvars.ContextVar("workspace_lane", default=0)


def current_workspace_lane() -> int:
    """The running context's workspace lane (0 unless selected)."""
    return _lane.get()


@contextmanager
def use_workspace_lane(lane: int) -> Iterator[None]:
    """Select workspace lane ``lane`` for the body (this thread and the
    ubatch threads it starts with ``run_ubatches``)."""
    if lane < 0:
        raise ValueError(f"workspace lane must be >= 0, got {lane}")
    if _manager is not None and lane >= _manager.num_lanes:
        raise ValueError(
            f"workspace lane {lane} is out of range: the workspace manager was "
            f"initialized with num_lanes={_manager.num_lanes}"
        )
    token = _lane.set(lane)
    try:
        yield
    finally:
        _lane.reset(token)


# -- process-wide manager ----------------------------------------------------

_manager: WorkspaceManager | None = None


def init_workspace_manager(
    device: torch.device | str,
    num_ubatches: int | None = None,
    num_lanes: int = 1,
    alloc_context: AllocContext = nullcontext,
) -> WorkspaceManager:
    """Create the process-wide manager (once; reset it before re-creating)."""
    global _manager
    if _manager is not None:
        raise RuntimeError(
            "workspace manager is already initialized; call "
            "reset_workspace_manager() first"
        )
    _manager = WorkspaceManager(device, num_ubatches, num_lanes, alloc_context)
    return _manager


def is_workspace_manager_initialized() -> bool:
    return _manager is not None


def current_workspace_manager() -> WorkspaceManager:
    if _manager is None:
        raise RuntimeError(
            "workspace manager is not initialized; call init_workspace_manager()"
        )
    return _manager


def lock_workspace() -> None:
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Drop the process-wide manager and everything it owns."""
    global _manager
    _manager = None


# -- manager or fresh memory -------------------------------------------------
# Kernels also run without a manager (tests, scripts): then every call gets
# fresh memory. These helpers make that choice in one place.


def get_workspace_buffers(
    device: torch.device | str, *specs: tuple[Sequence[int], torch.dtype]
) -> list[torch.Tensor]:
    """Disjoint scratch views of the current slot's arena (see
    :meth:`WorkspaceManager.get_simultaneous`), or new empty tensors."""
    if _manager is not None:
        return _manager.get_simultaneous(*specs)
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]


def get_shared_resource(key: Hashable, factory: Callable[[], T]) -> T:
    """The current slot's object for ``key`` (see
    :meth:`WorkspaceManager.get_persistent_resource`), or a new ``factory()``."""
    if _manager is not None:
        return _manager.get_persistent_resource(key, factory)
    return factory()


def get_lock_buffer(name: str, numel: int, device: torch.device | str) -> torch.Tensor:
    """The current slot's and stream's lock buffer (see
    :meth:`WorkspaceManager.get_lock_buffer`), or a new zeroed one."""
    if _manager is not None:
        return _manager.get_lock_buffer(name, numel, device)
    return torch.zeros(numel, dtype=torch.int32, device=device)
