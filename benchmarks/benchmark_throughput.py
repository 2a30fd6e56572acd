"""Offline throughput: many requests of random token ids through
``LLM.generate`` (continuous batching, CUDA-graph decode), against the same
workload's first requests through ``transformers``' ``generate`` in the same
run (``--hf-requests``; 0 skips it).

Without ``--model`` the model is a preset's shapes with dummy weights, e.g.
on a GPU:

    python benchmarks/benchmark_throughput.py --preset qwen3-30b-a3b \
        --num-prompts 1000 --input-len 512 --output-len 256 --hf-requests 64

The default ``tiny`` preset runs on a CPU. ``--prefix-len N`` gives every
prompt the same first N tokens (a shared system prompt): with prefix
caching (the default; ``--no-enable-prefix-caching`` to compare) the
requests after the first skip its whole blocks.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.benchmarks.presets import MODEL_PRESETS, write_preset_config
from vllm.benchmarks.utils import add_parallel_args, parallel_engine_args, write_results
from vllm.transformers_utils.config import load_hf_config
from vllm.v1.engine.core_client import LoopTimes
from vllm.v1.request import Request
from vllm.v1.worker.workspace import current_workspace_manager


@dataclass
class ThroughputRow:
    engine: str
    model: str
    dtype: str
    quantization: str | None
    requests: int
    input_len: int
    output_len: int
    prefix_len: int  # the prompts' shared first tokens
    prefix_caching: bool
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]):
    llm = LLM(
        model_dir,
        load_format="auto" if args.model else "dummy",
        dtype=args.dtype,
        quantization=args.quantization,
        async_scheduling=args.async_scheduling,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        **parallel_engine_args(args),
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # warm-up on other prompts: the timed ones find nothing in the prefix cache
    vocab = llm.engine.model.config.vocab_size
    llm.generate([[(t + 1) % vocab for t in p] for p in prompts[:4]], params)
    device = llm.engine.device
    engine, times = llm.engine, LoopTimes()
    step = engine.step

    def timed_step() -> list[Request]:  # the server's engine-loop accounting
        start = time.monotonic()
        finished = step()
        times.add_step(engine.last_step, time.monotonic() - start)
        return finished

    engine.step = timed_step  # type: ignore[method-assign]
    _synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _synchronize(device)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
    mixed = times.steps - times.decode_steps
    print(
        f"engine steps: {times.steps} at {times.step_s * 1e3 / times.steps:.1f} ms "
        f"({times.decode_steps} decode-only at "
        f"{times.decode_s * 1e3 / max(times.decode_steps, 1):.1f} ms, {mixed} "
        f"mixed at {(times.step_s - times.decode_s) * 1e3 / max(mixed, 1):.1f} ms); "
        f"{times.tokens / times.steps:.0f} tokens/step"
    )
    stats = engine.stats()
    print(
        f"prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} "
        "prompt tokens found (the warm-up's included)"
    )
    report = current_workspace_manager().memory_report()
    kv_bytes = llm.engine.pool.num_blocks * llm.engine.runner.kv_block_bytes()
    print(
        f"KV cache: {llm.engine.pool.num_blocks} blocks of 16 tokens "
        f"({kv_bytes / 2**30:.2f} GiB); workspace at lock: {report.total_bytes} bytes"
    )
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # room for the transformers model
    return seconds


def run_transformers(
    args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]
) -> float:
    """``generate`` on a batch of the prompts (all of one length: no
    padding), greedy, exactly ``output_len`` new tokens; random weights
    when the model is a preset."""
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), torch_dtype=dtype
        ).to(device)
    else:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(
                config, torch_dtype=dtype
            )
    ids = torch.tensor(prompts, device=device)
    generate = dict(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        pad_token_id=0,
    )
    model.generate(ids[:1], **generate | {"max_new_tokens": 2, "min_new_tokens": 2})
    _synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate)
    _synchronize(device)
    seconds = time.perf_counter() - start
    assert out.shape[1] == args.input_len + args.output_len
    del model
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a local checkpoint directory")
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="tiny")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["fp8", "w4a16", "w4a8"])
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--prefix-len", type=int, default=0, help="first tokens shared by all prompts"
    )
    add_parallel_args(parser)
    parser.add_argument("--hf-requests", type=int, default=0)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if not 0 <= args.prefix_len <= args.input_len:
        parser.error(
            f"--prefix-len: expected 0..{args.input_len}, got {args.prefix_len}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.model.name if args.model else args.preset
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_preset_config(args.preset, Path(tmp))
        vocab = load_hf_config(model_dir)["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=gen)
        ids[:, : args.prefix_len] = ids[0, : args.prefix_len]
        prompts = ids.tolist()
        runs = [("ours", len(prompts), run_ours(args, model_dir, prompts))]
        if args.hf_requests:
            hf = prompts[: args.hf_requests]
            runs.append(
                ("transformers", len(hf), run_transformers(args, model_dir, hf))
            )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {device_name}")
    print(
        f"model {name} ({args.dtype}, {args.quantization or 'unquantized'}), "
        f"{args.input_len} in ({args.prefix_len} shared) / {args.output_len} out "
        f"per request, prefix caching {'on' if args.enable_prefix_caching else 'off'}"
    )
    print(
        f"{'engine':<13} {'requests':>8} {'seconds':>9} {'out tok/s':>11} {'tok/s':>11}"
    )
    rows = []
    for engine, n, seconds in runs:
        out_rate = n * args.output_len / seconds
        total_rate = n * (args.input_len + args.output_len) / seconds
        print(
            f"{engine:<13} {n:>8} {seconds:>9.2f} {out_rate:>11.1f} {total_rate:>11.1f}"
        )
        rows.append(
            ThroughputRow(
                engine,
                name,
                args.dtype,
                args.quantization,
                n,
                args.input_len,
                args.output_len,
                args.prefix_len,
                engine == "ours" and args.enable_prefix_caching,
                seconds,
                out_rate,
                total_rate,
            )
        )
    if len(rows) == 2:
        ratio = rows[0].output_tokens_per_s / rows[1].output_tokens_per_s
        print(f"ours / transformers (output tokens/s): {ratio:.1f}x")
    write_results(args.output_json, device_name, rows)


if __name__ == "__main__":
    main()
