"""Check and time the Triton Marlin W4A16 GEMM against bf16 torch.matmul.

Run on a CUDA device from the repository root::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/tuning/tune_marlin.py

``--tune`` also times a few candidate configs per point and reports the best
next to the launcher's default. Weight bandwidth counts the int4 weights plus
scales once; the copy ceiling is measured in the same run (outside graphs).
"""

import argparse
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from vllm.model_executor.kernels.marlin import (
    TILE_K,
    MarlinConfig,
    dequantize_weights,
    marlin_gemm,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
)
from vllm.model_executor.kernels.marlin.config import (
    default_config,
    resident_programs,
)

COPY_CEILING_TBS = 4.27


def _bench(fn: Callable[[], object]) -> float:
    """Median microseconds (do_bench flushes L2 between calls)."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _copy_tbs(dev: torch.device) -> float:
    src = torch.empty(1 << 29, dtype=torch.int32, device=dev)  # 2 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _bench(functools.partial(dst.copy_, src)) / 1e6


def _time_config(
    a: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    w_deq: torch.Tensor,
    locks: torch.Tensor,
    group_size: int,
    cfg: MarlinConfig | None,
) -> float:
    """Check one config against the reference, then time it."""
    (m, k), n = a.shape, packed.shape[0]
    out = torch.full((m, n), float("nan"), device=a.device, dtype=a.dtype)
    call = functools.partial(
        marlin_gemm,
        a,
        packed,
        scales,
        locks,
        group_size=group_size,
        size_n=n,
        size_k=k,
        out=out,
        config=cfg,
    )
    call()
    ref = a.float() @ w_deq.float().t()
    err = float((out.float() - ref).norm() / ref.norm())
    held = int(locks.abs().sum())  # counters left non-zero
    if err > 1e-2 or held != 0:
        print(f"  CHECK M={m} N={n} K={k} {cfg}: err {err:.2e}, locks {held}")
    if err > 5e-2 or held != 0:
        return float("inf")
    return _bench(call)


def _candidates(m: int, n: int, k: int, dev: torch.device) -> list[MarlinConfig]:
    """A few (block_m, block_n, warps, stages), each with a few splits."""
    if m <= 16:
        base = [(16, 64, 4, 6), (16, 128, 4, 4), (16, 32, 4, 4), (16, 64, 4, 4)]
        base += [(16, 256, 8, 3)]
    elif m <= 64:
        base = [(m, 64, 4, 4), (m, 128, 4, 3), (m, 32, 4, 4)]
    elif m <= 256:
        base = [(128, 128, 8, 3), (64, 64, 4, 4), (256, 128, 8, 3)]
    else:
        base = [(256, 128, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3)]
    out = []
    for bm, bn, nw, ns in base:
        cfg = MarlinConfig(bm, bn, 1, nw, ns)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = 1
        limit = resident_programs(cfg, dev)
        while tiles * split * 2 <= limit and (k // TILE_K) % (split * 2) == 0:
            split *= 2
        for s in sorted({split, max(1, split // 2), max(1, split // 4)}):
            out.append(MarlinConfig(bm, bn, s, nw, ns))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,1024,4096")
    parser.add_argument("--shapes", default="4096x4096,8192x8192,28672x4096")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    g = args.group_size
    t_start = time.time()

    copy_tbs = _copy_tbs(dev)
    print(f"copy: {copy_tbs:.2f} TB/s (read + write)")

    locks = torch.zeros(marlin_workspace_numel(dev), dtype=torch.int32, device=dev)
    rows = []
    record: list[dict[str, object]] = []
    for shape in args.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        q, scales = quantize_weights(torch.randn(n, k, device=dev), g)
        scales = scales.to(dtype)
        packed = repack_weights(q)
        w_deq = dequantize_weights(packed, scales, g)
        weight_bytes = packed.numel() * 4 + scales.numel() * 2
        for m in (int(x) for x in args.ms.split(",")):
            a = torch.randn(m, k, device=dev, dtype=dtype)
            bf16_us = _bench(functools.partial(torch.matmul, a, w_deq.t()))
            point = functools.partial(_time_config, a, packed, scales, w_deq, locks, g)
            default = default_config(m, n, k, dev)
            us = point(None)
            best_us, best = us, default
            if args.tune:
                for cfg in _candidates(m, n, k, dev):
                    if cfg != default:
                        t = point(cfg)
                        if t < best_us:
                            best_us, best = t, cfg
            rows.append((m, shape, us, best_us, bf16_us, weight_bytes, best))
            record.append(
                {
                    "m": m,
                    "shape": shape,
                    "us": us,
                    "best_us": best_us,
                    "bf16_us": bf16_us,
                    "best": dataclasses.asdict(best),
                }
            )
            print(
                f"M={m} {shape}: {us:.1f} us (best {best_us:.1f}) bf16 {bf16_us:.1f} "
                f"[{time.time() - t_start:.0f}s]"
            )

    print(f"\ncopy {copy_tbs:.2f} TB/s; weight TB/s as fraction of {COPY_CEILING_TBS}")
    print(
        "M | NxK | us | best us | bf16 us | x bf16 | best x | W TB/s | frac | best cfg"
    )
    for m, shape, us, best_us, bf16_us, wb, best in rows:
        tbs = wb / best_us / 1e6
        print(
            f"{m} | {shape} | {us:.1f} | {best_us:.1f} | {bf16_us:.1f} | "
            f"{bf16_us / us:.2f} | {bf16_us / best_us:.2f} | {tbs:.2f} | "
            f"{tbs / COPY_CEILING_TBS:.2f} | {best.block_m},{best.block_n},"
            f"s{best.split_k},w{best.num_warps},st{best.num_stages}"
        )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "marlin_tune.json"), "w") as f:
            json.dump({"copy_tbs": copy_tbs, "rows": record}, f, indent=1)


if __name__ == "__main__":
    main()
