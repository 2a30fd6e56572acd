"""Sweep ``skinny_gemm``'s launch configuration on Qwen3-30B-A3B's dense
decode shapes (router, q/k/v, output projection) at 1 and 2 rows.

Each configuration (weight rows per program, K step, warps) is checked
against the reference, then timed under CUDA-graph replay with
``torch.matmul`` in the same run, each call on another copy of the weight
(out of L2). Prints, per shape, the shipped configuration, the five fastest
and cuBLAS, with weight bytes per second as a fraction of the copy
bandwidth.

    PYTHONPATH=. python benchmarks/tuning/tune_skinny_gemm.py
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch
import triton

from benchmarks.kernels.benchmark_skinny_gemm import L2_BYTES, SHAPES
from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us
from vllm.model_executor.kernels.common import skinny_gemm as sg

ITERS = 20
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (256, 512, 1024, 2048)
WARPS = (2, 4, 8)
MAX_ACC = 128  # fp32 products held per thread: beyond, spills


def launch(x, w, out, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    sg._skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=False, num_warps=warps,
    )  # fmt: skip
    return out


def sweep(layer: str, rows: int, copy_gbps: float) -> None:
    """Check, time and print every configuration of one shape."""
    n, k = SHAPES[layer]
    nbytes = n * k * 2
    copies = max(2, -(-2 * L2_BYTES // nbytes))
    device = torch.device("cuda")
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)
    ]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    ref = sg.skinny_gemm_reference(x, weights[0])
    steps: dict[str, Callable[[int], object]] = {}
    for config in itertools.product(BLOCK_N, BLOCK_K, WARPS):
        bn, bk, warps = config
        if triton.next_power_of_2(rows) * bn * bk > MAX_ACC * 32 * warps or bk > k:
            continue
        got = launch(x, weights[0], out, *config)
        torch.testing.assert_close(got, ref, atol=0.5, rtol=2e-2)
        steps[str(config)] = partial(
            lambda i, c: launch(x, weights[i % copies], out, *c), c=config
        )
    steps["cublas"] = lambda i: torch.matmul(x, weights[i % copies].T)
    times = time_graphs_us(steps, ITERS)

    def line(name: str, us: float) -> str:
        frac = nbytes / (us * 1e-6) / (copy_gbps * 1e9)
        return f"    {name:<18} {us:7.2f} us  {frac:5.0%} of copy"

    print(f"{layer} {n}x{k} M={rows}:")
    shipped = str((sg._BLOCK_N, sg._BLOCK_K, 4))
    if shipped in times:
        print(line(f"shipped {shipped}", times[shipped]))
    ranked = sorted((t, c) for c, t in times.items() if c != "cublas")
    for us, name in ranked[:5]:
        print(line(name, us))
    print(line("cublas", times["cublas"]), flush=True)


def main() -> None:
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()} | copy {copy_gbps:.0f} GB/s | bf16")
    for layer in ("router", "qkv_proj", "o_proj"):
        for rows in (1, 2):
            sweep(layer, rows, copy_gbps)


if __name__ == "__main__":
    main()
