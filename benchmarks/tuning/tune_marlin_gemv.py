"""Sweep the W4A16 decode kernels' configs (:mod:`vllm.model_executor.kernels.
marlin.gemv` on the CUDA cores, :mod:`~.marlin.gemv_mma` on the tensor cores)
against the tensor-core GEMM and a bf16 matmul.

CUDA-graph replay, all candidates of a point timed in turn in each repeat;
each call reads its own copy of the weights (copies rotate so that more than
twice the L2 is streamed), as a decode step reads weights L2 has not kept.
Every config is checked against the dequantized reference first.

    PYTHONPATH=. python benchmarks/tuning/tune_marlin_gemv.py --ms 1 2 3 4 8
"""

import argparse
import functools
import itertools
import json
import os

import torch

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us
from vllm.model_executor.kernels.marlin import (
    dequantize_weights,
    marlin_gemm,
    marlin_workspace_numel,
    quantize_weights,
    repack_weights,
)
from vllm.model_executor.kernels.marlin.config import MarlinConfig, default_config
from vllm.model_executor.kernels.marlin.gemv import GEMV_MAX_M, GemvConfig
from vllm.model_executor.kernels.marlin.gemv_mma import MMA_GEMV_MAX_M, MmaGemvConfig

L2_BYTES = 50 * 2**20
GROUP = 128


def copies_for(nbytes: int) -> int:
    return max(1, -(-2 * L2_BYTES // nbytes))


def _call(a, packs, locks, out, cfg, n, k, i: int) -> None:
    p, s = packs[i % len(packs)]
    marlin_gemm(
        a, p, s, locks, group_size=GROUP, size_n=n, size_k=k, out=out, config=cfg
    )


def _matmul(a, weights, out, i: int) -> None:
    torch.matmul(a, weights[i % len(weights)].t(), out=out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["4096x4096", "8192x8192", "28672x4096", "4096x14336"],
    )
    parser.add_argument("--block-n", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--block-k", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--mma",
        nargs="+",
        default=["1x1x1", "1x1x2", "1x1x4", "1x1x8", "2x1x2", "2x1x4", "2x1x8",
                 "2x2x2", "2x2x4", "2x2x8", "4x2x2", "4x2x4", "4x4x1", "4x4x2",
                 "4x4x4"],
        help="MmaGemvConfig row_tiles x tiles_per_warp x k_split",
    )  # fmt: skip
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps(dev)
    print(f"{torch.cuda.get_device_name()}; copy {copy_gbps:.0f} GB/s")
    locks = torch.zeros(marlin_workspace_numel(dev), dtype=torch.int32, device=dev)
    record = []
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        q, scales = quantize_weights(torch.randn(n, k, device=dev), GROUP)
        scales = scales.to(torch.bfloat16)
        packed = repack_weights(q)
        w_deq = dequantize_weights(packed, scales, GROUP)
        w4_bytes = packed.nbytes + scales.nbytes
        packs = [(packed.clone(), scales.clone()) for _ in range(copies_for(w4_bytes))]
        bf16s = [w_deq.clone() for _ in range(copies_for(w_deq.nbytes))]
        for m in args.ms:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = a.float() @ w_deq.float().t()
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            cfgs: dict[str, MarlinConfig | GemvConfig | MmaGemvConfig] = {
                f"gemv n{bn} k{bk} w{nw}": GemvConfig(bn, bk, nw)
                for bn, bk, nw in itertools.product(
                    args.block_n, args.block_k, args.warps
                )
                if bk // 8 >= 32 * nw and bk <= k and m <= GEMV_MAX_M
            }
            if m <= MMA_GEMV_MAX_M:
                for spec in args.mma:
                    rt, tpw, ks = (int(v) for v in spec.split("x"))
                    cfgs[f"mma r{rt} t{tpw} k{ks}"] = MmaGemvConfig(rt, tpw, ks)
            cfgs["tensor-core"] = default_config(m, n, k, dev)
            steps = {}
            for name, cfg in cfgs.items():
                out.fill_(float("nan"))
                marlin_gemm(
                    a, packed, scales, locks, group_size=GROUP, size_n=n,
                    size_k=k, out=out, config=cfg,
                )  # fmt: skip
                err = float((out.float() - ref).norm() / ref.norm())
                if not err < 1e-2 or int(locks.abs().sum()):
                    print(f"  CHECK {shape} M={m} {name}: err {err:.2e}")
                    continue

                steps[name] = functools.partial(_call, a, packs, locks, out, cfg, n, k)
            steps["bf16 matmul"] = functools.partial(_matmul, a, bf16s, out)
            times = time_graphs_us(steps, iters=24, repeats=5)
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            print(f"\n{shape} M={m} (weights {w4_bytes / 1e6:.1f} MB)")
            best: dict[
                str, tuple[str, float]
            ] = {}  # the fastest of each kernel, and the overall top 6
            for name, us in ranked:
                best.setdefault(name.split()[0], (name, us))
            shown = ranked[:6] + [kv for kv in best.values() if kv not in ranked[:6]]
            for name, us in shown:
                frac = w4_bytes / (us * 1e-6) / 1e9 / copy_gbps
                print(f"  {name:<22} {us:7.1f} us  {100 * frac:4.0f}% of copy")
            record.append({"shape": shape, "m": m, "times_us": times})
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "marlin_gemv_tune.json")
        with open(path, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "points": record}, f, indent=1)


if __name__ == "__main__":
    main()
