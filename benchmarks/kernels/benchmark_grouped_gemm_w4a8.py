"""W4A8 grouped GEMMs (uint4 weights, fp8 activations) against the fp8 ones.

On the two expert GEMMs of a MoE layer (default: qwen3-30b-a3b, 128 experts,
top-8, hidden 2048, intermediate 768) with uniform random routing, as the
triton_w4a8 layer runs them (GEMM1 gathering its rows, with the gated
activation): the warp-specialized Hopper kernels (``hopper``, given the
scales' steps), the Triton W4A8 kernels (``triton``), and the fp8 kernels
on fp8 weights of the same shapes (``fp8``: what a user of the FP8 layer
runs; W4A8 reads half its weight bytes). Timed under CUDA-graph replay, in
turn in each repeat; TFLOP/s of the products, the fraction of the H200's
dense fp8 peak, weight bytes streamed per second (each routed expert's
weights once) and the time over the fp8 kernel's. Before timing, the
Hopper kernels' outputs are checked against the Triton W4A8 kernels'.

    python -m benchmarks.kernels.benchmark_grouped_gemm_w4a8 --tokens 64 8192
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.benchmarks.utils import (
    H200_PEAK_TFLOPS,
    add_moe_dims_args,
    time_graphs_us,
    write_results,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
)
from vllm.model_executor.kernels.grouped_gemm.hopper_uint4 import w4_scale_steps
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
    quantize_w4,
)

KERNELS = ("hopper", "triton", "fp8")


@dataclass
class Row:
    gemm: str
    tokens: int
    kernel: str
    us: float
    tflops: float
    peak_fraction: float
    weight_tbps: float
    x_fp8: float


def bench(tokens: int, args: argparse.Namespace) -> list[Row]:
    experts, topk = args.num_experts, args.topk
    hidden, inter = args.hidden_size, args.intermediate_size
    rows = tokens * topk
    ids = torch.randint(0, experts, (rows,), device="cuda")
    src_routes = torch.sort(ids, stable=True).indices.to(torch.int32)
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.bincount(ids, minlength=experts).cumsum(0)
    routed = int(torch.unique(ids).numel())
    a = torch.randn(tokens, hidden, device="cuda").to(FP8_DTYPE)
    a_scale = torch.rand(tokens, device="cuda") + 0.1
    act_q = torch.randn(rows, inter, device="cuda").to(FP8_DTYPE)
    act_scale = torch.rand(rows, device="cuda") + 0.1
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda") / inter**0.5
    (w13_q, w13_s), (w2_q, w2_s) = quantize_w4(w13), quantize_w4(w2)
    w13_steps, w2_steps = w4_scale_steps(w13_s), w4_scale_steps(w2_s)
    w13_8, w2_8 = w13.to(FP8_DTYPE), w2.to(FP8_DTYPE)
    w13_8s = torch.rand(experts, 2 * inter, device="cuda")
    w2_8s = torch.rand(experts, hidden, device="cuda")
    del w13, w2
    outs = {
        kernel: (
            torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16),
            torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16),
        )
        for kernel in KERNELS
    }
    gated_args = (a, a_scale, src_routes, topk)
    runs = {
        ("gate_up", "hopper"): lambda _: grouped_gemm_w4a8_gated(
            *gated_args, w13_q, w13_s, offsets, "silu", outs["hopper"][0],
            scale_steps=w13_steps,
        ),
        ("gate_up", "triton"): lambda _: grouped_gemm_w4a8_gated(
            *gated_args, w13_q, w13_s, offsets, "silu", outs["triton"][0]
        ),
        ("gate_up", "fp8"): lambda _: grouped_gemm_fp8_gated(
            *gated_args, w13_8, w13_8s, offsets, "silu", outs["fp8"][0]
        ),
        ("down", "hopper"): lambda _: grouped_gemm_w4a8(
            act_q, act_scale, w2_q, w2_s, offsets, outs["hopper"][1],
            scale_steps=w2_steps,
        ),
        ("down", "triton"): lambda _: grouped_gemm_w4a8(
            act_q, act_scale, w2_q, w2_s, offsets, outs["triton"][1]
        ),
        ("down", "fp8"): lambda _: grouped_gemm_fp8(
            act_q, act_scale, w2_8, w2_8s, offsets, outs["fp8"][1]
        ),
    }  # fmt: skip
    for run in runs.values():
        run(0)
    for index, gemm in enumerate(("gate_up", "down")):
        hopper, triton = outs["hopper"][index], outs["triton"][index]
        error = float((hopper.float() - triton.float()).abs().max())
        largest = float(triton.float().abs().max())
        print(f"{tokens} tokens, {gemm}: hopper vs triton max |diff| {error:.3g}")
        if error > 2e-2 * largest:
            raise AssertionError(f"{gemm}: hopper kernel off by {error} of {largest}")
    times = time_graphs_us(
        {f"{g}/{k}": run for (g, k), run in runs.items()},
        iters=20 if tokens < 1024 else 5,
    )
    results = []
    shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    for gemm, kernel in runs:
        n, k = shapes[gemm]
        us = times[f"{gemm}/{kernel}"]
        tflops = 2 * rows * n * k / (us * 1e-6) / 1e12
        weight_bytes = routed * n * (k if kernel == "fp8" else k // 2)
        results.append(
            Row(
                gemm,
                tokens,
                kernel,
                us,
                tflops,
                tflops / H200_PEAK_TFLOPS[FP8_DTYPE],
                weight_bytes / (us * 1e-6) / 1e12,
                us / times[f"{gemm}/fp8"],
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 1024, 8192])
    add_moe_dims_args(parser)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_grouped_gemm_w4a8 needs a CUDA device")
        return
    torch.manual_seed(0)
    rows = [row for tokens in args.tokens for row in bench(tokens, args)]
    name = torch.cuda.get_device_name()
    print(
        f"\ndevice: {name}; experts {args.num_experts}, top-{args.topk}, hidden "
        f"{args.hidden_size}, intermediate {args.intermediate_size}; fp8 peak "
        f"{H200_PEAK_TFLOPS[FP8_DTYPE]:.0f} TFLOP/s"
    )
    head = (
        f"{'gemm':>7} {'tokens':>6} {'kernel':>7} | {'us':>8} {'TFLOP/s':>8} "
        f"{'of peak':>7} {'weight TB/s':>11} {'x fp8':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.gemm:>7} {r.tokens:>6} {r.kernel:>7} | {r.us:>8.1f} "
            f"{r.tflops:>8.1f} {100 * r.peak_fraction:>6.0f}% "
            f"{r.weight_tbps:>11.2f} {r.x_fp8:>6.2f}"
        )
    write_results(args.output_json, name, rows)


if __name__ == "__main__":
    main()
