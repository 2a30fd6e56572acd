"""Offline generation with ``LLM.generate`` (the README's main job).

Without ``--model`` it builds a tiny random Qwen3-MoE with a locally trained
tokenizer under ``out/tiny-qwen3-moe`` (no download, runs on a CPU): its
random weights write random bytes, but the path through the engine (workspace
manager, shared permute scratch, experts, paged KV cache, scheduler) is the
real one. Point
``--model`` at a local Hugging Face Qwen3-MoE checkpoint directory
(``config.json``, ``*.safetensors``, tokenizer files) to run it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.tiny_checkpoint import demo_checkpoint
from vllm.v1.worker.workspace import current_workspace_manager

PROMPTS = ["def load(fp, *, cls=None):", "import json\n", "The decoder", '{"a": [']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a local checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args()
    model = args.model or demo_checkpoint()
    llm = LLM(model, device=args.device, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        print(f"{out.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    print(current_workspace_manager().memory_report().format())


if __name__ == "__main__":
    main()
