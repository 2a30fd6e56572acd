"""Build a model from a local checkpoint directory.

``get_model(model, load_format=...)`` reads ``config.json``, picks the class
from its ``architectures`` (:mod:`vllm.model_executor.models.registry`),
builds it on ``device`` and loads it: ``"safetensors"`` (``"auto"``) from the
directory's safetensors files, ``"dummy"`` with random weights in place (real
shapes without a checkpoint, for benchmarks; only ``config.json`` is read).

Under expert parallelism (``ep_group``) the model holds and loads only this
rank's experts. Dummy weights are drawn per tensor from ``seed`` and the
tensor's name, so a rank's experts equal the same experts of a
single-process model.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from vllm.distributed import GroupCoordinator
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.model_executor.models.registry import CausalLM, resolve_model_cls
from vllm.transformers_utils.config import load_hf_config

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None) -> torch.dtype:
    """``"auto"`` is the checkpoint's 16-bit ``torch_dtype``, and bfloat16
    for float32 checkpoints or none (serving runs 16-bit; ask for float32
    explicitly, e.g. for parity checks on the CPU)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif dtype == "auto":
        name = config_dtype if config_dtype in ("bfloat16", "float16") else "bfloat16"
    else:
        name = dtype
    if name not in _DTYPES:
        raise ValueError(
            f"dtype: expected 'auto' or one of {list(_DTYPES)}, got {dtype!r}"
        )
    return _DTYPES[name]


def get_model(
    model: str | Path,
    *,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    moe_backend: str = "auto",
    quantization: str | None = None,
    seed: int = 0,
    prefix: str = "",
    ep_group: GroupCoordinator | None = None,
    all2all_backend: str = "allgather_reducescatter",
    tp_group: GroupCoordinator | None = None,
) -> nn.Module:
    """The loaded model of checkpoint directory ``model``, in inference mode
    (no gradients); ``seed`` draws the dummy weights. ``quantization``
    quantizes while loading: "fp8" (experts: FP8 weights per channel,
    activations per token), "w4a16" (uint4 weights in groups of 128 for the
    experts and the attention and dense MLP linears) or "w4a8" (experts:
    uint4 weights in groups of 128, fp8 activations per token). ``ep_group`` shards
    the experts over its ranks, exchanging tokens through
    ``all2all_backend``; ``tp_group`` (the same ranks) shards attention heads
    and dense MLPs too, its ranks holding the same tokens."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}"
        )
    hf_config = load_hf_config(model)
    cls = resolve_model_cls(hf_config.get("architectures") or [])
    config = cls.config_class.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config.get("torch_dtype"))
    net = cls(
        config,
        dtype=torch_dtype,
        device=device,
        moe_backend=moe_backend,
        quantization=quantization,
        prefix=prefix,
        ep_group=ep_group,
        all2all_backend=all2all_backend,
        tp_group=tp_group,
    )
    if load_format == "dummy":
        net.load_weights(_dummy_weights(net, seed, torch.device(device)))
    else:
        net.load_weights(safetensors_weights_iterator(model))
    assert isinstance(net, nn.Module)
    return net.eval()


def _dummy_weights(
    net: CausalLM, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Small uniform values for every checkpoint tensor of ``net`` (as vLLM's
    dummy format: shapes and dtypes real, values meaningless), drawn on the
    model's device: a 30B model's worth of host random numbers takes
    minutes. Seeded per tensor (``seed`` and the name), so the values do
    not depend on which tensors this rank loads."""
    gen = torch.Generator(device)
    for name, shape, dtype in net.checkpoint_shapes():
        gen.manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
        values = torch.rand(shape, generator=gen, device=device, dtype=dtype)
        yield name, values.mul_(2e-3).sub_(1e-3)
