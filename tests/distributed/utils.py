"""Run a function in N spawned processes that form a real gloo world on
127.0.0.1, and collect what each returned or raised.

A worker is ``target(rank, world_size, port, *args)`` at module level (spawn
imports it by name). Each rank's return value, or its traceback, comes back
through a pickle file; a world that outlives ``timeout_s`` is killed and
fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from vllm.distributed import (
    GroupCoordinator,
    get_distributed_init_method,
    get_open_port,
    init_distributed_environment,
)


@dataclass
class WorkerResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None  # the traceback when the worker raised


def _worker_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out_dir: Path,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)  # N workers share the CI machine's 2 cores
    try:
        result: dict[str, Any] = {"value": target(rank, world_size, port, *args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # Leave without interpreter teardown: a broken world's atexit hooks could
    # block, and the verdict is already written.
    os._exit(1 if "error" in result else 0)


def run_workers(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 90.0,
) -> list[WorkerResult]:
    """Start ``world_size`` workers, wait for all, return their results in
    rank order (a rank that died without a verdict has neither value nor
    error)."""
    ctx = mp.get_context("spawn")
    port = get_open_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(target, rank, world_size, port, out_dir, args),
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:
            procs[rank].kill()
            procs[rank].join()
        if hung:
            raise AssertionError(f"ranks {hung} still ran after {timeout_s}s")
        results = []
        for rank, p in enumerate(procs):
            path = out_dir / f"rank{rank}.pkl"
            verdict = pickle.loads(path.read_bytes()) if path.exists() else {}
            results.append(
                WorkerResult(
                    rank, p.exitcode, verdict.get("value"), verdict.get("error")
                )
            )
    return results


def values(results: list[WorkerResult]) -> list[Any]:
    """Every rank's return value; fails with the tracebacks if any raised."""
    errors = [
        f"rank {r.rank}: {r.error or f'exit code {r.exitcode}, no verdict'}"
        for r in results
        if r.exitcode != 0
    ]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


def init_gloo_world(
    rank: int, world_size: int, port: int, timeout_s: float = 30.0
) -> GroupCoordinator:
    """Join the test's gloo world on 127.0.0.1."""
    return init_distributed_environment(
        world_size,
        rank,
        get_distributed_init_method("127.0.0.1", port),
        backend="gloo",
        timeout=timedelta(seconds=timeout_s),
    )


def layout_group(name: str, ranks: list[int], rank: int) -> GroupCoordinator:
    """A group of ``ranks`` as ``rank`` sees it, with no communicator: for
    checks that read the layout only (nothing is exchanged)."""
    return GroupCoordinator(
        name=name,
        ranks=ranks,
        rank=rank,
        device_group=None,
        backend="gloo",
        device=torch.device("cpu"),
        timeout=timedelta(seconds=1),
    )
