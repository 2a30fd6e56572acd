"""Micro-batch (ubatch) identity for dual-batch overlap (DBO).

Under DBO each micro-batch runs on its own thread; everything that must not be
shared between overlapping micro-batches (workspace, persistent resources) is
looked up by the id of the ubatch whose thread is running.
"""

import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

# A context variable, like the workspace lane: a new thread starts outside any
# ubatch, and leaving a context restores exactly what was there before.
_ubatch_id: contextvars.ContextVar[int] = contextvars.ContextVar("ubatch_id", default=0)


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

    def body(i: int) -> None:
        try:
            with ubatch_context(i):
                results[i] = fns[i]()
        except BaseException as e:  # re-raised on the caller's thread
            errors[i] = e

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
