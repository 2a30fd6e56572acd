"""Helpers shared across the package."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np
import torch


def align_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return (n + multiple - 1) // multiple * multiple


def to_device(
    values: list[int] | list[float] | np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Host values as a ``dtype`` tensor on ``device``, without waiting for
    its stream. ``torch.tensor(values, device=...)`` copies and then
    synchronises the stream, so during a step it waits for the queued
    forward pass (async scheduling loses its overlap); a copy from pageable
    memory may wait too (the driver may sync to stage it). Staged in pinned
    memory from torch's caching host allocator, which keeps the buffer
    until the copy has run."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else None
    host = torch.tensor(values, dtype=dtype) if host is None else host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True).copy_(host)
    return pinned.to(device, non_blocking=True)


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in ("cuda" -> "cuda:<current>"), so
    keys and checks agree with the device that tensors report."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def named_tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj``, with its attribute path.

    Follows lists, tuples, dicts, dataclasses and plain attributes (each
    object once), e.g. ``("gemm1.weight", tensor)`` for a tensor held by an
    object held by ``obj``.
    """
    seen: set[int] = set()

    def visit(o: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(o, torch.Tensor):
            yield path, o
            return
        if id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(o))
        children: Any
        if isinstance(o, dict):
            children = o.items()
        elif isinstance(o, (list, tuple)):
            children = enumerate(o)
        elif is_dataclass(o):
            children = ((f.name, getattr(o, f.name)) for f in fields(o))
        elif hasattr(o, "__dict__"):
            children = vars(o).items()
        else:
            return
        for key, child in children:
            yield from visit(child, f"{path}.{key}" if path else str(key))

    yield from visit(obj, prefix)
