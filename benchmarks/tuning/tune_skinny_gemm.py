"""Sweep ``skinny_gemm``'s launch configuration on Qwen3-30B-A3B's dense
decode shapes (router, q/k/v, output projection) at 1 and 2 rows; with
``--fused``, that of ``rms_norm_skinny_gemm`` (the residual add and RMSNorm
in the prologue) on the router and q/k/v at one row, against the norm's
kernel then the shipped ``skinny_gemm``.

Each configuration (weight rows per program, K step, warps) is checked
against the reference, then timed under CUDA-graph replay with
``torch.matmul`` in the same run, each call on another copy of the weight
(out of L2). Prints, per shape, the shipped configuration, the five fastest
and cuBLAS, with weight bytes per second as a fraction of the copy
bandwidth.

    PYTHONPATH=. python benchmarks/tuning/tune_skinny_gemm.py [--fused]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial

import torch
import triton

from benchmarks.kernels.benchmark_skinny_gemm import L2_BYTES, SHAPES
from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us
from vllm.model_executor.kernels.common import skinny_gemm as sg
from vllm.model_executor.kernels.common.rms_norm import rms_norm, rms_norm_reference

Norm = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # residual, weight, sum out

ITERS = 20
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (256, 512, 1024, 2048, 4096)  # at one row, K's own: whole-K tiles
WARPS = (2, 4, 8)
MAX_ACC = 128  # fp32 products (or 16-bit weight pairs) held per thread


def launch(
    x, w, out, block_n: int, block_k: int, warps: int, norm: Norm | None = None
) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    residual, norm_weight, total = norm or (None, None, None)
    sg._skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, residual, norm_weight, total, m, n, k, x.stride(0), w.stride(0),
        k, 1e-6, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=False, NORM=norm is not None, HAS_RESIDUAL=norm is not None,
        WHOLE_K=sg.skinny_tiles(m, k, norm is not None, block_k)[2], num_warps=warps,
    )  # fmt: skip
    return out


def sweep(layer: str, rows: int, copy_gbps: float, fused: bool) -> None:
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
    norm: Norm | None = None
    if fused:
        norm_weight = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
        norm = (torch.randn_like(x), norm_weight, torch.empty_like(x))
        normed, _ = rms_norm_reference(x, norm_weight, 1e-6, norm[0])
        ref = sg.skinny_gemm_reference(normed, weights[0])
    else:
        ref = sg.skinny_gemm_reference(x, weights[0])
    steps: dict[str, Callable[[int], object]] = {}

    def timed(bn: int, bk: int, warps: int, i: int) -> torch.Tensor:
        return launch(x, weights[i % copies], out, bn, bk, warps, norm)

    for config in itertools.product(BLOCK_N, BLOCK_K, WARPS):
        bn, bk, warps = config
        whole_k = sg.skinny_tiles(rows, k, fused, bk)[2]
        held = bn * bk // 2 if whole_k else rows * bn * bk
        if held > MAX_ACC * 32 * warps or bk > k:
            continue
        got = launch(x, weights[0], out, bn, bk, warps, norm)
        torch.testing.assert_close(got, ref, atol=0.5, rtol=2e-2)
        steps[str(config)] = partial(timed, bn, bk, warps)
    if norm is None:
        steps["cublas"] = lambda i: torch.matmul(x, weights[i % copies].T)
    else:
        residual, norm_weight, _ = norm
        steps["cublas"] = lambda i: sg.skinny_gemm(  # the unfused alternative
            rms_norm(x, norm_weight, 1e-6, residual)[0], weights[i % copies]
        )
    times = time_graphs_us(steps, ITERS)

    def line(name: str, us: float) -> str:
        frac = nbytes / (us * 1e-6) / (copy_gbps * 1e9)
        return f"    {name:<18} {us:7.2f} us  {frac:5.0%} of copy"

    print(f"{layer} {n}x{k} M={rows}{' norm prologue' if fused else ''}:")
    shipped = str((*sg.skinny_tiles(rows, k, fused)[:2], 4))
    if shipped in times:
        print(line(f"shipped {shipped}", times[shipped]))
    ranked = sorted((t, c) for c, t in times.items() if c != "cublas")
    for us, name in ranked[:5]:
        print(line(name, us))
    other = "norm + skinny_gemm" if fused else "cublas"
    print(line(other, times["cublas"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()} | copy {copy_gbps:.0f} GB/s | bf16")
    layers = ("router", "qkv_proj") if args.fused else ("router", "qkv_proj", "o_proj")
    for layer in layers:
        for rows in (1,) if args.fused else (1, 2):
            sweep(layer, rows, copy_gbps, args.fused)


if __name__ == "__main__":
    main()
