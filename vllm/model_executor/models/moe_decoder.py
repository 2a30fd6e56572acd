"""A small MoE decoder (FFN-only blocks) loaded from safetensors.

Each block is ``x + FusedMoE(rms_norm(x), router(rms_norm(x)))``; attention is
left out on purpose: this model exists to run the MoE subsystem end to end
(weight loading per expert shard, weight reload, the shared workspace) with
real checkpoints. Checkpoint names follow the Hugging Face Mixtral/Qwen-MoE
layout: ``layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm

_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEDecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_experts: int
    experts_per_token: int
    intermediate_size: int
    dtype: str = "bfloat16"
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_json(cls, path: Path) -> MoEDecoderConfig:
        return cls(**json.loads(Path(path).read_text()))

    def to_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class MoEDecoderLayer(nn.Module):
    def __init__(
        self, config: MoEDecoderConfig, prefix: str, backend: str, device
    ) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.router = nn.Linear(
            config.hidden_size,
            config.num_experts,
            bias=False,
            dtype=dtype,
            device=device,
        )
        self.router.weight.requires_grad_(False)
        moe = FusedMoEConfig(
            num_experts=config.num_experts,
            experts_per_token=config.experts_per_token,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            in_dtype=dtype,
        )
        self.experts = FusedMoE(
            moe, prefix=f"{prefix}.mlp.experts", backend=backend, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts(h, self.router(h))


class MoEDecoder(nn.Module):
    def __init__(
        self,
        config: MoEDecoderConfig,
        *,
        prefix: str = "model",
        backend: str = "auto",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.config = config
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, f"{prefix}.layers.{i}", backend, device)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.lm_head = nn.Linear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            dtype=dtype,
            device=device,
        )
        self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a whole checkpoint; expert shards go through FusedMoE's loader
        (which checks that every shard arrived), the rest must all be there."""
        params = {
            name: p for name, p in self.named_parameters() if ".experts." not in name
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) == 7 and parts[2:4] == ["mlp", "experts"]:
                # layers.{i}.mlp.experts.{e}.{proj}.weight
                layer = self.layers[int(parts[1])]
                assert isinstance(layer, MoEDecoderLayer)
                if parts[5] not in _SHARDS:
                    raise ValueError(f"weights: unknown expert projection in {name!r}")
                layer.experts.weight_loader(tensor, _SHARDS[parts[5]], int(parts[4]))
                continue
            param_name = name.replace(".mlp.gate.", ".router.")
            target = params.get(param_name)
            if target is None or target.shape != tensor.shape:
                raise ValueError(
                    f"weights: {name!r} {tuple(tensor.shape)} matches no parameter"
                )
            target.data.copy_(tensor)
            loaded.add(param_name)
        if missing := sorted(params.keys() - loaded):
            raise ValueError(f"weights: the checkpoint lacks {missing[:4]} ...")

    def process_weights_after_loading(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, MoEDecoderLayer)
            layer.experts.process_weights_after_loading()


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def save_random_checkpoint(config: MoEDecoderConfig, path: Path, seed: int) -> None:
    """Write ``config.json`` and ``model.safetensors`` with random weights."""
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        fan_in = shape[-1]
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(config.torch_dtype)

    tensors = {
        "embed_tokens.weight": rand(config.vocab_size, h),
        "norm.weight": torch.ones(h, dtype=config.torch_dtype),
        "lm_head.weight": rand(config.vocab_size, h),
    }
    for layer in range(config.num_layers):
        prefix = f"layers.{layer}"
        tensors[f"{prefix}.norm.weight"] = torch.ones(h, dtype=config.torch_dtype)
        tensors[f"{prefix}.mlp.gate.weight"] = rand(config.num_experts, h)
        for e in range(config.num_experts):
            expert = f"{prefix}.mlp.experts.{e}"
            tensors[f"{expert}.gate_proj.weight"] = rand(i, h)
            tensors[f"{expert}.up_proj.weight"] = rand(i, h)
            tensors[f"{expert}.down_proj.weight"] = rand(h, i)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.to_json(path / "config.json")
    save_file(tensors, str(path / "model.safetensors"))
