"""FP8 grouped GEMM: the Triton kernel against ``torch._scaled_grouped_mm``.

On the two expert GEMMs of a MoE layer (default: qwen3-30b-a3b, 128 experts,
top-8, hidden 2048, intermediate 768) with uniform random routing, both timed
under CUDA-graph replay on the same fp8 inputs; TFLOP/s and the fraction of
the H200's dense fp8 peak. ``--sweep`` also times each Triton tile config.

    python -m benchmarks.kernels.benchmark_grouped_gemm_fp8 --tokens 1024 8192
"""

from __future__ import annotations

import argparse
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.kernels.bench_utils import (
    H200_PEAK_TFLOPS,
    time_graph_us,
    write_results,
)
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    FP8_DTYPE,
    GroupedGemmConfig,
    default_config,
    grouped_gemm_fp8,
)

SWEEP = [
    GroupedGemmConfig(*c)
    for c in [
        (128, 128, 128, 8, 4),
        (128, 256, 128, 8, 3),
        (128, 128, 64, 4, 5),
        (64, 128, 128, 4, 4),
        (128, 64, 128, 4, 4),
        (256, 128, 128, 8, 3),
    ]
]


@dataclass
class Row:
    gemm: str
    tokens: int
    config: str
    torch_us: float
    triton_us: float
    triton_tflops: float
    peak_fraction: float
    speedup: float


def bench(
    gemm: str, tokens: int, n: int, k: int, args: argparse.Namespace
) -> list[Row]:
    rows = tokens * args.topk
    ids = torch.randint(0, args.num_experts, (rows,), device="cuda")
    counts = torch.bincount(ids, minlength=args.num_experts)
    offsets = torch.zeros(args.num_experts + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = counts.cumsum(0)
    ends = offsets[1:].to(torch.int32)
    a = torch.randn(rows, k, device="cuda").to(FP8_DTYPE)
    a_scale = torch.rand(rows, device="cuda")
    w = torch.randn(args.num_experts, n, k, device="cuda").to(FP8_DTYPE)
    w_scale = torch.rand(args.num_experts, n, device="cuda")
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    iters = 20 if tokens < 1024 else 5

    def torch_step(_: int) -> None:
        torch._scaled_grouped_mm(
            a, w.transpose(1, 2), a_scale, w_scale, offs=ends, out_dtype=torch.bfloat16
        )

    torch_us = time_graph_us(torch_step, iters)
    flops = 2 * rows * n * k
    results = []
    configs = SWEEP if args.sweep else [default_config(rows, args.num_experts)]
    for config in configs:

        def triton_step(_: int, config: GroupedGemmConfig = config) -> None:
            grouped_gemm_fp8(a, a_scale, w, w_scale, offsets, out, config)

        triton_us = time_graph_us(triton_step, iters)
        tflops = flops / (triton_us * 1e-6) / 1e12
        results.append(
            Row(
                gemm,
                tokens,
                "x".join(map(str, astuple(config))),
                torch_us,
                triton_us,
                tflops,
                tflops / H200_PEAK_TFLOPS[FP8_DTYPE],
                torch_us / triton_us,
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time every tile config (default: the launcher's choice)",
    )
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_grouped_gemm_fp8 needs a CUDA device")
        return
    torch.manual_seed(0)
    hidden, inter = args.hidden_size, args.intermediate_size
    gemms = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    rows: list[Row] = []
    for tokens in tqdm(args.tokens, desc="tokens"):
        for gemm, (n, k) in gemms.items():
            rows.extend(bench(gemm, tokens, n, k, args))

    name = torch.cuda.get_device_name()
    print(
        f"\ndevice: {name}; experts {args.num_experts}, top-{args.topk}, "
        f"hidden {hidden}, intermediate {inter}; fp8 peak "
        f"{H200_PEAK_TFLOPS[FP8_DTYPE]:.0f} TFLOP/s"
    )
    head = (
        f"{'gemm':>7} {'tokens':>6} {'config':>17} | {'torch us':>9} | "
        f"{'triton us':>9} {'TFLOP/s':>8} {'of peak':>7} {'x torch':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.gemm:>7} {r.tokens:>6} {r.config:>17} | {r.torch_us:>9.1f} | "
            f"{r.triton_us:>9.1f} {r.triton_tflops:>8.1f} "
            f"{100 * r.peak_fraction:>6.0f}% {r.speedup:>7.2f}"
        )
    write_results(args.output_json, name, rows)


if __name__ == "__main__":
    main()
