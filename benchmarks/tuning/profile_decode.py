"""Where a decode step's time goes: the engine step (host + GPU), the CUDA
graph replay alone, and the GPU kernels of a replay and of an eager step by
total time (a short table each). With programmatic dependent launch a
replay's kernels overlap, so their durations add up to more than the
replay: the replay's chain table charges each kernel only the time it adds
past every kernel before it (its end minus the latest end so far), and the
idle time before it separately; the two columns sum to the replay.

Run on a CUDA device from the repository root::

    PYTHONPATH=. python benchmarks/tuning/profile_decode.py --batch-size 1
"""

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
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
    for title, trace in (("graph replay", replays), ("eager step", prof)):
        print_kernels(title, trace, runs=5)
    print_chain(replays, runs=5)


def print_kernels(title: str, trace: profile, runs: int) -> None:
    """The GPU kernels of one ``title``, by time: microseconds per run, calls
    per run (a decoder layer's kernels: one per layer) and per call."""
    kernels = [
        (e.key, e.self_device_time_total / runs, e.count / runs)
        for e in trace.key_averages()
        if e.self_device_time_total > 0
    ]
    kernels.sort(key=lambda k: -k[1])
    print(f"GPU kernels per {title} (mean of {runs}):")
    print(f"{'kernel':<64} {'us':>9} {'calls':>6} {'us/call':>8}")
    for name, us, calls in kernels[:20]:
        print(f"{name[:64]:<64} {us:9.1f} {calls:6.0f} {us / calls:8.2f}")
    total = f"all {len(kernels)} kernels"
    print(f"{total:<64} {sum(k[1] for k in kernels):9.1f}")


def print_chain(trace: profile, runs: int) -> None:
    """Each kernel's share of ``runs`` graph replays' span: the time its end
    lies past the latest end before it, and the idle time before its start
    (the gaps between replays included)."""
    kernels = sorted(
        (e for e in trace.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    added: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    reach = kernels[0].time_range.start if kernels else 0.0
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        idle[e.name] += max(0.0, start - reach) / runs
        added[e.name] += max(0.0, end - max(reach, start)) / runs
        calls[e.name] += 1
        reach = max(reach, end)
    print(f"critical path of a graph replay (mean of {runs}):")
    print(f"{'kernel':<56} {'added us':>9} {'idle us':>8} {'per call':>8}")
    for name in sorted(added, key=lambda n: -(added[n] + idle[n]))[:20]:
        per_call = (added[name] + idle[name]) * runs / calls[name]
        print(f"{name[:56]:<56} {added[name]:9.1f} {idle[name]:8.1f} {per_call:8.2f}")
    total = sum(added.values()) + sum(idle.values())
    print(f"{'span':<56} {total:9.1f}")


if __name__ == "__main__":
    main()
