"""Qwen3-MoE (``Qwen3MoeForCausalLM``) as ``transformers`` defines it.

Decoder layers: RMSNorm -> attention (q/k/v projections in one GEMM,
``qkv_proj``, loaded from the checkpoint's q/k/v tensors; RMSNorm on each
query and key head, RoPE, grouped-query heads) -> residual -> RMSNorm ->
MoE (softmax over all experts, top-k, renormalized when ``norm_topk_prob``)
or, for layers in ``mlp_only_layers`` or off ``decoder_sparse_step``, a dense
gated MLP -> residual. The routed experts are a :class:`FusedMoE`, so every
token runs through the workspace manager, the shared permute scratch and the
experts backends. Checkpoint names are those of Hugging Face checkpoints
(per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, or the fused
``mlp.experts.gate_up_proj`` / ``down_proj`` that ``transformers`` keeps in
memory).

Expert parallelism: built with an expert-parallel group (``ep_group``), every
MoE layer holds only this rank's experts (linear placement), exchanges tokens
with the other ranks through ``all2all_backend``, and loads only its experts:
``load_weights`` skips other ranks' per-expert tensors and
``checkpoint_shapes`` (what dummy weights fill) names only local ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vllm.distributed import GroupCoordinator
from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinear, rms_norm_linear
from vllm.model_executor.layers.quantization.marlin import MarlinLinear
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


@dataclass(frozen=True)
class Qwen3MoeModelConfig:
    """The fields of a Qwen3-MoE ``config.json`` this model reads (defaults
    as ``transformers.Qwen3MoeConfig``)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # per expert
    num_experts: int
    num_experts_per_tok: int
    head_dim: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen3MoeModelConfig:
        """From a normalized ``config.json`` (``load_hf_config``)."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act: expected 'silu', got {config['hidden_act']!r}"
            )
        if config.get("attention_bias", False):
            raise ValueError("attention_bias: expected false (Qwen3-MoE has none)")
        values = {f.name: config[f.name] for f in fields(cls) if f.name in config}
        values.setdefault(
            "head_dim", config["hidden_size"] // config["num_attention_heads"]
        )
        values["mlp_only_layers"] = tuple(config.get("mlp_only_layers") or ())
        try:
            return cls(**values)
        except TypeError as e:  # a required field is missing
            raise ValueError(f"config.json: {e}") from None

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class BuildArgs:
    """How every layer is built: dtype, device, the experts backend, the
    online quantization (None, "fp8", "w4a16" or "w4a8"), under expert
    parallelism the group the MoE layers shard their experts over, and under
    tensor parallelism the group that shards attention heads and dense MLPs
    (its ranks hold the same tokens)."""

    dtype: torch.dtype
    device: Any
    moe_backend: str = "auto"
    quantization: str | None = None
    ep_group: GroupCoordinator | None = None
    all2all_backend: str = "allgather_reducescatter"
    tp_group: GroupCoordinator | None = None

    def tp_shard(self, n: int, what: str) -> tuple[int, int]:
        """``(start, size)`` of this rank's share of ``n`` (``what``: named in
        the error when the ranks cannot split it evenly)."""
        if self.tp_group is None:
            return 0, n
        size, rank = self.tp_group.world_size, self.tp_group.rank_in_group
        if n % size:
            raise ValueError(
                f"tensor_parallel_size: {size} ranks must split {what}={n} evenly"
            )
        return rank * (n // size), n // size


Shard = tuple[tuple[int, ...], tuple[slice, ...]]
"""A checkpoint tensor's full shape and the index of this rank's part."""


def _rows(full: tuple[int, int], start: int, size: int) -> Shard:
    return full, (slice(start, start + size),)


def _cols(full: tuple[int, int], start: int, size: int) -> Shard:
    return full, (slice(None), slice(start, start + size))


def _all_reduce(out: torch.Tensor, group: GroupCoordinator | None) -> torch.Tensor:
    """A row-parallel product's sum over the tensor-parallel ranks."""
    return out if group is None else group.all_reduce(out)


QUANTIZATIONS = {
    "fp8": QuantScheme.FP8_PER_TOKEN,  # experts only
    "w4a16": QuantScheme.W4A16_UINT4,  # experts and the attention/dense MLP linears
    "w4a8": QuantScheme.W4A8_UINT4,  # experts only
}


def _linear(n_in: int, n_out: int, args: BuildArgs, quantize: bool = True) -> nn.Module:
    """A bias-free linear layer; W4A16 (our Marlin GEMM) under "w4a16"
    where ``quantize`` (the router and the head stay 16-bit)."""
    if quantize and args.quantization == "w4a16":
        return MarlinLinear(n_in, n_out, params_dtype=args.dtype, device=args.device)
    return UnquantizedLinear(n_in, n_out, dtype=args.dtype, device=args.device)


class Qwen3MoeAttention(nn.Module):
    """Attention from the q/k/v product (``qkv_proj``, which the decoder
    layer runs fused with its input norm). Under tensor parallelism a rank
    holds a share of the query and KV heads (q/k/v rows, ``o_proj``
    columns) and sums ``o_proj``'s output over the ranks."""

    def __init__(self, config: Qwen3MoeModelConfig, args: BuildArgs):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        dtype, device = args.dtype, args.device
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head0, self.num_heads = args.tp_shard(heads, "num_attention_heads")
        kv_head0, self.num_kv_heads = args.tp_shard(kv_heads, "num_key_value_heads")
        self.head_dim = d
        self.tp_group = args.tp_group
        # q, k and v in one GEMM; checkpoints name them apart (qkv_shards)
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = _linear(h, q_rows + 2 * kv_rows, args)
        self.qkv_shards = {
            "q_proj": slice(0, q_rows),
            "k_proj": slice(q_rows, q_rows + kv_rows),
            "v_proj": slice(q_rows + kv_rows, q_rows + 2 * kv_rows),
        }
        self.checkpoint_shards = {
            "q_proj": _rows((heads * d, h), head0 * d, q_rows),
            "k_proj": _rows((kv_heads * d, h), kv_head0 * d, kv_rows),
            "v_proj": _rows((kv_heads * d, h), kv_head0 * d, kv_rows),
            "o_proj": _cols((h, heads * d), head0 * d, q_rows),
        }
        self.o_proj = _linear(q_rows, h, args)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(
            d, config.rope_theta, config.max_position_embeddings, device
        )
        self.attn = Attention(self.num_heads, d, d**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        tokens = qkv.shape[0]
        # strided views of the one product: the kernels below take row strides
        q, k, v = (
            qkv[:, rows].view(tokens, -1, self.head_dim)
            for rows in self.qkv_shards.values()
        )
        if not runs_gpu_kernels(q) or self.head_dim & (self.head_dim - 1):
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
            return _all_reduce(self.o_proj(self.attn(q, k, v)), self.tp_group)
        # the attention's kernels apply the norms and rotations (power-of-two
        # heads)
        norm_rope = QKNormRope(
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            self.rotary_emb.cos_sin,
            positions,
        )
        # the 16-bit output projection's weight streams into L2 meanwhile
        o_weight = (
            self.o_proj.weight if isinstance(self.o_proj, UnquantizedLinear) else None
        )
        out = self.o_proj(self.attn(q, k, v, norm_rope, o_weight))
        return _all_reduce(out, self.tp_group)


class Qwen3MoeMLP(nn.Module):
    """The dense layers' gated MLP: ``down(silu(gate(x)) * up(x))``; under
    tensor parallelism a share of the intermediate columns per rank."""

    def __init__(self, hidden: int, inter: int, args: BuildArgs):
        super().__init__()
        start, local = args.tp_shard(inter, "intermediate_size")
        self.tp_group = args.tp_group
        self.gate_proj = _linear(hidden, local, args)
        self.up_proj = _linear(hidden, local, args)
        self.down_proj = _linear(local, hidden, args)
        self.checkpoint_shards = {
            "gate_proj": _rows((inter, hidden), start, local),
            "up_proj": _rows((inter, hidden), start, local),
            "down_proj": _cols((hidden, inter), start, local),
        }

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp(norm(x + residual)), x + residual)``."""
        x, residual = norm.add_and_norm(x, residual)
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return _all_reduce(out, self.tp_group), residual


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Qwen3MoeModelConfig, prefix: str, args: BuildArgs):
        super().__init__()
        self.gate = UnquantizedLinear(
            config.hidden_size, config.num_experts, dtype=args.dtype, device=args.device
        )
        scheme = QUANTIZATIONS.get(args.quantization or "", QuantScheme.UNQUANTIZED)
        ep = args.ep_group
        moe = FusedMoEConfig(
            num_experts=config.num_experts,
            experts_per_token=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            in_dtype=args.dtype,
            ep_rank=0 if ep is None else ep.rank_in_group,
            ep_size=1 if ep is None else ep.world_size,
            quant_config=FusedMoEQuantConfig(scheme),
        )
        self.experts = FusedMoE(
            moe,
            prefix=f"{prefix}.experts",
            renormalize=config.norm_topk_prob,
            backend=args.moe_backend,
            device=args.device,
            ep_group=ep,
            all2all_backend=args.all2all_backend,
            replicated_tokens=args.tp_group is not None,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(moe(norm(x + residual)), x + residual)``: the router's GEMM and
        the norm run in the layer, fused with the routing at decode."""
        return self.experts.forward_normed(
            x, residual, norm.weight, norm.eps, self.gate.weight
        )


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(
        self, config: Qwen3MoeModelConfig, layer: int, prefix: str, args: BuildArgs
    ):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Qwen3MoeAttention(config, args)
        self.mlp: Qwen3MoeSparseMoeBlock | Qwen3MoeMLP = (
            Qwen3MoeSparseMoeBlock(config, f"{prefix}.mlp", args)
            if config.is_sparse(layer)
            else Qwen3MoeMLP(h, config.intermediate_size, args)
        )
        norm = {"dtype": args.dtype, "device": args.device}
        self.input_layernorm = RMSNorm(h, eps, **norm)
        self.post_attention_layernorm = RMSNorm(h, eps, **norm)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output is ``hidden + residual``, returned apart: the
        next layer's norm adds them in its kernel, or at one token in the
        prologue of its q/k/v GEMM (as this layer's MLP block does for the
        post-attention norm)."""
        qkv, residual = rms_norm_linear(
            self.input_layernorm, self.self_attn.qkv_proj, hidden, residual
        )
        hidden = self.self_attn(positions, qkv)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: Qwen3MoeModelConfig, prefix: str, args: BuildArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=args.dtype, device=args.device
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, i, f"{prefix}.layers.{i}", args)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            dtype=args.dtype,
            device=args.device,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        assert residual is not None
        return self.norm.add_and_norm(hidden, residual)[0]


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARDS = {"gate": "w1", "up": "w3", "down": "w2"}


class Qwen3MoeForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]`` for one
    sequence; :meth:`compute_logits` maps hidden states to the vocabulary.

    ``prefix`` names the FusedMoE layers (unique per process while a model
    lives: several models in one process need distinct prefixes);
    ``ep_group`` shards the experts over its ranks (see the module
    docstring)."""

    config_class = Qwen3MoeModelConfig

    def __init__(
        self,
        config: Qwen3MoeModelConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        moe_backend: str = "auto",
        quantization: str | None = None,
        prefix: str = "",
        ep_group: GroupCoordinator | None = None,
        all2all_backend: str = "allgather_reducescatter",
        tp_group: GroupCoordinator | None = None,
    ):
        super().__init__()
        ep_ranks = None if ep_group is None else ep_group.ranks
        if tp_group is not None and ep_ranks != tp_group.ranks:
            raise ValueError(
                f"tp_group: tensor parallelism shards the experts over its own "
                f"ranks (an expert-parallel group of the same ranks), got "
                f"tp_group ranks {tp_group.ranks} and ep_group {ep_ranks}"
            )
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: expected None or one of {list(QUANTIZATIONS)}, got "
                f"{quantization!r}"
            )
        self.config = config
        self.tp_group = tp_group
        args = BuildArgs(
            dtype,
            device,
            moe_backend,
            quantization,
            ep_group,
            all2all_backend,
            tp_group,
        )
        self.model = Qwen3MoeModel(config, f"{prefix}model", args)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, args, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def moe_layers(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def _dense_tensors(self) -> dict[str, tuple[nn.Parameter, slice, Shard | None]]:
        """Every tensor a checkpoint names directly, as the parameter (and
        its rows) it loads into and, under tensor parallelism, the part of
        it this rank holds: the experts' load through their FusedMoE, q/k/v
        into their rows of ``qkv_proj``, a tied head is the embedding."""
        experts = {name for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        stacked = {
            f"{name}.qkv_proj.weight": (name, m.qkv_shards)
            for name, m in self.named_modules()
            if isinstance(m, Qwen3MoeAttention)
        }
        shards = {
            f"{name}.{proj}.weight": shard
            for name, m in self.named_modules()
            if isinstance(m, Qwen3MoeAttention | Qwen3MoeMLP)
            for proj, shard in m.checkpoint_shards.items()
        }
        tp = self.tp_group is not None
        tensors = {}
        for name, param in self.named_parameters():
            if name.rsplit(".", 1)[0] in experts:
                continue
            if name in stacked:
                prefix, parts = stacked[name]
                for part, rows in parts.items():
                    full = f"{prefix}.{part}.weight"
                    tensors[full] = (param, rows, shards[full] if tp else None)
            else:
                shard = shards.get(name) if tp else None
                tensors[name] = (param, slice(None), shard)
        return tensors

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        """Name, shape and dtype of every tensor of a checkpoint that this
        model (this expert-parallel rank) loads, experts as per-expert
        tensors; tensors that tensor parallelism splits in their full
        shape."""
        for name, (param, rows, shard) in self._dense_tensors().items():
            shape = tuple(param[rows].shape) if shard is None else shard[0]
            yield name, shape, param.dtype
        for name, layer in self.named_modules():
            if isinstance(layer, FusedMoE):
                moe = layer.moe
                h, i = moe.hidden_size, moe.intermediate_size
                for e in moe.placement.local_experts:
                    for part, shape in (
                        ("gate", (i, h)),
                        ("up", (i, h)),
                        ("down", (h, i)),
                    ):
                        yield f"{name}.{e}.{part}_proj.weight", shape, moe.in_dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by their Hugging Face names, then prepare
        the experts. Every parameter must be given once with its shape; an
        unknown, missing or mis-shaped tensor is an error naming it."""
        params = self._dense_tensors()
        experts = {
            name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)
        }
        missing = set(params)
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            if (m := _EXPERT.match(name)) and m.group(1) in experts:
                try:
                    experts[m.group(1)].weight_loader(
                        tensor, _SHARDS[m.group(3)], int(m.group(2))
                    )
                except ValueError as e:
                    raise ValueError(f"weights: {name!r}: {e}") from None
                continue
            if (m := _FUSED_EXPERTS.match(name)) and m.group(1) in experts:
                fused.setdefault(m.group(1), {})[m.group(2)] = tensor
                continue
            if name not in params:
                raise ValueError(f"weights: {name!r} is not a tensor of this model")
            param, rows, shard = params[name]
            target = param.data[rows]
            expected = tuple(target.shape) if shard is None else shard[0]
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"weights: {name!r} expected shape {list(expected)}, got "
                    f"{list(tensor.shape)}"
                )
            target.copy_(tensor if shard is None else tensor[shard[1]])
            missing.discard(name)
        for prefix, parts in fused.items():
            if parts.keys() != {"gate_up_proj", "down_proj"}:
                raise ValueError(
                    f"weights: {prefix} needs both gate_up_proj and down_proj"
                )
            experts[prefix].stacked_weight_loader(
                parts["gate_up_proj"], parts["down_proj"]
            )
        if missing:
            raise ValueError(f"weights: missing {sorted(missing)}")
        for layer in experts.values():
            layer.process_weights_after_loading()  # names unloaded expert shards
        for module in self.modules():
            if isinstance(module, MarlinLinear):
                module.process_weights_after_loading()
