"""Micro-batch (ubatch) identity for dual-batch overlap (DBO).

Under DBO each micro-batch runs on its own thread; everything that must not be
shared between overlapping micro-batches (workspace, persistent resources) is
looked up by the id of the ubatch whose thread is running.

The ubatches of :func:`run_ubatches` also take turns to issue collectives
(:func:`collective_turn`): ubatch 0's first, then ubatch 1's first, then
ubatch 0's second, ... Every rank then issues them in the same order, which
NCCL needs across communicators (otherwise rank 0 could launch ubatch 0's
all-gather while rank 1 launches ubatch 1's, each kernel waiting for a peer
that the other holds up). Compute between collectives runs freely.
"""

import contextvars
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TypeVar

import torch

T = TypeVar("T")

# A context variable, like the workspace lane: a new thread starts outside any
# ubatch, and leaving a context restores exactly what was there before.
_ubatch_id: contextvars.ContextVar[int] = contextvars.ContextVar("ubatch_id", default=0)


class _TurnOrder:
    """Whose turn it is to issue a collective, among ``n`` ubatch threads;
    a finished thread's turns are skipped."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * n

    @contextmanager
    def turn(self, ubatch: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == ubatch)
        try:
            yield
        finally:
            self._pass(ubatch)

    def finish(self, ubatch: int) -> None:
        with self._cond:
            self._done[ubatch] = True
        self._pass(ubatch)

    def _pass(self, ubatch: int) -> None:
        with self._cond:
            if self._turn == ubatch and not all(self._done):
                n = len(self._done)
                nxt = (ubatch + 1) % n
                while self._done[nxt] and nxt != ubatch:
                    nxt = (nxt + 1) % n
                self._turn = nxt
            self._cond.notify_all()


_turn_order: contextvars.ContextVar[_TurnOrder | None] = contextvars.ContextVar(
    "ubatch_turn_order", default=None
)


def collective_turn() -> AbstractContextManager[None]:
    """Wrap the issue of a collective: under :func:`run_ubatches` it waits
    for the calling ubatch's turn and passes the turn on afterwards;
    elsewhere it does nothing."""
    order = _turn_order.get()
    return nullcontext() if order is None else order.turn(dbo_current_ubatch_id())


def dbo_current_ubatch_id() -> int:
    """The running thread's ubatch id; 0 outside micro-batch overlap."""
    return _ubatch_id.get()


@contextmanager
def ubatch_context(ubatch_id: int) -> Iterator[None]:
    """Run the body as micro-batch ``ubatch_id`` on the current thread."""
    if ubatch_id < 0:
        raise ValueError(f"ubatch_id must be >= 0, got {ubatch_id}")
    token = _ubatch_id.set(ubatch_id)
    try:
        yield
    finally:
        _ubatch_id.reset(token)


def run_ubatches(fns: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``fns[i]`` as ubatch i, each on its own thread, concurrently.

    Each thread runs in a copy of the caller's context, so context-scoped
    selections (the workspace lane) carry over. Returns the results in order;
    the first exception raised by any ubatch is re-raised here after all
    threads have finished.
    """
    results: list[T | None] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)
    order = _TurnOrder(len(fns))

    def body(i: int) -> None:
        token = _turn_order.set(order)
        try:
            with ubatch_context(i):
                results[i] = fns[i]()
        except BaseException as e:  # re-raised on the caller's thread
            errors[i] = e
        finally:
            order.finish(i)
            _turn_order.reset(token)

    threads = [
        threading.Thread(
            target=contextvars.copy_context().run, args=(body, i), name=f"ubatch-{i}"
        )
        for i in range(len(fns))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results  # type: ignore[return-value]


def run_ubatches_on_streams(
    fns: Sequence[Callable[[], T]],
    streams: Sequence[torch.cuda.Stream | None],
    caller: torch.cuda.Stream | None,
) -> list[T]:
    """:func:`run_ubatches` with ``fns[i]`` in inference mode (a thread's own
    setting) on ``streams[i]``, after the work ``caller`` holds so far (the
    step's inputs); the current stream then waits for theirs. ``None``
    streams (CPU) run on no stream."""

    def on_stream(fn: Callable[[], T], stream: torch.cuda.Stream | None) -> T:
        if stream is None or caller is None:
            with torch.inference_mode():
                return fn()
        stream.wait_stream(caller)
        with torch.inference_mode(), torch.cuda.stream(stream):
            return fn()

    results = run_ubatches(
        [
            functools.partial(on_stream, fn, s)
            for fn, s in zip(fns, streams, strict=True)
        ]
    )
    for stream in streams:
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
    return results


def balanced_split(tokens: Sequence[int]) -> int:
    """How many of the requests (``tokens`` each, in order) go to the first
    of two micro-batches: the cut nearest half the tokens, at least one
    request on each side where there are two."""
    if len(tokens) < 2:
        return len(tokens)
    ends = list(itertools.accumulate(tokens))
    return 1 + min(range(len(tokens) - 1), key=lambda k: abs(2 * ends[k] - ends[-1]))
