"""Marlin-style W4A16 GEMM against a bf16 matmul, and the runtime op's cost.

For each (N, K) and M: the Triton W4A16 kernel and bf16 ``torch.matmul`` on
the same shapes, both timed with ``triton.testing.do_bench`` (median); the
weight-streaming rate (int4 weights + bf16 scales over the W4A16 time) and its
fraction of the copy bandwidth measured in the same run. Then the host cost of
``torch.ops.vllm.marlin_gemm`` (workspace resolved inside the op) over a
direct kernel call with a given workspace.

    python -m benchmarks.kernels.benchmark_marlin --shapes 8192x8192
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.benchmarks.utils import copy_bandwidth_gbps, write_results
from vllm.model_executor.kernels import marlin as kernel
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    get_marlin_workspace,
    marlin_quantize_and_repack,
)
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096)]
GROUP_SIZE = 128


@dataclass
class Row:
    n: int
    k: int
    m: int
    marlin_us: float
    bf16_us: float
    speedup: float
    weight_gbps: float
    copy_frac: float


def bench_shape(n: int, k: int, ms: list[int], copy_gbps: float) -> list[Row]:
    import triton.testing

    w = torch.randn(n, k, device="cuda") / k**0.5
    packed, scales = marlin_quantize_and_repack(w, GROUP_SIZE, torch.bfloat16)
    w_bf16 = w.to(torch.bfloat16)
    workspace = get_marlin_workspace("cuda")
    weight_bytes = packed.nbytes + scales.nbytes
    rows = []
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def run_marlin(a: torch.Tensor = a, out: torch.Tensor = out) -> None:
            kernel.marlin_gemm(
                a,
                packed,
                scales,
                workspace,
                group_size=GROUP_SIZE,
                size_n=n,
                size_k=k,
                out=out,
            )

        marlin_us = 1e3 * triton.testing.do_bench(run_marlin, return_mode="median")
        bf16_us = 1e3 * triton.testing.do_bench(
            lambda a=a: torch.matmul(a, w_bf16.t()), return_mode="median"
        )
        gbps = weight_bytes / (marlin_us * 1e-6) / 1e9
        rows.append(
            Row(
                n, k, m, marlin_us, bf16_us, bf16_us / marlin_us, gbps, gbps / copy_gbps
            )
        )
    return rows


def host_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Host time per call of the op and of its parts, on a tiny GEMM (the
    host, not the GPU, sets the pace): the differences split the op's cost
    into dispatch and the workspace lookup."""
    n, k = 256, 256
    w = torch.randn(n, k, device="cuda")
    packed, scales = marlin_quantize_and_repack(w, GROUP_SIZE, torch.bfloat16)
    a = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w_bf16 = w.to(torch.bfloat16)
    workspace = get_marlin_workspace("cuda")

    def per_call(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed * 1e6 / calls

    op = torch.ops.vllm.marlin_gemm
    return {
        "op, workspace resolved inside": per_call(
            lambda: op(a, packed, scales, None, GROUP_SIZE, n, k)
        ),
        "op, workspace given": per_call(
            lambda: op(a, packed, scales, workspace, GROUP_SIZE, n, k)
        ),
        "direct kernel call": per_call(
            lambda: kernel.marlin_gemm(
                a, packed, scales, workspace, group_size=GROUP_SIZE, size_n=n, size_k=k
            )
        ),
        "workspace lookup alone": per_call(lambda: get_marlin_workspace(a.device)),
        "bf16 torch.matmul": per_call(lambda: a @ w_bf16.t()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK, e.g. 8192x8192")
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES)
    parser.add_argument("--host-only", action="store_true", help="host costs only")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmark_marlin needs a CUDA device (the CPU path is a reference)"
        )
    shapes = (
        [tuple(int(x) for x in s.split("x")) for s in args.shapes]
        if args.shapes
        else SHAPES
    )
    torch.manual_seed(0)
    reset_workspace_manager()
    init_workspace_manager("cuda")
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    rows: list[Row] = []
    for n, k in tqdm([] if args.host_only else shapes, desc="shapes"):
        rows += bench_shape(n, k, args.m, copy_gbps)
    host_us = host_overhead_us()
    reset_workspace_manager()

    print(
        f"\ndevice: {torch.cuda.get_device_name()}; copy {copy_gbps:.0f} GB/s; "
        f"W4A16 uint4, group {GROUP_SIZE}, bf16"
    )
    head = (
        f"{'N x K':>12} {'M':>5} | {'W4A16 us':>9} {'bf16 us':>8} {'x bf16':>7} | "
        f"{'weights GB/s':>12} {'copy%':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{f'{r.n}x{r.k}':>12} {r.m:>5} | {r.marlin_us:>9.1f} {r.bf16_us:>8.1f} "
            f"{r.speedup:>7.2f} | {r.weight_gbps:>12.0f} {100 * r.copy_frac:>5.0f}%"
        )
    print("host time per call (M=1, 256x256):")
    for name, us in host_us.items():
        print(f"  {name:<32} {us:>6.1f} us")
    write_results(
        args.output_json,
        torch.cuda.get_device_name(),
        rows,
        copy_gbps=copy_gbps,
        host_us=host_us,
    )


if __name__ == "__main__":
    main()
