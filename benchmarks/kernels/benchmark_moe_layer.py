"""Whole MoE layer per experts backend, against its grouped GEMMs alone.

For each backend and token count: the modular kernel's forward (routing
given) timed under CUDA-graph replay, its TFLOP/s, and two references on data
of the same routing:

- the layer's own two GEMMs alone, and the share of the layer's time outside
  them (1 - GEMMs / layer): ``torch._grouped_mm`` for grouped_mm,
  ``_scaled_grouped_mm`` for cutlass, this project's kernels for triton and
  triton_fp8 (whose GEMM1 has the gather and the activation fused in, so
  outside them are the sort, the unpermute and for FP8 the input
  quantization and, where GEMM1 does not quantize its own output, the
  activation's quantization);
- torch's grouped GEMMs alone (``_grouped_mm`` / ``_scaled_grouped_mm``), the
  alternative a user would pick, for every bf16 and FP8 per-token layer.

Humming and Marlin layers run their own GEMMs and have no share.
``--breakdown`` also profiles each layer at the largest token count and
prints the device time per kernel (where the time outside the GEMMs goes)
and the share outside the GEMM kernels of the same calls, which unlike the
GEMMs-alone share does not depend on the clocks staying the same between
two timings (the bf16 GEMMs' time drifts by up to 10% over a run).

    python -m benchmarks.kernels.benchmark_moe_layer --tokens 1024 8192
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.benchmarks.utils import (
    H200_PEAK_TFLOPS,
    add_moe_dims_args,
    time_cpu_us,
    time_graphs_us,
    write_results,
)
from vllm.model_executor.kernels.common.device_info import is_hopper
from vllm.model_executor.kernels.common.fp8 import (
    per_channel_quant_fp8,
    per_token_quant_fp8,
)
from vllm.model_executor.kernels.grouped_gemm import (
    grouped_gemm,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_gated,
    moe_gemm_kernels,
    quantize_groups_reference,
)
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
    grouped_mm,
    grouped_mm_ends,
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
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import moe_permute
from vllm.model_executor.layers.fused_moe.routing import fused_topk
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

# Benchmark label -> (experts backend, scheme).
BACKENDS = {
    "grouped_mm": ("grouped_mm", QuantScheme.UNQUANTIZED),
    "triton": ("triton", QuantScheme.UNQUANTIZED),
    "cutlass": ("cutlass", QuantScheme.FP8_PER_TOKEN),
    "triton_fp8": ("triton_fp8", QuantScheme.FP8_PER_TOKEN),
    "humming": ("humming", QuantScheme.W4A16_UINT4),
    "humming_fp8": ("humming", QuantScheme.FP8_PER_TOKEN),
    "marlin": ("marlin", QuantScheme.W4A16_UINT4),
    "triton_w4a8": ("triton_w4a8", QuantScheme.W4A8_UINT4),
}


@dataclass
class Row:
    backend: str
    tokens: int
    layer_us: float
    tflops: float
    peak_fraction: float  # of the H200 dense peak for the GEMMs' operand dtype
    gemm_us: float | None  # the layer's own GEMMs alone
    outside_gemm_share: float | None  # 1 - gemm_us / layer_us
    torch_gemm_us: float | None  # torch's grouped GEMMs alone, same data


def humming_available() -> bool:
    try:
        import humming  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def kernel_breakdown(
    step: Callable[[int], None], iters: int
) -> list[tuple[str, float]]:
    """Device microseconds per layer call of each kernel, slowest first
    (eager calls under the profiler, after the graph timing warmed up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for it in range(iters):
            step(it)
        torch.cuda.synchronize()
    times = [
        (e.key, e.self_device_time_total / iters)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    return sorted(times, key=lambda kv: -kv[1])


def bench(
    label: str,
    tokens: int,
    moe: FusedMoEConfig,
    device: torch.device,
    breakdowns: dict[str, list[tuple[str, float]]] | None = None,
) -> Row:
    cuda = device.type == "cuda"
    e, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
    w13 = (torch.randn(e, 2 * i, k, device=device) / k**0.5).to(moe.in_dtype)
    w2 = (torch.randn(e, k, i, device=device) / i**0.5).to(moe.in_dtype)
    experts = make_experts(moe, w13, w2, BACKENDS[label][0])
    scheme = moe.quant_config.scheme
    fp8 = scheme == QuantScheme.FP8_PER_TOKEN
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(tokens, k, device=device, dtype=moe.in_dtype)
    iters = 20 if tokens < 1024 else 5
    routings = [
        fused_topk(
            hidden,
            torch.randn(tokens, moe.num_experts, device=device),
            moe.experts_per_token,
            True,
        )
        for _ in range(iters)
    ]

    def layer_step(it: int) -> None:
        kernel.forward(hidden, *routings[it])

    steps: dict[str, Callable[[int], None]] = {"layer": layer_step}
    # The GEMMs alone, on data of the same routing: the layer's own (for the
    # share outside them) and torch's (the alternative a user would pick).
    a_perm, _, offsets, _, src_routes = moe_permute(
        hidden, None, routings[0][1], moe.num_experts
    )
    act = torch.randn(a_perm.shape[0], i, device=device, dtype=moe.in_dtype)
    ends = grouped_mm_ends(offsets)
    if fp8:
        operands = [
            (*per_token_quant_fp8(x), *per_channel_quant_fp8(w))
            for x, w in ((a_perm, w13), (act, w2))
        ]

        def torch_fp8_gemms(it: int) -> None:
            for x, x_s, w, w_s in operands:
                grouped_mm(x, w, ends, x_s.view(-1), w_s, moe.in_dtype)

        steps["torch"] = torch_fp8_gemms
    elif scheme == QuantScheme.UNQUANTIZED:

        def torch_gemms(it: int) -> None:
            grouped_mm(a_perm, w13, ends)
            grouped_mm(act, w2, ends)

        steps["torch"] = torch_gemms
    if isinstance(experts, TritonExpertsFp8) and cuda:  # kernels only
        steps["own"] = triton_fp8_gemms(experts, hidden, src_routes, offsets)
    elif isinstance(experts, TritonExpertsW4A8) and cuda:
        steps["own"] = triton_w4a8_gemms(experts, hidden, src_routes, offsets)
    elif isinstance(experts, TritonExperts) and cuda:
        steps["own"] = triton_gemms(experts, hidden, src_routes, offsets)
    times = (
        time_graphs_us(steps, iters)
        if cuda
        else {name: time_cpu_us(step, 2) for name, step in steps.items()}
    )
    if breakdowns is not None and cuda:
        breakdowns[f"{label} @ {tokens}"] = kernel_breakdown(layer_step, iters)
    layer_us, torch_gemm_us = times["layer"], times.get("torch")
    # torch's GEMMs are the cutlass and grouped_mm layers' own.
    torch_own = isinstance(experts, CutlassExpertsFp8 | GroupedMMExperts)
    gemm_us = torch_gemm_us if torch_own else times.get("own")
    flops = 6 * tokens * moe.experts_per_token * k * i
    share = None if gemm_us is None else max(0.0, 1 - gemm_us / layer_us)
    tflops = flops / (layer_us * 1e-6) / 1e12
    fp8_mma = fp8 or scheme == QuantScheme.W4A8_UINT4
    peak = H200_PEAK_TFLOPS[torch.float8_e4m3fn if fp8_mma else torch.bfloat16]
    return Row(
        label, tokens, layer_us, tflops, tflops / peak, gemm_us, share, torch_gemm_us
    )


def triton_gemms(
    experts: TritonExperts,
    hidden: torch.Tensor,
    src_routes: torch.Tensor,
    offsets: torch.Tensor,
) -> Callable[[int], None]:
    """The bf16 layer's two GEMMs: GEMM1 with its gather and activation,
    GEMM2."""
    moe = experts.moe
    rows = src_routes.shape[0]
    act, down = (
        torch.empty(rows, cols, device=hidden.device, dtype=hidden.dtype)
        for cols in (moe.intermediate_size, moe.hidden_size)
    )
    topk = moe.experts_per_token

    def step(it: int) -> None:
        grouped_gemm_gated(
            hidden, src_routes, topk, experts.w13, offsets, moe.activation, act
        )
        grouped_gemm(act, experts.w2, offsets, down)

    return step


def triton_fp8_gemms(
    experts: TritonExpertsFp8,
    hidden: torch.Tensor,
    src_routes: torch.Tensor,
    offsets: torch.Tensor,
) -> Callable[[int], None]:
    """The layer's two GEMMs as it runs them: GEMM1 with its gather and
    activation (quantized in groups where both take the Hopper kernels),
    GEMM2."""
    moe = experts.moe
    rows, inter = src_routes.shape[0], moe.intermediate_size
    a_q, a_scale = per_token_quant_fp8(hidden)
    act = torch.randn(rows, inter, device=hidden.device, dtype=hidden.dtype)
    down = torch.empty(rows, moe.hidden_size, device=hidden.device, dtype=hidden.dtype)
    act_q, act_scale = quantize_groups_reference(act.float())
    gemm1_scale: torch.Tensor | None
    gemm1_out, gemm1_scale = act_q, act_scale
    if not moe_gemm_kernels(a_q, experts.w13, act_q, experts.w2, down).group_scales:
        act_q, act_scale = per_token_quant_fp8(act)
        act_scale = act_scale.view(-1)
        gemm1_out, gemm1_scale = act, None

    def step(it: int) -> None:
        grouped_gemm_fp8_gated(
            a_q,
            a_scale.view(-1),
            src_routes,
            moe.experts_per_token,
            experts.w13,
            experts.w13_scale,
            offsets,
            moe.activation,
            gemm1_out,
            out_scale=gemm1_scale,
        )
        grouped_gemm_fp8(act_q, act_scale, experts.w2, experts.w2_scale, offsets, down)

    return step


def triton_w4a8_gemms(
    experts: TritonExpertsW4A8,
    hidden: torch.Tensor,
    src_routes: torch.Tensor,
    offsets: torch.Tensor,
) -> Callable[[int], None]:
    """The W4A8 layer's two grouped GEMMs (its sorted path): GEMM1 with its
    gather and activation, GEMM2 on fp8 rows."""
    moe = experts.moe
    rows, inter = src_routes.shape[0], moe.intermediate_size
    a_q, a_scale = per_token_quant_fp8(hidden)
    act = torch.empty(rows, inter, device=hidden.device, dtype=hidden.dtype)
    act_q, act_scale = per_token_quant_fp8(torch.randn_like(act))
    down = torch.empty(rows, moe.hidden_size, device=hidden.device, dtype=hidden.dtype)

    def step(it: int) -> None:
        grouped_gemm_w4a8_gated(
            a_q,
            a_scale.view(-1),
            src_routes,
            moe.experts_per_token,
            experts.w13,
            experts.w13_scale,
            offsets,
            moe.activation,
            act,
        )
        grouped_gemm_w4a8(
            act_q, act_scale.view(-1), experts.w2, experts.w2_scale, offsets, down
        )

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    add_moe_dims_args(parser)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also profile each layer at the largest token count: time per kernel",
    )
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    # triton (bf16) runs on Hopper only; the CPU runs its references.
    triton_runs = not cuda or is_hopper(device)
    backends = args.backends or [
        b
        for b, (backend, _) in BACKENDS.items()
        if (backend != "humming" or humming_available())
        and (backend != "triton" or triton_runs)
    ]
    tokens = args.tokens or ([1, 64, 1024, 8192] if cuda else [1, 16])
    dims = (args.num_experts, args.topk, args.hidden_size, args.intermediate_size)
    if not cuda:
        dims = (16, 4, 128, 128)  # the reference loops at small sizes
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    reset_workspace_manager()
    init_workspace_manager(device)
    rows: list[Row] = []
    breakdowns: dict[str, list[tuple[str, float]]] = {}
    for label in tqdm(backends, desc="backends"):
        moe = FusedMoEConfig(
            num_experts=dims[0],
            experts_per_token=dims[1],
            hidden_size=dims[2],
            intermediate_size=dims[3],
            quant_config=FusedMoEQuantConfig(BACKENDS[label][1]),
        )
        rows.extend(
            bench(
                label,
                t,
                moe,
                device,
                breakdowns if args.breakdown and t == max(tokens) else None,
            )
            for t in tokens
        )
    reset_workspace_manager()

    name = torch.cuda.get_device_name() if cuda else "CPU (reference loops)"
    print(
        f"\ndevice: {name}; experts {dims[0]}, top-{dims[1]}, hidden {dims[2]}, "
        f"intermediate {dims[3]}"
    )
    head = (
        f"{'backend':>11} {'tokens':>6} | {'layer us':>9} {'TFLOP/s':>8} "
        f"{'of peak':>7} | "
        f"{'own GEMMs us':>12} {'outside them':>12} | {'torch GEMMs us':>14}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gemms, share = (
            ("-", "-")
            if r.gemm_us is None or r.outside_gemm_share is None
            else (f"{r.gemm_us:.1f}", f"{100 * r.outside_gemm_share:.0f}%")
        )
        torch_gemms = "-" if r.torch_gemm_us is None else f"{r.torch_gemm_us:.1f}"
        print(
            f"{r.backend:>11} {r.tokens:>6} | {r.layer_us:>9.1f} {r.tflops:>8.1f} "
            f"{100 * r.peak_fraction:>6.0f}% | {gemms:>12} {share:>12} | "
            f"{torch_gemms:>14}"
        )
    for layer, kernels in breakdowns.items():
        total = sum(us for _, us in kernels)
        gemm_us = sum(us for kernel, us in kernels if "gemm" in kernel.lower())
        print(
            f"\n{layer} tokens: {total:.1f} us of kernels per call, "
            f"{100 * (1 - gemm_us / total):.1f}% outside the GEMM kernels"
        )
        for kernel_name, us in kernels:
            print(f"  {us:>8.1f} us {100 * us / total:>4.0f}%  {kernel_name[:90]}")
    write_results(args.output_json, name, rows, kernel_breakdown=breakdowns)


if __name__ == "__main__":
    main()
