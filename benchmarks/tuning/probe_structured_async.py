"""Do grammar requests change the tokens of the free requests beside them
between sync and async scheduling? On the H100 (2026-12-05, bf16, CUDA
graphs) two of 32 free requests differed between the modes, each mode
repeatable, none without grammars and none on the CPU. The runs below
tell batch composition (async keeps finished requests one step longer,
and GPU kernels are not batch-invariant) from a defect: the grammar rows
replaced by free rows of the same output lengths, then the free rows
greedy. Needs a GPU, xgrammar and the tokenizer of the tiny checkpoint.

    PYTHONPATH=. python benchmarks/tuning/probe_structured_async.py
"""

from __future__ import annotations

import gc
import tempfile

import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.worker.workspace import reset_workspace_manager

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputsParams(choice=["yes", "no", 'maybe "so"']),
    StructuredOutputsParams(regex=r"[a-z]{3,12}-[0-9]{2,9}"),
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
]
REQUESTS = 32  # every fourth one free


def run(
    checkpoint: str,
    async_scheduling: bool,
    lengths: list[int] | None = None,
    greedy_free: bool = False,
) -> list[list[int]]:
    """Each request's tokens; with ``lengths``, the grammar rows are free
    rows of those output lengths."""
    reset_workspace_manager()
    llm = LLM(
        checkpoint, dtype="bfloat16", max_model_len=256,
        async_scheduling=async_scheduling, gpu_memory_utilization=0.3,
    )  # fmt: skip
    params = []
    for i in range(REQUESTS):
        free = i % 4 == 0
        if lengths is not None and not free:
            params.append(
                SamplingParams(seed=i, max_tokens=lengths[i], ignore_eos=True)
            )
            continue
        params.append(
            SamplingParams(
                temperature=0.0 if greedy_free and free else 1.0,
                seed=i,
                max_tokens=60,
                min_tokens=2 if i % 5 == 0 else 0,
                structured_outputs=None if free else SPECS[i % 3],
            )
        )
    prompts = [[5 + i] * (10 + i) for i in range(REQUESTS)]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def differ(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def main() -> None:
    checkpoint = tempfile.mkdtemp()
    build_tiny_checkpoint(checkpoint)
    print(f"device: {torch.cuda.get_device_name()}")
    grammar_sync, grammar_async = run(checkpoint, False), run(checkpoint, True)
    print("grammars: sync vs async differ in", differ(grammar_sync, grammar_async))
    lengths = [len(t) for t in grammar_sync]
    free_sync = run(checkpoint, False, lengths)
    free_async = run(checkpoint, True, lengths)
    print("same lengths, free: sync vs async differ in", differ(free_sync, free_async))
    free_rows = [i for i in differ(grammar_sync, free_sync) if i % 4 == 0]
    print("free rows beside grammars vs beside free rows (sync) differ in", free_rows)
    greedy_sync = run(checkpoint, False, greedy_free=True)
    greedy_async = run(checkpoint, True, greedy_free=True)
    print("grammars, free rows greedy: differ in", differ(greedy_sync, greedy_async))


if __name__ == "__main__":
    main()
