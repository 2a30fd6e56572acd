"""The MoE layer at decode sizes against the bytes it must read.

For bf16 (``triton``), fp8 (``triton_fp8``), W4A8 (``triton_w4a8``) and
W4A16 (``marlin``) experts at each token count: the layer as the model
calls it (the router's GEMM and routing, fused at 1 token, then the modular
kernel), timed under CUDA-graph replay on the decode kernels (route by
route: :mod:`~vllm.model_executor.kernels.grouped_gemm.decode` for 16-bit
and fp8 weights, :mod:`~vllm.model_executor.kernels.marlin.moe_decode` for
uint4 ones), on the same
launched without programmatic dependent launch (``VLLM_DISABLE_PDL``), at
1 token with the router's GEMM and routing as two kernels
(``skinny_gemm`` + ``topk_softmax``), on the sorted path and, for uint4
weights, on the grouped tensor-core kernels
(:mod:`~vllm.model_executor.kernels.marlin.moe_grouped_mma`); where the
experts route from logits, also as the model calls it (``forward_normed``:
the residual add and RMSNorm first, in the router's GEMM at 1 token), the
routing by ids (``normed ids``) or in the decode kernels (``normed
routed``); the bound
(the router's and the distinct routed experts' weights read once at the
copy bandwidth measured in the same run), the ratios to it, and the kernel
launches per call and the decode path's kernels with their device times
(profiled eagerly, without PDL). With ``--sweep`` it also times the decode
kernels alone over a grid of tiles and prints the fastest per token count
(the grouped kernels' tiles past the decode sizes).

    python -m benchmarks.kernels.benchmark_moe_decode --tokens 1 2 4 8 16 64
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from vllm.benchmarks.utils import (
    add_moe_dims_args,
    copy_bandwidth_gbps,
    time_graphs_us,
    write_results,
)
from vllm.model_executor.kernels.common.router_topk import router_topk_applies
from vllm.model_executor.kernels.common.skinny_gemm import skinny_gemm
from vllm.model_executor.kernels.grouped_gemm import DecodeConfig, moe_decode
from vllm.model_executor.kernels.grouped_gemm.decode import default_decode_config
from vllm.model_executor.kernels.grouped_gemm.w4a8 import W4_GROUP
from vllm.model_executor.kernels.marlin.config import (
    MarlinDecodeConfig,
    default_marlin_decode_config,
)
from vllm.model_executor.kernels.marlin.moe_decode import marlin_moe_decode
from vllm.model_executor.kernels.marlin.moe_decode_mma import (
    MmaMoeDecodeConfig,
    default_mma_moe_decode_config,
)
from vllm.model_executor.kernels.marlin.moe_grouped_mma import (
    GroupedMmaConfig,
    default_grouped_mma_config,
    marlin_moe_grouped,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts.fused_marlin_moe import (
    GROUP_SIZE,
    MarlinExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_fp8_moe import (
    TritonExpertsFp8,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.experts.triton_w4a8_moe import (
    TritonExpertsW4A8,
)
from vllm.model_executor.layers.fused_moe.layer import make_experts
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    MoEPermuteScratch,
    moe_prepare_scatter,
)
from vllm.model_executor.layers.fused_moe.routing import (
    fused_topk,
    gated_topk,
    rms_norm_gated_logits,
    rms_norm_gated_topk,
)
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

SCHEMES = {
    "bf16": ("triton", QuantScheme.UNQUANTIZED),
    "fp8": ("triton_fp8", QuantScheme.FP8_PER_TOKEN),
    "w4a8": ("triton_w4a8", QuantScheme.W4A8_UINT4),
    "w4a16": ("marlin", QuantScheme.W4A16_UINT4),
}
DecodeExperts = TritonExperts | TritonExpertsFp8 | TritonExpertsW4A8 | MarlinExperts
ITERS = 20  # layer calls per graph, each with its own routing
MAX_ACC = 128  # fp32 products per thread in a swept tile: beyond, spills


@dataclass
class Row:
    weights: str
    tokens: int
    distinct_experts: float  # mean over the routings
    bound_us: float
    decode_us: float
    decode_no_pdl_us: float
    split_router_us: float | None  # 1 token, where router_topk applies
    # the model's call (forward_normed), where the experts route from logits
    normed_ids_us: float | None
    normed_routed_us: float | None
    sorted_us: float
    grouped_us: float | None  # uint4: the grouped tensor-core kernels
    decode_kernels: list[tuple[str, float]]  # eager, without PDL: name, us
    sorted_launches: int

    @property
    def decode_ratio(self) -> float:
        return self.decode_us / self.bound_us

    @property
    def sorted_ratio(self) -> float:
        return self.sorted_us / self.bound_us


@contextlib.contextmanager
def pdl_disabled(disabled: bool) -> Iterator[None]:
    """``VLLM_DISABLE_PDL=1`` while inside, when ``disabled``."""
    before = os.environ.get("VLLM_DISABLE_PDL")
    if disabled:
        os.environ["VLLM_DISABLE_PDL"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_DISABLE_PDL", None)
        else:
            os.environ["VLLM_DISABLE_PDL"] = before


def profile_kernels(step: Callable[[int], None]) -> list[tuple[str, float]]:
    """The kernels of one eager call: names and device times (us)."""
    from torch.profiler import ProfilerActivity, profile

    step(0)  # compiled and warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(1)
        torch.cuda.synchronize()
    return [
        (e.name, e.device_time_total)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    ]


def bench(
    label: str, tokens: int, args: argparse.Namespace, bandwidth: float
) -> tuple[Row, dict[str, float], str]:
    backend, scheme = SCHEMES[label]
    device = torch.device("cuda")
    e, k, i = args.num_experts, args.hidden_size, args.intermediate_size
    moe = FusedMoEConfig(
        e, args.topk, k, i, quant_config=FusedMoEQuantConfig(scheme=scheme)
    )
    w13 = (torch.randn(e, 2 * i, k, device=device) / k**0.5).bfloat16()
    w2 = (torch.randn(e, k, i, device=device) / i**0.5).bfloat16()
    experts = make_experts(moe, w13, w2, backend)
    assert isinstance(experts, DecodeExperts)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    # each call its own tokens, so its own routing (one routing for all
    # would keep its experts in L2)
    hidden = torch.randn(ITERS, tokens, k, device=device, dtype=torch.bfloat16)
    gate = (torch.randn(e, k, device=device) / k**0.5).bfloat16()

    def use(path: str) -> None:
        """The experts' path for this batch: decode, grouped or sorted."""
        experts.decode_max_tokens = tokens if path == "decode" else 0
        if isinstance(experts, MarlinExperts | TritonExpertsW4A8):
            experts.grouped_max_tokens = tokens if path == "grouped" else 0

    def layer(path: str, with_pdl: bool = True) -> Callable[[int], None]:
        def step(it: int) -> None:
            use(path)
            x = hidden[it]
            with pdl_disabled(not with_pdl):  # read at launch (and capture)
                kernel.forward(x, *gated_topk(x, gate, args.topk, True))

        return step

    def split_router(it: int) -> None:
        use("decode")
        x = hidden[it]
        kernel.forward(x, *fused_topk(x, skinny_gemm(x, gate), args.topk, True))

    residual = torch.randn_like(hidden)
    norm_weight = (torch.rand(k, device=device) + 0.5).bfloat16()

    def normed(routed: bool) -> Callable[[int], None]:
        def step(it: int) -> None:
            use("decode")
            x, r = hidden[it], residual[it]
            if routed:
                logits, h, _ = rms_norm_gated_logits(x, r, norm_weight, 1e-6, gate)
                kernel.forward_routed(h, logits, True)
            else:
                w, ids, h, _ = rms_norm_gated_topk(
                    x, r, norm_weight, 1e-6, gate, args.topk, True
                )
                kernel.forward(h, w, ids)

        return step

    steps = {
        "decode": layer("decode"),
        "decode_no_pdl": layer("decode", with_pdl=False),
        "sorted": layer("sorted"),
    }
    uint4 = isinstance(experts, MarlinExperts | TritonExpertsW4A8)
    if uint4:
        steps["grouped"] = layer("grouped")
    if router_topk_applies(tokens, e, torch.bfloat16):
        steps["split_router"] = split_router
    use("decode")
    if kernel.routes_from_logits(hidden[0]):
        steps["normed_ids"], steps["normed_routed"] = normed(False), normed(True)
    times = time_graphs_us(steps, ITERS)
    kernels = {n: profile_kernels(steps[n]) for n in ("decode_no_pdl", "sorted")}
    ids = [gated_topk(hidden[it], gate, args.topk, True)[1] for it in range(ITERS)]
    distinct = sum(len(x.unique()) for x in ids) / ITERS
    # weights and their fp32 scales: per channel (fp8), per group of 128 (w4a8)
    expert_bytes = {
        "bf16": 3 * i * k * 2,
        "fp8": 3 * i * k + (3 * i + k) * 4,
        "w4a8": 3 * i * k // 2 + 3 * i * k // 128 * 4,
        "w4a16": 3 * i * k // 2 + 3 * i * k // 128 * 2,
    }[label]
    bound_us = (distinct * expert_bytes + e * k * 2) / (bandwidth * 1e9) * 1e6
    row = Row(
        label, tokens, distinct, bound_us, times["decode"], times["decode_no_pdl"],
        times.get("split_router"), times.get("normed_ids"),
        times.get("normed_routed"), times["sorted"], times.get("grouped"),
        kernels["decode_no_pdl"], len(kernels["sorted"]),
    )  # fmt: skip
    if isinstance(experts, MarlinExperts | TritonExpertsW4A8):
        sweep = {}
        if args.sweep and tokens <= type(experts).decode_max_tokens:
            sweep = sweep_uint4_tiles(experts, hidden[0], ids)
        elif args.sweep and tokens <= type(experts).grouped_max_tokens:
            sweep = sweep_grouped_tiles(experts, hidden[0], ids)
            return row, sweep, str(default_grouped_mma_config())
        # What the layer runs on a GPU: the tensor-core kernels from 2 tokens.
        shipped = (
            default_mma_moe_decode_config(tokens)
            if tokens >= 2
            else default_marlin_decode_config()
        )
        return row, sweep, str(shipped)
    sweep = sweep_tiles(experts, hidden[0], ids) if args.sweep and tokens <= 8 else {}
    return row, sweep, str(default_decode_config(tokens, experts.w13.dtype))


def uint4_weights(
    experts: MarlinExperts | TritonExpertsW4A8,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """The experts' packed w13, its scales, w2, its scales; the group size."""
    if isinstance(experts, MarlinExperts):
        packed = (experts.w13_packed, experts.w13_scales, experts.w2_packed,
                  experts.w2_scales)  # fmt: skip
        return packed, GROUP_SIZE
    return (experts.w13, experts.w13_scale, experts.w2, experts.w2_scale), W4_GROUP


def sweep_uint4_tiles(
    experts: MarlinExperts | TritonExpertsW4A8,
    hidden: torch.Tensor,
    ids: list[torch.Tensor],
) -> dict[str, float]:
    """:func:`sweep_tiles` for the uint4 decode kernels (W4A16, W4A8), the
    CUDA-core kernels' tiles and the tensor-core kernels'."""
    moe = experts.moe
    packed, group_size = uint4_weights(experts)
    rows, dtype = ids[0].numel(), hidden.dtype
    weights = torch.rand(ids[0].shape, device=hidden.device)
    act = torch.empty(rows, moe.intermediate_size, device=hidden.device, dtype=dtype)
    out = torch.empty_like(hidden)
    steps: dict[str, Callable[[int], None]] = {}
    for gated, down_tile in itertools.product(
        (
            (4, 1024, 4),
            (8, 1024, 4),
            (16, 1024, 4),
            (8, 512, 2),
            (4, 2048, 2),
            (8, 2048, 4),
            (8, 2048, 8),
        ),
        ((1, 256, 1), (2, 256, 1), (4, 256, 1), (1, 512, 2), (2, 512, 2)),
    ):
        config = MarlinDecodeConfig(*gated, *down_tile)

        def step(it: int, config: MarlinDecodeConfig = config) -> None:
            marlin_moe_decode(
                hidden, ids[it], weights, *packed, None, moe.activation, group_size,
                act, out, config,
            )  # fmt: skip

        steps[str(config)] = step
    for gated_mma, down_mma in itertools.product(  # the tensor-core kernels
        ((1, 1, 1), (2, 1, 2), (2, 2, 4), (4, 2, 2), (4, 4, 2), (2, 1, 8)),
        ((1, 1, 8), (1, 1, 4), (2, 2, 8), (4, 4, 8)),
    ):
        mma = MmaMoeDecodeConfig(*gated_mma, *down_mma)

        def mma_step(it: int, config: MmaMoeDecodeConfig = mma) -> None:
            marlin_moe_decode(
                hidden, ids[it], weights, *packed, None, moe.activation, group_size,
                act, out, config,
            )  # fmt: skip

        steps[str(mma)] = mma_step
    return time_graphs_us(steps, ITERS, repeats=3)


def sweep_grouped_tiles(
    experts: MarlinExperts | TritonExpertsW4A8,
    hidden: torch.Tensor,
    ids: list[torch.Tensor],
) -> dict[str, float]:
    """The grouped tensor-core kernels alone over a grid of tiles, each call
    on its own routing, sorted beforehand (the sort is not timed)."""
    moe = experts.moe
    packed, group_size = uint4_weights(experts)
    (rows, topk), dtype, device = ids[0].shape, hidden.dtype, hidden.device
    rows *= topk
    sorts = []
    for routing in ids:
        scratch = MoEPermuteScratch(moe.num_experts, moe.num_local_experts, device)
        offsets, _ = moe_prepare_scatter(routing, None, scratch)
        sorts.append((scratch.permuted_idx[:rows].clone(), offsets.clone()))
    act = torch.empty(rows, moe.intermediate_size, device=device, dtype=dtype)
    down = torch.empty(rows, moe.hidden_size, device=device, dtype=dtype)
    steps: dict[str, Callable[[int], None]] = {}
    for tiles in (
        (4, 2, 2, 2, 1, 2),
        (2, 2, 4, 2, 1, 2),
        (2, 1, 2, 2, 1, 2),
        (8, 4, 2, 2, 1, 2),
        (4, 2, 2, 4, 2, 2),
        (4, 2, 2, 2, 1, 4),
        (4, 2, 2, 2, 2, 4),
        (1, 1, 4, 1, 1, 4),
        (4, 4, 1, 4, 4, 1),
    ):
        config = GroupedMmaConfig(*tiles)

        def step(it: int, config: GroupedMmaConfig = config) -> None:
            marlin_moe_grouped(
                hidden, *sorts[it], topk, *packed, moe.activation, group_size,
                act, down, config,
            )  # fmt: skip

        steps[str(config)] = step
    return time_graphs_us(steps, ITERS, repeats=3)


def sweep_tiles(
    experts: TritonExperts | TritonExpertsFp8,
    hidden: torch.Tensor,
    ids: list[torch.Tensor],
) -> dict[str, float]:
    """The decode kernels alone, per tile configuration, each call on its
    own routing (one routing for all would keep its experts in L2)."""
    moe = experts.moe
    weights = torch.rand(ids[0].shape, device=hidden.device)
    act = torch.empty(ids[0].numel(), moe.intermediate_size, device=hidden.device)
    act = act.to(hidden.dtype)
    out = torch.empty_like(hidden)
    scales = (getattr(experts, "w13_scale", None), getattr(experts, "w2_scale", None))
    steps = {}
    routes = triton.next_power_of_2(ids[0].shape[1])
    for gn, gk, dn, dk, warps in itertools.product(
        (4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8, 16), (128, 256, 512), (4, 8)
    ):
        threads = 32 * warps
        if 2 * gn * gk > MAX_ACC * threads or routes * dn * dk > MAX_ACC * threads:
            continue
        config = DecodeConfig(gn, gk, dn, dk, warps)

        def step(it: int, config: DecodeConfig = config) -> None:
            moe_decode(
                hidden, ids[it], weights, experts.w13, scales[0], experts.w2, scales[1],
                None, moe.activation, act, out, config,
            )  # fmt: skip

        steps[str(config)] = step
    return time_graphs_us(steps, ITERS, repeats=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", nargs="+", choices=sorted(SCHEMES), default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    add_moe_dims_args(parser)
    parser.add_argument("--sweep", action="store_true", help="also sweep the tiles")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_moe_decode times CUDA graphs: it needs a GPU")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbps(device)
    init_workspace_manager(device)
    rows, sweeps = [], {}
    for label in args.weights or list(SCHEMES):
        for tokens in args.tokens:
            row, sweep, shipped = bench(label, tokens, args, bandwidth)
            rows.append(row)
            if sweep:
                best = sorted(sweep.items(), key=lambda kv: kv[1])[:3]
                if shipped in sweep:
                    best.append((f"shipped {shipped}", sweep[shipped]))
                sweeps[f"{label} @ {tokens}"] = best
    reset_workspace_manager()
    name = torch.cuda.get_device_name()
    print(
        f"device: {name}; copy {bandwidth:.0f} GB/s; experts {args.num_experts}, "
        f"top-{args.topk}, hidden {args.hidden_size}, intermediate "
        f"{args.intermediate_size}; layer = routing + experts, CUDA graphs"
    )
    print(
        f"{'weights':<7} {'tokens':>6} {'experts':>7} {'bound us':>9} "
        f"{'decode us':>10} {'x bound':>8} {'no PDL us':>10} {'2-kernel router':>15} "
        f"{'normed ids':>10} {'normed routed':>13} "
        f"{'sorted us':>10} {'x bound':>8} {'grouped us':>10} {'x bound':>8} "
        f"{'launches':>9}"
    )

    def us(t: float | None) -> str:
        return "-" if t is None else f"{t:.1f}"

    def ratio(t: float | None, bound: float) -> str:
        return "-" if t is None else f"{t / bound:.2f}"

    for r in rows:
        print(
            f"{r.weights:<7} {r.tokens:>6} {r.distinct_experts:>7.1f} "
            f"{r.bound_us:>9.1f} {r.decode_us:>10.1f} {r.decode_ratio:>8.2f} "
            f"{r.decode_no_pdl_us:>10.1f} {us(r.split_router_us):>15} "
            f"{us(r.normed_ids_us):>10} {us(r.normed_routed_us):>13} "
            f"{r.sorted_us:>10.1f} {r.sorted_ratio:>8.2f} {us(r.grouped_us):>10} "
            f"{ratio(r.grouped_us, r.bound_us):>8} "
            f"{len(r.decode_kernels):>4}/{r.sorted_launches:<4}"
        )
    print("decode path kernels (eager, without PDL; device us):")
    for r in rows:
        kernels = "; ".join(f"{name[:40]} {us:.1f}" for name, us in r.decode_kernels)
        print(f"  {r.weights} @ {r.tokens}: {kernels}")
    for key, best in sweeps.items():
        print(f"fastest tiles, {key}: " + "; ".join(f"{c} {t:.1f} us" for c, t in best))
    write_results(args.output_json, name, rows, bandwidth_gbps=bandwidth, sweeps=sweeps)


if __name__ == "__main__":
    main()
