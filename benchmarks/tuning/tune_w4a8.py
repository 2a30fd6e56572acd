"""Sweep the W4A8 grouped GEMMs' tiles at Qwen3-30B-A3B's expert shapes.

For 16, 64 and 8192 tokens (top-8 of 128 experts, hidden 2048, intermediate
768): the gated GEMM (gate/up with the activation) and the plain one (down)
per tile configuration, checked against the references on the first
configuration, timed under CUDA-graph replay, with the shipped defaults
marked and the fp8 kernels' defaults on the same routing as the bar.

    PYTHONPATH=. python benchmarks/tuning/tune_w4a8.py
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from vllm.benchmarks.utils import time_graphs_us
from vllm.model_executor.kernels.common.fp8 import FP8_DTYPE
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
)
from vllm.model_executor.kernels.grouped_gemm.dispatch import GroupedGemmConfig
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    W4A8_GATED_TILES,
    W4A8_TILES,
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
    quantize_w4,
)

EXPERTS, TOPK, HIDDEN, INTER = 128, 8, 2048, 768
ITERS = 10
CONFIGS = {  # (block_m, block_n, block_k = the group, warps, stages)
    "gated": [
        (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 128, 8, 3),
        (64, 128, 128, 8, 3), (128, 64, 128, 8, 3), (128, 128, 128, 8, 3),
        (64, 32, 128, 8, 4), (128, 32, 128, 4, 4),
    ],
    "down": [
        (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3),
        (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3),
        (128, 64, 128, 4, 4), (64, 128, 128, 4, 4),
    ],
}  # fmt: skip


def sweep(tokens: int) -> None:
    rows = tokens * TOPK
    ids = torch.randint(0, EXPERTS, (rows,), device="cuda")
    src_routes = torch.sort(ids, stable=True).indices.to(torch.int32)
    offsets = torch.zeros(EXPERTS + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.bincount(ids, minlength=EXPERTS).cumsum(0)
    a = torch.randn(tokens, HIDDEN, device="cuda").to(FP8_DTYPE)
    a_scale = torch.rand(tokens, device="cuda")
    act_q = torch.randn(rows, INTER, device="cuda").to(FP8_DTYPE)
    act_scale = torch.rand(rows, device="cuda")
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / INTER**0.5
    (w13_q, w13_s), (w2_q, w2_s) = quantize_w4(w13), quantize_w4(w2)
    w13_8, w2_8 = w13.to(FP8_DTYPE), w2.to(FP8_DTYPE)
    w13_8s = torch.rand(EXPERTS, 2 * INTER, device="cuda")
    w2_8s = torch.rand(EXPERTS, HIDDEN, device="cuda")
    act = torch.empty(rows, INTER, device="cuda", dtype=torch.bfloat16)
    down = torch.empty(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def gated(config: GroupedGemmConfig | None) -> None:
        grouped_gemm_w4a8_gated(
            a, a_scale, src_routes, TOPK, w13_q, w13_s, offsets, "silu", act, config
        )

    def plain(config: GroupedGemmConfig | None) -> None:
        grouped_gemm_w4a8(act_q, act_scale, w2_q, w2_s, offsets, down, config)

    shipped = {"gated": W4A8_GATED_TILES, "down": W4A8_TILES}
    runs: dict[str, Callable[[GroupedGemmConfig | None], None]] = {
        "gated": gated,
        "down": plain,
    }
    for gemm, run in runs.items():
        steps: dict[str, Callable[[int], object]] = {}
        for c in CONFIGS[gemm]:
            try:  # a tile that does not compile (shared memory) is skipped
                run(GroupedGemmConfig(*c))
            except Exception as e:
                print(f"    {c}: {type(e).__name__}: {str(e)[:80]}")
                continue
            config = GroupedGemmConfig(*c)
            steps[str(c)] = partial(lambda _, c, r: r(c), c=config, r=run)
        steps["shipped"] = partial(lambda _, r: r(None), r=run)
        if gemm == "gated":
            steps["fp8 kernel"] = lambda _: grouped_gemm_fp8_gated(
                a, a_scale, src_routes, TOPK, w13_8, w13_8s, offsets, "silu", act
            )
        else:
            steps["fp8 kernel"] = lambda _: grouped_gemm_fp8(
                act_q, act_scale, w2_8, w2_8s, offsets, down
            )
        times = time_graphs_us(steps, ITERS, repeats=3)
        ranked = sorted((t, name) for name, t in times.items())
        print(f"{gemm} at {tokens} tokens ({rows} rows), shipped {shipped[gemm]}:")
        for us, name in ranked:
            print(f"    {name:<22} {us:9.1f} us", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    for tokens in (16, 64, 8192):
        sweep(tokens)


if __name__ == "__main__":
    main()
