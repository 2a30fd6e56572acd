"""Dense layers at decode sizes: ``skinny_gemm`` against ``torch.matmul``.

Qwen3-30B-A3B's dense shapes (q/k/v, output projection, router, head) at 1
to 16 rows, bf16, timed under CUDA-graph replay in turn; each call reads
another copy of the weight (the copies exceed the L2 cache), as a decode
step reads each layer's weight once. Prints the time, the weight bytes per
second and their fraction of the copy bandwidth measured in the same run,
for the default config, the best of a small config sweep, and cuBLAS.

    python -m benchmarks.kernels.benchmark_skinny_gemm --rows 1 4 16
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us, write_results
from vllm.model_executor.kernels.common.device_info import num_sms
from vllm.model_executor.kernels.common.skinny_gemm import (
    SkinnyConfig,
    default_skinny_config,
    skinny_gemm,
)

SHAPES = {  # name: (N, K)
    "qkv_proj": (5120, 2048),
    "o_proj": (2048, 4096),
    "router": (128, 2048),
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
    default_us: float
    best_us: float
    best_config: str
    cublas_us: float
    default_tbps: float
    default_of_copy: float
    cublas_tbps: float


def sweep_configs(n: int, k: int, sms: int) -> list[SkinnyConfig]:
    configs = {default_skinny_config(n, k, sms)}
    for block_n, block_k, split, stages in itertools.product(
        (16, 32), (128, 256, 512), (1, 2, 4, 8), (4,)
    ):
        if k // split >= block_k:
            configs.add(SkinnyConfig(block_n, block_k, split, 4, stages))
    return sorted(configs, key=str)


def bench(name: str, n: int, k: int, rows: int, sweep: bool, copy_gbps: float) -> Row:
    device = torch.device("cuda")
    weight_bytes = n * k * 2
    copies = max(2, -(-2 * L2_BYTES // weight_bytes))
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)
    ]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    ref = (x.float() @ weights[0].float().T).bfloat16()
    torch.testing.assert_close(skinny_gemm(x, weights[0]), ref, atol=0.5, rtol=2e-2)
    default = default_skinny_config(n, k, num_sms(device))
    configs = sweep_configs(n, k, num_sms(device)) if sweep else [default]

    def step(config: SkinnyConfig | None) -> Callable[[int], torch.Tensor]:
        if config is None:
            return lambda i: torch.matmul(x, weights[i % copies].T)
        return lambda i: skinny_gemm(x, weights[i % copies], config)

    steps = {str(c): step(c) for c in configs} | {"cublas": step(None)}
    times = time_graphs_us(steps, ITERS)
    cublas = times.pop("cublas")
    best = min(times, key=times.__getitem__)
    tbps = weight_bytes / (times[str(default)] * 1e-6) / 1e12
    return Row(
        name, n, k, rows, times[str(default)], times[best], best, cublas,
        tbps, tbps * 1e3 / copy_gbps, weight_bytes / (cublas * 1e-6) / 1e12,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--layers", nargs="+", choices=sorted(SHAPES), default=SHAPES)
    parser.add_argument("--sweep", action="store_true", help="time a config grid too")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps(device)
    name = torch.cuda.get_device_name()
    print(f"device: {name} | copy bandwidth {copy_gbps:.0f} GB/s | bf16")
    print(
        f"{'layer':<9} {'N x K':>13} {'M':>3} {'ours us':>8} {'TB/s':>5} "
        f"{'of copy':>7} {'cuBLAS us':>9} {'TB/s':>5} {'cuBLAS/ours':>11} "
        f"{'best us':>8}  best config"
    )
    rows = []
    for layer in args.layers:
        n, k = SHAPES[layer]
        for m in args.rows:
            r = bench(layer, n, k, m, args.sweep, copy_gbps)
            rows.append(r)
            print(
                f"{layer:<9} {f'{n}x{k}':>13} {m:>3} {r.default_us:8.2f} "
                f"{r.default_tbps:5.2f} {r.default_of_copy:7.0%} {r.cublas_us:9.2f} "
                f"{r.cublas_tbps:5.2f} {r.cublas_us / r.default_us:10.2f}x "
                f"{r.best_us:8.2f}  {r.best_config}",
                flush=True,
            )
    write_results(args.output_json, name, rows)


if __name__ == "__main__":
    main()
