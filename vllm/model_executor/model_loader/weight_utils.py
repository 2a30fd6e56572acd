"""Tensors of a local safetensors checkpoint, one file at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model: str | Path) -> list[Path]:
    """The checkpoint's shards: those its index names, else every
    ``*.safetensors`` in the directory."""
    root = Path(model)
    index = root / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / name for name in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"model: {INDEX_FILE} names missing shards {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {root}")
    return files


def safetensors_weights_iterator(
    model: str | Path,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor, on the CPU, shard by shard."""
    for path in safetensors_files(model):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)
