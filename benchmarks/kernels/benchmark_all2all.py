"""Benchmark expert-parallel dispatch (prepare) and combine (finalize) of the
all2all backends, next to ``all_to_all_single`` moving the same bytes (the
ceiling, measured in the same run).

Spawns one process per GPU itself (no torchrun) and runs NCCL; without CUDA
it runs gloo on the CPU at tiny sizes (a smoke run). Times are the slowest
rank's median per call; GB/s counts the bytes a rank receives from its peers
(dispatch: tokens, routing; combine: output rows), averaged over ranks. The
all-gather backend runs twice: exchanging the token counts first, and with
them known (the engine's steps, which replay it in CUDA graphs).

    python benchmarks/kernels/benchmark_all2all.py --world-size 2 \
        --tokens 1 64 512 4096 8192 --hidden 2048 7168 --topk 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from vllm.benchmarks.utils import write_results
from vllm.distributed import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_distributed_init_method,
    get_ep_group,
    get_open_port,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.forward_context import DPMetadata, set_forward_context
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.expert_placement import ExpertPlacement
from vllm.model_executor.layers.fused_moe.modular_kernel import PrepareResult
from vllm.model_executor.layers.fused_moe.prepare_finalize import (
    ALL2ALL_BACKENDS,
    make_prepare_finalize,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.all2all import (
    All2AllPrepareResult,
)


@dataclass
class Row:
    device: str
    ranks: int
    tokens: int  # per rank
    hidden: int
    topk: int
    backend: str
    dispatch_us: float
    dispatch_gbps: float
    combine_us: float
    combine_gbps: float
    ceiling_us: float  # all_to_all_single of the dispatch's bytes
    ceiling_gbps: float


def _time_us(group: GroupCoordinator, call: Callable[[], object], iters: int) -> float:
    """The slowest rank's median time of ``call``, ranks started together."""
    cuda = group.device.type == "cuda"
    times = []
    for _ in range(iters + 2):  # two warm-up calls
        group.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    mine = torch.tensor([statistics.median(times[2:])], device=group.device)
    return float(group.all_gather(mine).max())


def _mean_over_ranks(group: GroupCoordinator, value: float) -> float:
    gathered = group.all_gather(torch.tensor([value], device=group.device))
    return float(gathered.mean())


def _peer_bytes(prepared: PrepareResult, group: GroupCoordinator) -> tuple[int, int]:
    """(dispatch, combine) bytes this rank receives from its peers."""
    me = group.rank_in_group
    token_row = prepared.a1q.shape[1] * prepared.a1q.element_size()
    routing_row = 2 * prepared.topk_ids.shape[1] * 4
    if isinstance(prepared, All2AllPrepareResult):  # rows as routed
        received = sum(prepared.recv_splits) - prepared.recv_splits[me]
        returned = sum(prepared.send_splits) - prepared.send_splits[me]
    else:  # all-gather: every peer's padded block; reduce-scatter: my block
        block = prepared.a1q.shape[0] // group.world_size
        received = returned = block * (group.world_size - 1)
    return received * (token_row + routing_row), returned * token_row


def _ceiling_us(group: GroupCoordinator, nbytes: int, iters: int) -> float:
    """all_to_all_single that hands each rank ``nbytes`` from its peers."""
    peers = group.world_size - 1
    chunk = max(1, -(-nbytes // peers))
    send = torch.empty(group.world_size * chunk, dtype=torch.uint8, device=group.device)
    recv = torch.empty_like(send)
    splits = [chunk] * group.world_size
    return _time_us(
        group, lambda: group.all_to_all_single(recv, send, splits, splits), iters
    )


def bench_backend(
    group: GroupCoordinator,
    backend: str,
    placement: ExpertPlacement,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    iters: int,
    dp: DPMetadata | None,
) -> dict[str, float]:
    quant = FusedMoEQuantConfig()
    pf = make_prepare_finalize(backend, group, placement, group.device)

    def prepare() -> PrepareResult:
        with set_forward_context(None, dp):
            return pf.prepare(x, weights, ids, quant)

    prepared = prepare()
    fused_out = torch.randn_like(prepared.a1q)
    dispatch_us = _time_us(group, prepare, iters)
    combine_us = _time_us(group, lambda: pf.finalize(fused_out, prepared), iters)
    dispatch_bytes, combine_bytes = _peer_bytes(prepared, group)
    ceiling_us = _ceiling_us(group, dispatch_bytes, iters)

    def gbps(nbytes: int, us: float) -> float:
        return _mean_over_ranks(group, nbytes / (us * 1e-6) / 1e9)

    return {
        "dispatch_us": dispatch_us,
        "dispatch_gbps": gbps(dispatch_bytes, dispatch_us),
        "combine_us": combine_us,
        "combine_gbps": gbps(combine_bytes, combine_us),
        "ceiling_us": ceiling_us,
        "ceiling_gbps": gbps(dispatch_bytes, ceiling_us),
    }


def bench(args: argparse.Namespace, group: GroupCoordinator, name: str) -> list[Row]:
    device = group.device
    placement = ExpertPlacement(args.num_experts, group.world_size, group.rank_in_group)
    rows = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            gen = torch.Generator(device=device).manual_seed(group.rank)
            x = torch.randn(
                tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen
            )
            scores = torch.rand(tokens, args.num_experts, device=device, generator=gen)
            weights, ids = scores.topk(args.topk, dim=1)
            # the engine's steps know every rank's count before the step
            counts = DPMetadata([tokens] * group.world_size)
            for backend, label, dp in (
                (ALL2ALL_BACKENDS[0], ALL2ALL_BACKENDS[0], None),
                (ALL2ALL_BACKENDS[0], "allgather (counts known)", counts),
                (ALL2ALL_BACKENDS[1], ALL2ALL_BACKENDS[1], None),
            ):
                timings = bench_backend(
                    group,
                    backend,
                    placement,
                    x,
                    weights,
                    ids.to(torch.int32),
                    args.iters,
                    dp,
                )
                rows.append(
                    Row(
                        device=name,
                        ranks=group.world_size,
                        tokens=tokens,
                        hidden=hidden,
                        topk=args.topk,
                        backend=label,
                        **timings,
                    )
                )
    return rows


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'device':>22} {'ranks':>5} {'T/rank':>6} {'hidden':>6} {'topk':>4} "
        f"{'backend':>24} | {'dispatch us':>11} {'GB/s':>7} | {'combine us':>10} "
        f"{'GB/s':>7} | {'a2a us':>8} {'GB/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.device[:22]:>22} {r.ranks:>5} {r.tokens:>6} {r.hidden:>6} "
            f"{r.topk:>4} {r.backend:>24} | {r.dispatch_us:>11.1f} "
            f"{r.dispatch_gbps:>7.2f} | {r.combine_us:>10.1f} {r.combine_gbps:>7.2f} "
            f"| {r.ceiling_us:>8.1f} {r.ceiling_gbps:>7.2f}"
        )


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    cuda = torch.cuda.is_available()
    init_distributed_environment(
        args.world_size,
        rank,
        get_distributed_init_method("127.0.0.1", port),
        backend="nccl" if cuda else "gloo",
    )
    try:
        initialize_model_parallel(data_parallel_size=args.world_size)
        name = torch.cuda.get_device_name() if cuda else "CPU (gloo smoke run)"
        rows = bench(args, get_ep_group(), name)
        if rank == 0:
            print_table(rows)
            write_results(args.output_json, name, rows, num_experts=args.num_experts)
    finally:
        destroy_distributed_environment()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="tokens per rank"
    )
    parser.add_argument("--hidden", type=int, nargs="+", default=None)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20 if cuda else 3)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    args.tokens = args.tokens or ([1, 64, 512, 4096, 8192] if cuda else [1, 16])
    args.hidden = args.hidden or ([2048, 7168] if cuda else [64])
    if cuda and torch.cuda.device_count() < args.world_size:
        raise SystemExit(
            f"--world-size: expected at most {torch.cuda.device_count()} (the "
            f"GPUs here), got {args.world_size}"
        )
    if args.world_size < 2:
        raise SystemExit(f"--world-size: expected >= 2, got {args.world_size}")
    mp.spawn(worker, args=(args, get_open_port()), nprocs=args.world_size)


if __name__ == "__main__":
    main()
