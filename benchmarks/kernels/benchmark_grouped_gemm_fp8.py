"""FP8 grouped GEMMs: our kernels against ``torch._scaled_grouped_mm``.

On the two expert GEMMs of a MoE layer (default: qwen3-30b-a3b, 128 experts,
top-8, hidden 2048, intermediate 768) with uniform random routing, as the
triton_fp8 layer runs them: GEMM1 gathers its rows and applies the gated
activation in the epilogue. ``_scaled_grouped_mm`` runs the same products on
permuted rows (GEMM1 without the activation). Timed under CUDA-graph
replay; TFLOP/s (of the products) and the fraction of the H200's dense fp8
peak. The launcher's choice (the warp-specialized Gluon kernels for 128-row
tiles on Hopper, also with the activation quantized in groups of 128
columns: GEMM1's fp8 output, GEMM2's group scales, "gluon-wspec groups") runs
beside the Triton kernel with the same tiles;
``--sweep`` also times each Triton tile config.

    python -m benchmarks.kernels.benchmark_grouped_gemm_fp8 --tokens 1024 8192
"""

from __future__ import annotations

import argparse
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.benchmarks.utils import (
    H200_PEAK_TFLOPS,
    add_moe_dims_args,
    time_graph_us,
    write_results,
)
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    GroupedGemmConfig,
    act_groups,
    default_config,
    default_gated_config,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    takes_gluon,
    takes_gluon_gated,
)

SWEEP = {
    "gate_up": [
        GroupedGemmConfig(*c)
        for c in [
            (64, 32, 128, 4, 4),
            (64, 64, 128, 4, 4),
            (64, 128, 128, 4, 4),
            (128, 64, 128, 4, 4),
            (128, 128, 128, 8, 3),
            (128, 128, 128, 8, 4),
            (128, 128, 256, 8, 2),
        ]
    ],
    "down": [
        GroupedGemmConfig(*c)
        for c in [
            (64, 64, 128, 4, 4),
            (64, 128, 128, 4, 4),
            (64, 256, 128, 4, 4),
            (128, 128, 128, 4, 4),
            (128, 256, 128, 8, 3),
            (128, 256, 128, 8, 4),
            (128, 256, 256, 8, 2),
            (256, 128, 128, 8, 3),
        ]
    ],
}


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


def bench(tokens: int, args: argparse.Namespace) -> list[Row]:
    """Both expert GEMMs of one routing, as the triton_fp8 layer runs them,
    against ``_scaled_grouped_mm`` on the same operands (GEMM1 on permuted
    rows, without the activation)."""
    experts, topk = args.num_experts, args.topk
    hidden, inter = args.hidden_size, args.intermediate_size
    rows = tokens * topk
    ids = torch.randint(0, experts, (rows,), device="cuda")
    src_routes = torch.sort(ids, stable=True).indices.to(torch.int32)
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.bincount(ids, minlength=experts).cumsum(0)
    ends = offsets[1:].to(torch.int32)
    a = torch.randn(tokens, hidden, device="cuda").to(FP8_DTYPE)
    a_scale = torch.rand(tokens, device="cuda")
    a_perm = a[src_routes.long() // topk]
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda").to(FP8_DTYPE)
    w13_scale = torch.rand(experts, 2 * inter, device="cuda")
    act = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
    act_q = torch.randn(rows, inter, device="cuda").to(FP8_DTYPE)
    act_scale = torch.rand(rows, device="cuda")
    act_group_scale = torch.rand(rows, act_groups(inter), device="cuda")
    w2 = torch.randn(experts, hidden, inter, device="cuda").to(FP8_DTYPE)
    w2_scale = torch.rand(experts, hidden, device="cuda")
    down = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    iters = 20 if tokens < 1024 else 5

    def gate_up(config: GroupedGemmConfig | None, quantized: bool = False) -> None:
        out, out_scale = (act_q, act_group_scale) if quantized else (act, None)
        grouped_gemm_fp8_gated(
            a,
            a_scale,
            src_routes,
            topk,
            w13,
            w13_scale,
            offsets,
            "silu",
            out,
            config,
            out_scale,
        )

    def down_proj(config: GroupedGemmConfig | None, quantized: bool = False) -> None:
        scale = act_group_scale if quantized else act_scale
        grouped_gemm_fp8(act_q, scale, w2, w2_scale, offsets, down, config)

    gemms = {
        "gate_up": (
            gate_up,
            default_gated_config(rows, experts),
            takes_gluon_gated(a, w13, act) and takes_gluon_gated(a, w13, act_q),
            (a_perm, w13, a_scale[src_routes.long() // topk], w13_scale),
        ),
        "down": (
            down_proj,
            default_config(rows, experts),
            takes_gluon(act_q, w2, down),
            (act_q, w2, act_scale, w2_scale),
        ),
    }
    results = []
    for gemm, (run, default, gluon, (x, w, x_s, w_s)) in gemms.items():

        def torch_step(_: int, x=x, w=w, x_s=x_s, w_s=w_s) -> None:
            torch._scaled_grouped_mm(
                x, w.transpose(1, 2), x_s, w_s, offs=ends, out_dtype=torch.bfloat16
            )

        torch_us = time_graph_us(torch_step, iters)
        flops = 2 * rows * w.shape[1] * w.shape[2]
        # None: the launcher's choice, where it is the Gluon kernel, also with
        # the activation quantized in groups (fp8 out / group scales in).
        configs: list[tuple[GroupedGemmConfig | None, bool]] = (
            [(None, False), (None, True)] if gluon else []
        )
        configs += [(c, False) for c in (SWEEP[gemm] if args.sweep else [default])]
        for config, quantized in configs:

            def triton_step(_: int, run=run, config=config, q=quantized) -> None:
                run(config, q)

            triton_us = time_graph_us(triton_step, iters)
            tflops = flops / (triton_us * 1e-6) / 1e12
            label = (
                "x".join(map(str, astuple(config)))
                if config
                else ("gluon-wspec groups" if quantized else "gluon-wspec")
            )
            results.append(
                Row(
                    gemm,
                    tokens,
                    label,
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
    add_moe_dims_args(parser)
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
    rows: list[Row] = []
    for tokens in tqdm(args.tokens, desc="tokens"):
        rows.extend(bench(tokens, args))

    name = torch.cuda.get_device_name()
    print(
        f"\ndevice: {name}; experts {args.num_experts}, top-{args.topk}, "
        f"hidden {hidden}, intermediate {inter}; fp8 peak "
        f"{H200_PEAK_TFLOPS[FP8_DTYPE]:.0f} TFLOP/s"
    )
    head = (
        f"{'gemm':>7} {'tokens':>6} {'config':>17} | {'torch us':>9} | "
        f"{'ours us':>9} {'TFLOP/s':>8} {'of peak':>7} {'x torch':>7}"
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
