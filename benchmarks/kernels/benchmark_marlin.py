"""Marlin-style W4A16 GEMM against a bf16 matmul, and the runtime op's cost.

For each (N, K) and M: ``marlin_gemm`` with its default path (where
``gemv_applies`` the CUDA-core decode kernel, else the tensor-core one),
the tensor-core kernel alone where the default is the decode kernel, and a
bf16 ``torch.matmul`` on the same shapes: CUDA-graph replay, timed in turn in
each repeat, each call reading its own copy of the weights (the copies
rotate past twice the L2, as a decode step reads weights L2 has not kept).
Then the weight-streaming rate (int4 weights + bf16 scales over the W4A16
time) and its fraction of the copy bandwidth measured in the same run, and
the host cost of ``torch.ops.vllm.marlin_gemm`` (workspace resolved inside
the op) over a direct kernel call with a given workspace.

    python -m benchmarks.kernels.benchmark_marlin --shapes 8192x8192
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us, write_results
from vllm.model_executor.kernels import marlin as kernel
from vllm.model_executor.kernels.marlin.config import default_config
from vllm.model_executor.kernels.marlin.gemv import gemv_applies
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    get_marlin_workspace,
    marlin_quantize_and_repack,
)
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

M_VALUES = [1, 4, 16, 64, 256, 1024, 4096]
SHAPES = [(4096, 4096), (8192, 8192), (28672, 4096), (4096, 14336)]
GROUP_SIZE = 128
L2_BYTES = 50 * 2**20  # H200
ITERS = 20  # calls per graph


@dataclass
class Row:
    n: int
    k: int
    m: int
    marlin_us: float
    tensor_core_us: float | None  # the tensor-core kernel, where not the default
    bf16_us: float
    speedup: float
    weight_gbps: float
    copy_frac: float


def _copies(nbytes: int) -> int:
    return max(1, -(-2 * L2_BYTES // nbytes))


def time_point(
    m: int,
    w4: list[tuple[torch.Tensor, torch.Tensor]],
    bf16: list[torch.Tensor],
) -> dict[str, float]:
    """Microseconds per call of the default path, bf16, and the tensor-core
    kernel where it is not the default, at M rows."""
    n, k = bf16[0].shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    workspace = get_marlin_workspace("cuda")

    def w4a16(i: int, config: kernel.MarlinConfig | None = None) -> None:
        p, s = w4[i % len(w4)]
        kernel.marlin_gemm(
            a, p, s, workspace, group_size=GROUP_SIZE, size_n=n, size_k=k,
            out=out, config=config,
        )  # fmt: skip

    steps: dict[str, Callable[[int], object]] = {
        "w4a16": w4a16,
        "bf16": lambda i: torch.matmul(a, bf16[i % len(bf16)].t(), out=out),
    }
    if gemv_applies(m):
        tc = default_config(m, n, k, a.device)
        steps["tensor core"] = lambda i: w4a16(i, tc)
    return time_graphs_us(steps, ITERS)


def bench_shape(n: int, k: int, ms: list[int], copy_gbps: float) -> list[Row]:
    w = torch.randn(n, k, device="cuda") / k**0.5
    packed, scales = marlin_quantize_and_repack(w, GROUP_SIZE, torch.bfloat16)
    weight_bytes = packed.nbytes + scales.nbytes
    w4 = [(packed.clone(), scales.clone()) for _ in range(_copies(weight_bytes))]
    w_bf16 = w.to(torch.bfloat16)
    bf16 = [w_bf16.clone() for _ in range(_copies(w_bf16.nbytes))]
    rows = []
    for m in ms:
        us = time_point(m, w4, bf16)
        gbps = weight_bytes / (us["w4a16"] * 1e-6) / 1e9
        speedup = us["bf16"] / us["w4a16"]
        row = Row(n, k, m, us["w4a16"], us.get("tensor core"), us["bf16"], speedup,
                  gbps, gbps / copy_gbps)  # fmt: skip
        rows.append(row)
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
        f"W4A16 uint4, group {GROUP_SIZE}, bf16; CUDA-graph replay, timed in turn"
    )
    head = (
        f"{'N x K':>12} {'M':>5} | {'W4A16 us':>9} {'tensor-core us':>14} "
        f"{'bf16 us':>8} {'x bf16':>7} | {'weights GB/s':>12} {'copy%':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        tc = "-" if r.tensor_core_us is None else f"{r.tensor_core_us:.1f}"
        print(
            f"{f'{r.n}x{r.k}':>12} {r.m:>5} | {r.marlin_us:>9.1f} {tc:>14} "
            f"{r.bf16_us:>8.1f} {r.speedup:>7.2f} | {r.weight_gbps:>12.0f} "
            f"{100 * r.copy_frac:>5.0f}%"
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
