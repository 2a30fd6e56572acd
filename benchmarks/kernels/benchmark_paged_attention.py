"""The Triton paged attention against torch's SDPA on a contiguous cache.

Qwen3-30B-A3B's heads (32 query, 4 KV, 128 wide), bf16, cache blocks of 16
tokens scattered over the pool. Decode (one new token per sequence) at
several batch sizes and context lengths, and prefill chunks; the rival is
``F.scaled_dot_product_attention`` with ``enable_gqa`` on an unpaged
[B, KV heads, L, D] cache (what a user of plain PyTorch runs; it cannot
read a paged cache). Both are timed in CUDA graphs, in turn; decode reports
the KV bytes read per second and their fraction of the copy bandwidth,
prefill its TFLOP/s. Decode also times the step as Qwen3 runs it, from the
q/k/v product: the per-head q/k norm + RoPE and the cache store in their
own kernel before attention ("apart"), and inside it (``DecodeKV``,
"fused"), in turn with the others.

    python -m benchmarks.kernels.benchmark_paged_attention
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm.benchmarks.utils import (
    H200_PEAK_TFLOPS,
    copy_bandwidth_gbps,
    time_graphs_us,
    write_results,
)
from vllm.model_executor.kernels.common.qk_norm_rope import QKNormRope, qk_norm_rope_
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.attention.backends.triton_paged import DecodeKV, triton_paged_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
DECODE = [(1, 1024), (1, 8192), (16, 2048), (64, 2048), (256, 1024), (256, 4096)]
PREFILL = [(1, 2048), (4, 512)]  # (sequences, tokens each): a whole prompt


@dataclass
class Row:
    kind: str
    batch: int
    context: int
    triton_us: float
    sdpa_us: float
    speedup: float
    apart_us: float | None  # decode from the q/k/v product: norm + RoPE kernel
    fused_us: float | None  # ... inside attention
    rate: float  # decode: KV GB/s; prefill: TFLOP/s
    ceiling_frac: float  # of the copy bandwidth, or of the bf16 peak


def _case(batch: int, context: int, new: int):
    """The steps to time on ``batch`` sequences of ``context`` cached
    tokens, the last ``new`` of each being this step's queries."""
    blocks = batch * context // PAGE
    kv = torch.randn(2, blocks + 1, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv = kv.cuda()
    table = torch.randperm(blocks, device="cuda").to(torch.int32)
    table = table.view(batch, context // PAGE)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
    # The same keys and values, unpaged, for SDPA.
    rows = table.long().flatten()
    k, v = (
        kv[i][rows].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
        for i in (0, 1)
    )
    sdpa_q = q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)

    def ours(_: int) -> None:
        triton_paged_attention(q, kv[0], kv[1], table, seq_lens, starts, new, 0.08)

    def sdpa(_: int) -> None:
        if new == 1:
            F.scaled_dot_product_attention(sdpa_q, k, v, enable_gqa=True)
        else:  # a whole prompt: causal over itself
            F.scaled_dot_product_attention(
                sdpa_q, k, v, is_causal=True, enable_gqa=True
            )

    steps = {"ours": ours, "sdpa": sdpa}
    if new == 1:
        steps |= _from_qkv(kv, table, seq_lens, starts, context)
    return steps


def _from_qkv(kv, table, seq_lens, starts, context):
    """The decode step from Qwen3's q/k/v product: the norms, rotations and
    cache store as their own kernel, then attention; or all in attention."""
    batch = table.shape[0]
    qkv = torch.randn(
        batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    rope = RotaryEmbedding(HEAD_DIM, 1e6, context, torch.device("cuda"))
    positions = torch.full((batch,), context - 1, device="cuda")
    last = (context - 1) // PAGE
    slots = table[:, last].long() * PAGE + (context - 1) % PAGE
    weight = torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    norm_rope = QKNormRope(weight, weight, 1e-6, rope.cos_sin, positions)
    new_kv = DecodeKV(k, v, slots, norm_rope)

    def apart(_: int) -> None:
        qk_norm_rope_(q, k, norm_rope, kv_cache=kv, v=v, slot_mapping=slots)
        triton_paged_attention(q, kv[0], kv[1], table, seq_lens, starts, 1, 0.08)

    def fused(_: int) -> None:
        triton_paged_attention(
            q, kv[0], kv[1], table, seq_lens, starts, 1, 0.08, new_kv
        )

    return {"apart": apart, "fused": fused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_paged_attention needs a CUDA device")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    rows = []
    for kind, cases in (("decode", DECODE), ("prefill", PREFILL)):
        for batch, context in cases:
            new = 1 if kind == "decode" else context
            times = time_graphs_us(_case(batch, context, new), iters=20)
            if kind == "decode":
                kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
                rate = kv_bytes / times["ours"] / 1e3
                frac = rate / copy_gbps
            else:  # causal: half of QK^T and PV
                flops = 2 * 2 * batch * HEADS * HEAD_DIM * context * context / 2
                rate = flops / times["ours"] / 1e6
                frac = rate / H200_PEAK_TFLOPS[torch.bfloat16]
            rows.append(
                Row(
                    kind,
                    batch,
                    context,
                    times["ours"],
                    times["sdpa"],
                    times["sdpa"] / times["ours"],
                    times.get("apart"),
                    times.get("fused"),
                    rate,
                    frac,
                )
            )
    device = torch.cuda.get_device_name()
    print(
        f"\ndevice: {device}; copy {copy_gbps:.0f} GB/s; bf16, {HEADS} query / "
        f"{KV_HEADS} KV heads x {HEAD_DIM}, blocks of {PAGE}"
    )
    head = (
        f"{'kind':>7} {'batch':>5} {'context':>7} | {'triton us':>9} {'SDPA us':>8} "
        f"{'x SDPA':>6} | {'rate':>14} {'of ceiling':>10} | {'apart us':>8} "
        f"{'fused us':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        unit = "KV GB/s" if r.kind == "decode" else "TFLOP/s"
        print(
            f"{r.kind:>7} {r.batch:>5} {r.context:>7} | {r.triton_us:>9.1f} "
            f"{r.sdpa_us:>8.1f} {r.speedup:>6.2f} | {r.rate:>6.0f} {unit:<7} "
            f"{100 * r.ceiling_frac:>9.0f}% | {_us(r.apart_us):>8} "
            f"{_us(r.fused_us):>8}"
        )
    write_results(args.output_json, device, rows)


def _us(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


if __name__ == "__main__":
    main()
