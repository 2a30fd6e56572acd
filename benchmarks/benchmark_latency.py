"""Latency of one batch through ``LLM.generate``: time to first token and
time per output token, against the HBM bound of a decode step.

The bound is the bytes one decode step must read (the attention, dense and
router weights, the distinct experts the batch's tokens can route to, the
embedding rows, the head, the KV cache so far) over the copy bandwidth
measured in the same run. Without ``--model`` the model is a preset's shapes
with dummy weights (``load_format="dummy"``; only a ``config.json`` is
written), e.g. ``--preset qwen3-30b-a3b`` on a GPU; the default ``tiny``
runs on a CPU.

    python benchmarks/benchmark_latency.py --preset qwen3-30b-a3b --batch-size 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.benchmarks.presets import MODEL_PRESETS, write_preset_config
from vllm.benchmarks.utils import (
    add_parallel_args,
    copy_bandwidth_gbps,
    parallel_engine_args,
    write_results,
)
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM


@dataclass
class LatencyRow:
    model: str
    dtype: str
    quantization: str | None
    batch_size: int
    input_len: int
    output_len: int
    async_scheduling: bool
    temperature: float
    ttft_ms: float
    tpot_ms: float
    bound_ms: float  # bytes of a decode step over the copy bandwidth
    copy_gbps: float


def decode_step_bytes(
    model: Qwen3MoeForCausalLM, batch: int, context: int, itemsize: int
) -> int:
    """Bytes a decode step of ``batch`` sequences of ``context`` tokens reads."""
    config = model.config
    total = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name
    )  # dense weights and the head; prepared experts are not parameters
    total += batch * config.hidden_size * itemsize  # embedding rows
    for layer in model.moe_layers():
        assert layer.kernel is not None
        experts = layer.kernel.experts
        expert_bytes = (
            sum(
                t.numel() * t.element_size()
                for t in vars(experts).values()
                if isinstance(t, torch.Tensor)
            )
            // layer.moe.num_local_experts
        )
        active = min(layer.moe.num_experts, batch * layer.moe.experts_per_token)
        total += active * expert_bytes
    kv_token = 2 * config.num_key_value_heads * config.head_dim * itemsize
    total += config.num_hidden_layers * batch * context * kv_token
    return total


def measure_latency(
    llm: LLM,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    temperature: float,
) -> tuple[float, float]:
    """``(TTFT, TPOT)`` in seconds, best of ``num_iters`` batches of random
    prompts, after a warm-up."""
    vocab = llm.engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cuda = torch.cuda.is_available()

    def timed(max_tokens: int) -> float:
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True
        )
        best = float("inf")
        for _ in range(num_iters):
            # new prompts every time: none of the prefill is in the prefix cache
            prompts = torch.randint(0, vocab, (batch_size, input_len), generator=gen)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts.tolist(), params)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    timed(2)  # warm-up (kernel compilation)
    ttft = timed(1)
    return ttft, (timed(output_len) - ttft) / (output_len - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a local checkpoint directory")
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="tiny")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["fp8", "w4a16", "w4a8"])
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None
    )
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; vLLM's own latency benchmark samples at 1.0, which "
        "puts random sampling's work in every step",
    )
    add_parallel_args(parser)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_preset_config(args.preset, Path(tmp))
        llm = LLM(
            model_dir,
            load_format="auto" if args.model else "dummy",
            dtype=args.dtype,
            device=str(device),
            quantization=args.quantization,
            async_scheduling=args.async_scheduling,
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=max(args.batch_size * args.input_len, 256),
            **parallel_engine_args(args),
        )
    ttft, tpot = measure_latency(
        llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
        args.temperature,
    )  # fmt: skip
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    context = args.input_len + args.output_len // 2
    step_bytes = decode_step_bytes(llm.engine.model, args.batch_size, context, itemsize)
    bandwidth = copy_bandwidth_gbps(device)
    bound_ms = step_bytes / (bandwidth * 1e9) * 1e3
    name = args.model.name if args.model else args.preset
    overlapped = bool(llm.engine.config.async_scheduling)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {device_name}")
    print(
        f"model {name} ({args.dtype}, {args.quantization or 'unquantized'}), "
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out, "
        f"temperature {args.temperature:g}, async scheduling "
        f"{'on' if overlapped else 'off'}; copy {bandwidth:.0f} GB/s"
    )
    print(
        f"TTFT {ttft * 1e3:.2f} ms | TPOT {tpot * 1e3:.3f} ms | HBM bound "
        f"{bound_ms:.3f} ms ({step_bytes / 2**20:.1f} MiB/step) | "
        f"TPOT / bound {tpot * 1e3 / bound_ms:.2f}x"
    )
    row = LatencyRow(
        name, args.dtype, args.quantization, args.batch_size, args.input_len,
        args.output_len, overlapped, args.temperature, ttft * 1e3, tpot * 1e3,
        bound_ms, bandwidth,
    )  # fmt: skip
    write_results(args.output_json, device_name, [row])


if __name__ == "__main__":
    main()
