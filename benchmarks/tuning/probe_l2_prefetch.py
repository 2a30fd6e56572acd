"""Can a decode step hide a dense layer's weight stream behind the
latency-bound kernels before it? At one token the attention kernels leave
HBM idle for ~10 us per layer while the output projection (16.8 MB) and
q/k/v (21 MB) each pay ~3 us of ramp and tail over their bytes. Here a
kernel launched with PDL during a latency-bound stand-in (a timed spin on
32 programs) asks for the next GEMM's weights in L2, and the GEMM then
reads them from there.

A: spin 10 us -> [prefetch] -> output projection (``skinny_gemm``).
B: spin 7 us -> [prefetch q/k/v] -> a 38 MB stream (one fp8 token's MoE
   weights; normal or evict-first loads) -> q/k/v: does the prefetched
   weight survive the MoE's stream?
C: spin 2 or 10 us -> ``skinny_gemm`` tiles (up to the whole K loaded
   before the wait) on both shapes, and cuBLAS on q/k/v (no PDL).
Each iteration uses other copies of the weights (nothing hot from the one
before); CUDA-graph replay; us per iteration.

    PYTHONPATH=. python benchmarks/tuning/probe_l2_prefetch.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.benchmarks.utils import time_graphs_us
from vllm.model_executor.kernels.common import skinny_gemm as sg
from vllm.model_executor.kernels.common.pdl import pdl_wait
from vllm.model_executor.kernels.common.skinny_gemm import skinny_gemm

ITERS = 32
LINE = tl.constexpr(128)


@triton.jit
def _globaltimer(dummy):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _spin_kernel(ns):
    pdl_wait(True)
    dummy = tl.zeros([1], tl.int32)
    start = tl.max(_globaltimer(dummy), 0)
    now = start
    while now - start < ns:
        now = tl.max(_globaltimer(dummy), 0)


@triton.jit
def _prefetch_kernel(ptr, MODE: tl.constexpr, CHUNK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * CHUNK
    if MODE == 0:  # one prefetch per 128-byte line, evict-last
        offs = base + tl.arange(0, CHUNK // LINE) * LINE
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
            [ptr + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif MODE == 1:  # the same, normal priority
        offs = base + tl.arange(0, CHUNK // LINE) * LINE
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
            [ptr + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:  # bulk prefetches of 2 KB (Hopper's TMA unit)
        offs = base + tl.arange(0, CHUNK // 2048) * 2048
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], 2048; mov.u32 $0, 0;", "=r,l",
            [ptr + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    pdl_wait(True)


@triton.jit
def _stream_kernel(ptr, out_ptr, EVICT_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait(True)
    offs = tl.program_id(0).to(tl.int64) * BLOCK * 4 + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(4):
        if EVICT_FIRST:
            acc += tl.load(ptr + offs + i * BLOCK, eviction_policy="evict_first")
        else:
            acc += tl.load(ptr + offs + i * BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


CHUNK = 65536


def spin(us: float) -> object:
    return _spin_kernel[(32,)](int(us * 1000), num_warps=4, launch_pdl=True)


def prefetch(w: torch.Tensor, mode: int) -> object:
    nbytes = w.numel() * w.element_size()
    assert nbytes % CHUNK == 0
    flat = w.view(-1).view(torch.uint8)
    warps = 1 if mode == 2 else 4
    return _prefetch_kernel[(nbytes // CHUNK,)](
        flat, MODE=mode, CHUNK=CHUNK, num_warps=warps, launch_pdl=True
    )


def stream(buf: torch.Tensor, out: torch.Tensor, evict_first: bool) -> object:
    block = 4096
    return _stream_kernel[(buf.numel() // (4 * block),)](
        buf, out, EVICT_FIRST=evict_first, BLOCK=block, num_warps=8, launch_pdl=True
    )


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    x_o = torch.randn(1, 4096, dtype=bf, device=dev)
    x_q = torch.randn(1, 2048, dtype=bf, device=dev)
    w_o = [torch.randn(2048, 4096, dtype=bf, device=dev) for _ in range(ITERS)]
    w_q = [torch.randn(5120, 2048, dtype=bf, device=dev) for _ in range(ITERS)]
    moe = [
        torch.randint(0, 9, (38 * 2**20 // 4,), dtype=torch.int32, device=dev)
        for _ in range(ITERS)
    ]
    sink = torch.empty(4096, dtype=torch.int32, device=dev)
    steps_a: dict = {
        "spin 10": lambda i: spin(10),
        "spin 10 + o_proj": lambda i: (spin(10), skinny_gemm(x_o, w_o[i])),
        "spin 10 + o_proj (hot: one copy)": lambda i: (
            spin(10),
            skinny_gemm(x_o, w_o[0]),
        ),
        "spin 10 + prefetch lines": lambda i: (spin(10), prefetch(w_o[i], 0)),
    }
    for mode, name in ((0, "lines evict_last"), (1, "lines"), (2, "bulk 2 KB")):
        steps_a[f"spin 10 + prefetch {name} + o_proj"] = lambda i, m=mode: (
            spin(10),
            prefetch(w_o[i], m),
            skinny_gemm(x_o, w_o[i]),
        )
    steps_b: dict = {
        "spin 7 + stream": lambda i: (spin(7), stream(moe[i], sink, False))
    }
    for evict in (False, True):
        tag = "evict_first" if evict else "normal"
        steps_b[f"spin 7 + stream {tag} + qkv"] = lambda i, e=evict: (
            spin(7),
            stream(moe[i], sink, e),
            skinny_gemm(x_q, w_q[i]),
        )
        steps_b[f"spin 7 + stream {tag} + qkv cuBLAS"] = lambda i, e=evict: (
            spin(7),
            stream(moe[i], sink, e),
            torch.mm(x_q, w_q[i].T),
        )
        for mode in (0, 2):
            steps_b[f"spin 7 + prefetch{mode} + stream {tag} + qkv"] = (
                lambda i, e=evict, m=mode: (
                    spin(7),
                    prefetch(w_q[i], m),
                    stream(moe[i], sink, e),
                    skinny_gemm(x_q, w_q[i]),
                )
            )
            steps_b[f"spin 7 + prefetch{mode} + stream {tag} + qkv cuBLAS"] = (
                lambda i, e=evict, m=mode: (
                    spin(7),
                    prefetch(w_q[i], m),
                    stream(moe[i], sink, e),
                    torch.mm(x_q, w_q[i].T),
                )
            )
    print(f"device: {torch.cuda.get_device_name()}, {ITERS} iterations per graph")
    for steps in (steps_a, steps_b):
        times = time_graphs_us(steps, ITERS)
        print("| step | us per iteration |\n|---|--:|")
        for name, us in times.items():
            print(f"| {name} | {us:.2f} |")

    # C: skinny_gemm's tiles launched with PDL during a spin (its weight
    # tiles before the wait stream while the spin runs)
    def tile(x, w, out, bn, bk, warps):
        n, k = w.shape
        sg._skinny_gemm_kernel[(triton.cdiv(n, bn),)](
            x, w, out, None, None, None, 1, n, k, x.stride(0), w.stride(0), 0, 0.0,
            BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, PDL=True, NORM=False,
            HAS_RESIDUAL=False, WHOLE_K=sg.skinny_tiles(1, k, False, bk)[2],
            num_warps=warps, launch_pdl=True,
        )  # fmt: skip
        return out

    out_o = torch.empty(1, 2048, dtype=bf, device=dev)
    out_q = torch.empty(1, 5120, dtype=bf, device=dev)
    configs = [(4, 1024, 4), (4, 4096, 8), (4, 4096, 4), (2, 4096, 4), (2, 4096, 8),
               (8, 2048, 8), (4, 2048, 4), (4, 2048, 8), (2, 2048, 4), (16, 2048, 8),
               (8, 4096, 16), (1, 4096, 4)]  # fmt: skip
    for spin_us in (2, 10):
        steps_c: dict = {"spin": lambda i, s=spin_us: spin(s)}
        for bn, bk, warps in configs:
            c = (bn, bk, warps)
            steps_c[f"o_proj {bn}x{bk}x{warps}"] = lambda i, c=c, s=spin_us: (
                spin(s), tile(x_o, w_o[i], out_o, *c)
            )  # fmt: skip
            if bk <= 2048:
                steps_c[f"qkv {bn}x{bk}x{warps}"] = lambda i, c=c, s=spin_us: (
                    spin(s), tile(x_q, w_q[i], out_q, *c)
                )  # fmt: skip
        steps_c["qkv cuBLAS"] = lambda i, s=spin_us: (spin(s), torch.mm(x_q, w_q[i].T))
        times = time_graphs_us(steps_c, ITERS)
        print(f"| after spin {spin_us} us | us over the spin |\n|---|--:|")
        for name, us in times.items():
            print(f"| {name} | {us - times['spin']:.2f} |")
    ref_o = skinny_gemm(x_o, w_o[1])
    for c in configs:
        torch.testing.assert_close(tile(x_o, w_o[1], out_o, *c), ref_o)
    # the prefetch must not change results
    ref = skinny_gemm(x_o, w_o[3])
    prefetch(w_o[3], 2)
    torch.testing.assert_close(skinny_gemm(x_o, w_o[3]), ref, rtol=0, atol=0)
    print("results unchanged by prefetching")


if __name__ == "__main__":
    main()
