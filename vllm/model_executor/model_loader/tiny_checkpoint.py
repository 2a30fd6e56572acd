"""A tiny random Qwen3-MoE checkpoint built locally: the demo's and tests'
model when no real checkpoint can be downloaded.

``transformers`` writes the model (random weights from a seed, per-expert
tensors as real Qwen3-MoE checkpoints store them); a byte-level BPE trained
in well under a second on this Python's own ``json`` package sources is its
tokenizer (vocabulary = the model's, special tokens and a chat template as
Qwen's).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's shape, its enable_thinking switch and its tools included: the
# tools listed in the system turn, an assistant's calls as <tool_call> JSON,
# a tool's reply as a user turn's <tool_response> (simpler than Qwen3's:
# each reply its own turn, no newline before a call)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nCall a "
    'function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.'
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>\n"
    '{"name": "{{ c[\'function\'][\'name\'] }}", "arguments": '
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TINY_CONFIG: dict[str, Any] = {
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


def train_tokenizer(vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, Qwen's specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sources = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(s) for s in sources], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    weight_std: float = 0.08,
    max_shard_size: str = "2GB",
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Any:
    """Write the checkpoint to ``path``; returns the ``transformers`` model
    (fp32, eval): the parity oracle. ``weight_std`` larger than the init's
    spreads routing and logits (fewer near-ties)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**(TINY_CONFIG | overrides))
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, weight_std)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if with_tokenizer:
        train_tokenizer(config.vocab_size).save_pretrained(path)
    return model


def demo_checkpoint(path: Path = Path("out/tiny-qwen3-moe")) -> Path:
    """The examples' model: ``path``, built there (with its tokenizer) on
    first use."""
    if not (path / "config.json").is_file():
        build_tiny_checkpoint(path)
        print(f"built a tiny random Qwen3-MoE in {path}")
    return path
