"""Model classes by the ``architectures`` name of a checkpoint's config."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from vllm.distributed import GroupCoordinator


class CausalLM(Protocol):
    """What the loader and the engine use of a model class."""

    config_class: Any  # has from_hf(normalized config.json dict)

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        moe_backend: str,
        quantization: str | None,
        prefix: str,
        ep_group: GroupCoordinator | None,
        all2all_backend: str,
        tp_group: GroupCoordinator | None,
    ) -> None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def checkpoint_shapes(
        self,
    ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]: ...


# architecture -> (module under vllm.model_executor.models, class); modules
# are imported on first use.
_MODELS = {"Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM")}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(architectures: list[str]) -> type[CausalLM]:
    """The class of the first supported name in ``architectures``."""
    for name in architectures:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(
                importlib.import_module(f"vllm.model_executor.models.{module}"), cls
            )
    raise ValueError(
        f"architectures: none of {architectures} is supported; supported: "
        f"{supported_architectures()}"
    )
