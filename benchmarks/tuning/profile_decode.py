"""Where a decode step's time goes: the engine step (host + GPU), the CUDA
graph replay alone, and the GPU kernels of one eager step by total time.

Run on a CUDA device from the repository root::

    PYTHONPATH=. python benchmarks/tuning/profile_decode.py --batch-size 1
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vllm import LLM
from vllm.benchmarks.presets import MODEL_PRESETS, write_preset_config
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(MODEL_PRESETS), default="qwen3-30b-a3b"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--quantization", choices=["fp8", "w4a16", "w4a8"])
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            write_preset_config(args.preset, Path(tmp)),
            load_format="dummy",
            dtype="bfloat16",
            quantization=args.quantization,
            max_model_len=args.input_len + 256,
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=max(args.batch_size * args.input_len, 256),
            async_scheduling=args.async_scheduling,
        )
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.model.config.vocab_size
    for i in range(args.batch_size):
        ids = torch.randint(0, vocab, (args.input_len,)).tolist()
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        engine.add_request(Request(f"r{i}", ids, params))
    while (
        any(
            r.num_computed_tokens < len(r.prompt_token_ids)
            for r in engine.scheduler.running
        )
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / 50

    graph = runner.graphs[min(s for s in runner.graphs if s >= args.batch_size)].graph
    with runner.on_stream():
        begin, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        begin.record()
        for _ in range(50):
            graph.replay()
        end.record()
    end.synchronize()
    replay_ms = begin.elapsed_time(end) / 50
    with runner.on_stream(), profile(activities=[ProfilerActivity.CUDA]) as replays:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()

    chunks = engine.scheduler.schedule()
    # no graph at all: a decode step would otherwise replay one with prefill
    graphs, runner.graphs = runner.graphs, {}
    mixed, runner.mixed_graphs = runner.mixed_graphs, {}
    with runner.on_stream():
        runner.execute(chunks, engine.pool)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.execute(chunks, engine.pool)
            torch.cuda.synchronize()
    runner.graphs, runner.mixed_graphs = graphs, mixed
    print(
        f"engine step {step_ms:.3f} ms | graph replay {replay_ms:.3f} ms "
        f"(batch {args.batch_size})"
    )
    for title, trace in (("graph replays", replays), ("eager steps", prof)):
        print(f"GPU kernels of 5 {title}:")
        print(
            trace.key_averages().table(
                sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
            )
        )


if __name__ == "__main__":
    main()
