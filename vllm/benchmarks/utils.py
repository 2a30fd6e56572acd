"""Timing and result helpers of the benchmark scripts under ``benchmarks/``."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vllm.entrypoints.cli.serve import ALL2ALL_BACKENDS

# H200 SXM dense tensor-core peaks (TFLOP/s, no sparsity), by operand dtype.
H200_PEAK_TFLOPS = {torch.bfloat16: 989.0, torch.float8_e4m3fn: 1979.0}


def time_graph_us(step: Callable[[int], object], iters: int, repeats: int = 5) -> float:
    """Per-iteration time of ``iters`` steps captured in one CUDA graph."""
    return time_graphs_us({"step": step}, iters, repeats)["step"]


def time_graphs_us(
    steps: Mapping[str, Callable[[int], object]], iters: int, repeats: int = 5
) -> dict[str, float]:
    """:func:`time_graph_us` of several steps, replayed in turn in each
    repeat: the H200 slows down under sustained GEMM load (up to 10% within
    seconds), which would bias whichever step is timed last.

    Warm-up and capture run on the same side stream, so stream-scoped
    resources created during warm-up are the ones the graphs use.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    for name, step in steps.items():
        with torch.cuda.stream(stream):
            for i in range(iters):
                step(i)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(iters):
                step(i)
        graph.replay()
        torch.cuda.synchronize()
        graphs[name] = graph
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, graph in graphs.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def time_cpu_us(step: Callable[[int], object], iters: int) -> float:
    step(0)
    start = time.perf_counter()
    for i in range(iters):
        step(i)
    return (time.perf_counter() - start) * 1e6 / iters


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written, timed outside graphs
    (graph replay of one huge copy reads low on this machine)."""
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    src = torch.empty(2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def write_results(
    path: Path | None, device: str, rows: Sequence[Any], **extra: object
) -> None:
    """The benchmark's JSON: device, extra fields, then one object per row
    (dataclass instances); nothing when ``path`` is None."""
    if path is not None:
        payload = {"device": device, **extra, "rows": [asdict(r) for r in rows]}
        path.write_text(json.dumps(payload, indent=2))


def add_moe_dims_args(parser: argparse.ArgumentParser) -> None:
    """A MoE layer's dimensions, Qwen3-30B-A3B's by default."""
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=768)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Data / tensor + expert parallelism flags, as ``vllm serve`` spells
    them."""
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument(
        "--all2all-backend", choices=ALL2ALL_BACKENDS, default=ALL2ALL_BACKENDS[0]
    )
    parser.add_argument("--enable-dbo", action="store_true")


def parallel_flags(args: argparse.Namespace) -> list[str]:
    """:func:`add_parallel_args`' flags as given, for a command line."""
    flags = ["--data-parallel-size", str(args.data_parallel_size)]
    flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    flags += ["--all2all-backend", args.all2all_backend]
    flags += ["--enable-expert-parallel"] if args.enable_expert_parallel else []
    return flags + (["--enable-dbo"] if args.enable_dbo else [])


def parallel_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` keyword arguments of :func:`add_parallel_args`' flags."""
    return {
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "all2all_backend": args.all2all_backend,
        "enable_dbo": args.enable_dbo,
    }
