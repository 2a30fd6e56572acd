"""Is an fp8 matrix-vector product on the CUDA cores bound by HBM or by the
fp8 -> fp32 conversion? One Triton GEMV streams the same weight bytes four
ways: bf16 (half the columns: the bandwidth reference), fp8 e4m3 converted
by Triton's ``.to(tl.float32)``, the same bytes turned into fp32 by integer
ops (the e4m3 bits shifted into an fp32's exponent and mantissa, the 2^120
exponent bias applied once per row), and the bytes summed as integers (the
load alone). Each call reads another copy of the weights (out of L2);
CUDA-graph replay; GB/s of weight bytes and the fraction of the copy
bandwidth. Sizes: the one-token MoE GEMM1 of Qwen3-30B-A3B (8 experts x
1536 x 2048, 25 MB in fp8) and 4x that.

    PYTHONPATH=. python benchmarks/tuning/probe_fp8_gemv.py
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graphs_us

ITERS = 8
MODES = {"bf16": 0, "fp8 .to(f32)": 1, "fp8 bits": 2, "bytes only": 3}


@triton.jit
def _gemv_kernel(
    w_ptr,  # [N, K] (bf16: [N, K / 2]; "fp8 bits", "bytes only": uint8)
    x_ptr,  # [K] bf16
    out_ptr,  # [N] fp32
    K,
    MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :])
        x = tl.load(x_ptr + cols).to(tl.float32)[None, :]
        if MODE == 3:
            acc += w.to(tl.int32).to(tl.float32, bitcast=True)
        elif MODE == 2:
            b = w.to(tl.uint32)
            bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
            acc += bits.to(tl.float32, bitcast=True) * x
        else:
            acc += w.to(tl.float32) * x
    out = tl.sum(acc, 1)
    if MODE == 2:
        out *= 1.329227995784916e36  # 2^120: e4m3's exponent bias against fp32's
    tl.store(out_ptr + rows, out)


def gemv(w: torch.Tensor, x: torch.Tensor, mode: int, block_n: int) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(n, dtype=torch.float32, device=w.device)
    _gemv_kernel[(n // block_n,)](w, x, out, k, MODE=mode, BLOCK_N=block_n,
                                  BLOCK_K=256, num_warps=4)  # fmt: skip
    return out


def step(
    weights: list[torch.Tensor], x: torch.Tensor, mode: int, block_n: int, it: int
) -> torch.Tensor:
    return gemv(weights[it % len(weights)], x, mode, block_n)


def main() -> None:
    device = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps(device)
    print(f"device: {torch.cuda.get_device_name()} | copy {copy_gbps:.0f} GB/s")
    print(f"{'rows x K':>12} {'mode':>13} {'BLOCK_N':>7} {'us':>8} {'GB/s':>7} "
          f"{'of copy':>7}")  # fmt: skip
    for n, k in ((12288, 2048), (49152, 2048)):
        nbytes = n * k
        copies = max(2, -(-200 * 2**20 // nbytes))
        fp8 = [
            (torch.randn(n, k, device=device) / 4).to(torch.float8_e4m3fn)
            for _ in range(copies)
        ]
        x = torch.randn(k, device=device, dtype=torch.bfloat16)
        weights = {
            0: [torch.randn(n, k // 2, device=device).bfloat16() for _ in fp8],
            1: fp8,
            2: [w.view(torch.uint8) for w in fp8],
            3: [w.view(torch.uint8) for w in fp8],
        }
        # the integer path computes what the native conversion does, up to
        # e4m3 subnormals (fp32 denormals here) if the GPU flushes them
        ref = gemv(fp8[0], x, 1, 8)
        diff = (gemv(weights[2][0], x, 2, 8) - ref).abs().max().item()
        print(f"fp8 bits against .to(f32), {n}x{k}: max abs diff {diff:.3g}")
        x_half = x[: k // 2].contiguous()
        for block_n in (8, 16):
            steps = {
                name: partial(
                    step, weights[mode], x_half if mode == 0 else x, mode, block_n
                )
                for name, mode in MODES.items()
            }
            for name, us in time_graphs_us(steps, ITERS).items():
                gbps = nbytes / (us * 1e-6) / 1e9
                print(f"{f'{n}x{k}':>12} {name:>13} {block_n:>7} {us:>8.1f} "
                      f"{gbps:>7.0f} {gbps / copy_gbps:>7.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
