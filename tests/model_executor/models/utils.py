"""A tiny random Qwen3-MoE checkpoint written by ``transformers`` at test
time (no hub): the parity oracle for our model."""

from pathlib import Path
from typing import Any

import torch
import transformers


def tiny_config(**overrides):
    """4 layers (layer 1 dense), hidden 128, 16 experts top-4, GQA 4:2."""
    values: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 192,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    values.update(overrides)
    return transformers.Qwen3MoeConfig(**values)


def save_tiny_model(path: Path, seed: int = 0, max_shard_size="2GB", **overrides):
    """Save a seeded random model; returns it (fp32, eval)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():  # larger than the init's std: routing and logits spread
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model
