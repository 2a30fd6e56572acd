"""Model shapes the engine benchmarks run with dummy weights: a preset is a
``config.json`` (no weights; ``load_format="dummy"`` fills them in place).
``tiny`` runs on a CPU; the others are real models' shapes for the GPU."""

from __future__ import annotations

import json
from pathlib import Path

from vllm.model_executor.model_loader.tiny_checkpoint import TINY_CONFIG

# What Qwen3's MoE models share
_QWEN3_MOE: dict[str, object] = {
    "vocab_size": 151936,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "rope_theta": 1e6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}

MODEL_PRESETS: dict[str, dict[str, object]] = {
    "tiny": TINY_CONFIG,
    "qwen3-30b-a3b": _QWEN3_MOE
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    # expert parallelism over 8 GPUs: 470 GB of bf16 weights
    "qwen3-235b-a22b": _QWEN3_MOE
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
}


def write_preset_config(preset: str, root: Path) -> Path:
    """``root`` with the preset's ``config.json`` written in it."""
    config = MODEL_PRESETS[preset] | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
    }
    (root / "config.json").write_text(json.dumps(config))
    return root
