"""Dense layers at decode sizes: ``skinny_gemm`` against ``torch.matmul``.

Qwen3-30B-A3B's dense shapes (router, q/k/v, output projection, head) at 1
and 2 rows, bf16, timed under CUDA-graph replay in turn; each call reads
another copy of the weight (the copies exceed the L2 cache), as a decode
step reads each layer's weight once. Prints the times, the weight bytes
per second as a fraction of the copy bandwidth measured in the same run,
and which one the model's layer picks (``skinny_gemm_applies``). Each is
timed once more after a residual add + RMSNorm, as in a decoder layer:
``skinny_gemm`` launches with programmatic dependent launch and streams
its first weight tile while the norm runs, cuBLAS starts after it; and
with the add and the norm in ``skinny_gemm``'s prologue
(``rms_norm_skinny_gemm``, one launch).

    python -m benchmarks.kernels.benchmark_skinny_gemm
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us, write_results
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.rms_norm import rms_norm
from vllm.model_executor.kernels.common.skinny_gemm import (
    rms_norm_skinny_gemm,
    skinny_gemm,
    skinny_gemm_applies,
)

SHAPES = {  # name: (N, K)
    "router": (128, 2048),
    "qkv_proj": (5120, 2048),
    "o_proj": (2048, 4096),
    "lm_head": (151936, 2048),
}
ITERS = 20
L2_BYTES = 60 * 2**20


@dataclass
class Row:
    layer: str
    n: int
    k: int
    rows: int
    skinny_us: float
    cublas_us: float
    skinny_of_copy: float
    cublas_of_copy: float
    norm_skinny_us: float  # residual add + RMSNorm, then the GEMM
    norm_cublas_us: float
    fused_us: float  # the add and the norm in the GEMM's prologue
    picked: str


def bench(layer: str, rows: int, copy_gbps: float) -> Row:
    n, k = SHAPES[layer]
    device = torch.device("cuda")
    weight_bytes = n * k * 2
    copies = max(2, -(-2 * L2_BYTES // weight_bytes))
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)
    ]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
    ref = (x.float() @ weights[0].float().T).bfloat16()
    torch.testing.assert_close(skinny_gemm(x, weights[0]), ref, atol=0.5, rtol=2e-2)
    times = time_graphs_us(
        {
            "skinny": lambda i: skinny_gemm(x, weights[i % copies]),
            "cublas": lambda i: torch.matmul(x, weights[i % copies].T),
            "norm_skinny": lambda i: skinny_gemm(
                rms_norm(x, norm_weight, 1e-6, residual)[0], weights[i % copies]
            ),
            "norm_cublas": lambda i: torch.matmul(
                rms_norm(x, norm_weight, 1e-6, residual)[0], weights[i % copies].T
            ),
            "fused": lambda i: rms_norm_skinny_gemm(
                x, residual, norm_weight, 1e-6, weights[i % copies]
            ),
        },
        ITERS,
    )

    def of_copy(us: float) -> float:
        return weight_bytes / (us * 1e-6) / (copy_gbps * 1e9)

    applies = skinny_gemm_applies(rows, n, k, x.dtype, pdl(x.device))
    picked = "skinny" if applies else "cublas"
    return Row(
        layer, n, k, rows, times["skinny"], times["cublas"],
        of_copy(times["skinny"]), of_copy(times["cublas"]), times["norm_skinny"],
        times["norm_cublas"], times["fused"], picked,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--layers", nargs="+", choices=sorted(SHAPES), default=list(SHAPES)
    )
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    name = torch.cuda.get_device_name()
    print(f"device: {name} | copy bandwidth {copy_gbps:.0f} GB/s | bf16")
    print(
        f"{'layer':<9} {'N x K':>13} {'M':>3} {'skinny us':>9} {'of copy':>7} "
        f"{'cuBLAS us':>9} {'of copy':>7} {'cuBLAS/skinny':>13} "
        f"{'norm+skinny':>11} {'norm+cuBLAS':>11} {'fused':>7}  picked"
    )
    rows = []
    for layer in args.layers:
        for m in args.rows:
            r = bench(layer, m, copy_gbps)
            rows.append(r)
            print(
                f"{layer:<9} {f'{r.n}x{r.k}':>13} {m:>3} {r.skinny_us:9.2f} "
                f"{r.skinny_of_copy:7.0%} {r.cublas_us:9.2f} {r.cublas_of_copy:7.0%} "
                f"{r.cublas_us / r.skinny_us:12.2f}x {r.norm_skinny_us:11.2f} "
                f"{r.norm_cublas_us:11.2f} {r.fused_us:7.2f}  {r.picked}",
                flush=True,
            )
    write_results(args.output_json, name, rows)


if __name__ == "__main__":
    main()
