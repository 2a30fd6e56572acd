"""The most each decode-step fusion left could save, measured in the engine.

At batch 1 a Qwen3-30B-A3B decode step chains ~10 kernels per layer by
programmatic dependent launch, so a kernel's cost in the step is not its
duration in a profile (``profile_decode.py``): it partly overlaps its
predecessor. Fusing a kernel into its neighbour saves at most what the
step loses without it. Each variant patches the model before the engine
builds it (graphs included) and times TPOT as ``benchmark_latency.py`` does:

- ``baseline``: the model as it ships.
- ``routing by ids``: the router's kernel routes (top-k in its last
  program) and hands ids to the experts, as before the decode kernels
  routed from the logits themselves: against ``baseline``, what that saved.
- ``q/k norm + RoPE apart``: the per-head norm, rotation and KV-cache
  store in their own kernel before attention, as before the attention
  kernel took them in decode steps: against ``baseline``, what that saved.
- ``routing free``: the decode kernels on a constant routing (experts
  0..7), the router's GEMM (with its norm prologue) still run: against
  ``baseline``, what the routing still costs inside the decode kernels.
- ``... no split combine``: attention's split-KV partials never merged.
- ``... one kernel more``: a trivial kernel launched with PDL after
  attention: what a launch costs in the chain.
- ``uint4 on tensor cores`` (``--quantization w4a16`` or ``w4a8``):
  ``marlin_gemm`` at 1-16 rows (W4A16's dense layers) and the uint4
  experts' decode kernels (routing from the logits, as shipped) on the
  tensor-core kernels (``gemv_mma``, ``moe_decode_mma``): against
  ``baseline``, what they would save.

The last two keep the constant routing as their reference: their own
numbers go wrong (without the combine attention returns uninitialized
memory), and their routing would then differ from the baseline's. Each
variant runs in its own process (one 30B model on the GPU at a time); a
failed one prints its error and the others still run. ``--variants`` runs
a subset (the device's 10-minute limit: one dtype per command).

    PYTHONPATH=. python benchmarks/tuning/probe_decode_fusions.py [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.benchmark_latency import measure_latency
from vllm import LLM
from vllm.benchmarks.presets import write_preset_config
from vllm.model_executor.kernels.common.rms_norm import rms_norm
from vllm.model_executor.kernels.common.topk_softmax import DecodeRouting
from vllm.model_executor.kernels.grouped_gemm import decode
from vllm.model_executor.kernels.marlin import moe_decode
from vllm.model_executor.kernels.marlin.gemv_mma import (
    MMA_GEMV_MAX_M,
    default_mma_gemv_config,
)
from vllm.model_executor.kernels.marlin.mma_rows import rows_aligned
from vllm.model_executor.kernels.marlin.moe_decode_mma import (
    default_mma_moe_decode_config,
)
from vllm.model_executor.layers import attention
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.experts import (
    fused_marlin_moe,
    triton_w4a8_moe,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm.model_executor.layers.quantization.utils import marlin_utils
from vllm.v1.attention.backends import split_kv

PRESET, LAYERS, TOPK = "qwen3-30b-a3b", 48, 8


def _routing_by_ids() -> None:
    FusedMoEModularKernel.routes_from_logits = (  # type: ignore[method-assign]
        lambda self, hidden_states: False
    )


def _routing_free() -> None:
    weights = torch.full((8, TOPK), 1 / TOPK, device="cuda")
    ids = torch.arange(TOPK, dtype=torch.int32, device="cuda").expand(8, -1)

    def constant(real):
        def launch(x, topk, routing, *args):
            if routing.routed:  # the logits: route to experts 0..7 instead
                rows = x.shape[0]
                routing = DecodeRouting.by_ids(ids[:rows], weights[:rows])
            return real(x, topk, routing, *args)

        return launch

    # Both decode kernels' launchers (16-bit and fp8 weights; uint4 ones).
    decode._launch = constant(decode._launch)
    moe_decode._launch = constant(moe_decode._launch)


def _uint4_on_tensor_cores() -> None:
    real_gemm = marlin_utils.marlin_gemm

    def gemm(a: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if a.shape[0] <= MMA_GEMV_MAX_M and rows_aligned(a):
            m, n = a.shape[0], kwargs["size_n"]
            kwargs["config"] = default_mma_gemv_config(n, m)
        return real_gemm(a, *args, **kwargs)

    marlin_utils.marlin_gemm = gemm  # type: ignore[assignment]
    mma = default_mma_moe_decode_config()
    for experts in (fused_marlin_moe, triton_w4a8_moe):
        for name in ("marlin_moe_decode", "marlin_moe_decode_routed"):
            real: Any = getattr(experts, name)
            setattr(experts, name, lambda *args, real=real: real(*args, mma))


def _qk_norm_rope_apart() -> None:
    Attention.fuses_norm_rope = staticmethod(lambda meta: False)  # type: ignore[method-assign]


def _no_split_combine() -> None:
    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    split_kv._combine_splits_kernel = NoLaunch()


def _one_kernel_more() -> None:
    real = attention.triton_paged_attention

    def with_extra(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        rms_norm(out, out[0], 1e-6)  # a norm of the output, unused
        return out

    attention.triton_paged_attention = with_extra  # type: ignore[assignment]


VARIANTS: dict[str, tuple[Callable[[], None], ...]] = {
    "baseline": (),
    "routing by ids": (_routing_by_ids,),
    "q/k norm + RoPE apart": (_qk_norm_rope_apart,),
    "routing free": (_routing_free,),
    "routing free, no split combine": (_routing_free, _no_split_combine),
    "routing free, one kernel more": (_routing_free, _one_kernel_more),
    "uint4 on tensor cores": (_uint4_on_tensor_cores,),
}


def run_variant(name: str, args: argparse.Namespace) -> float:
    """TPOT in ms of the model patched as ``name`` says (in this process)."""
    for patch in VARIANTS[name]:
        patch()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            write_preset_config(PRESET, Path(tmp)),
            load_format="dummy",
            quantization=args.quantization,
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=1,
            max_num_batched_tokens=max(args.input_len, 256),
        )
    _, tpot = measure_latency(llm, 1, args.input_len, args.output_len, 3, 0.0)
    return tpot * 1e3


def run_child(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """``{"tpot": ms, "device": name}`` of one variant in a new process, or
    None (its error printed)."""
    child = [sys.executable, __file__, "--variant", name]
    child += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    if args.quantization:
        child += ["--quantization", args.quantization]
    out = subprocess.run(child, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"{name}: failed (exit {out.returncode})\n{out.stderr[-4000:]}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=["fp8", "w4a16", "w4a8"])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)
    )
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child: one variant, its result on the last line
        ms = run_variant(args.variant, args)
        device = torch.cuda.get_device_name()
        print(json.dumps({"tpot": ms, "device": device}), flush=True)
        os._exit(0)  # the result is out: a fault tearing down graphs can't lose it
    print(
        f"{PRESET}, {args.quantization or 'bf16'}, batch 1, {args.input_len} in / "
        f"{args.output_len} out (the parent holds no CUDA context)"
    )
    print(f"{'variant':<34} {'TPOT ms':>8} {'vs ref us/step':>14} {'us/layer':>8}")
    tpot: dict[str, float] = {}
    for name in args.variants:
        result = run_child(name, args)
        if result is None:
            continue
        tpot[name] = result["tpot"]
        ref = "routing free" if name.startswith("routing free,") else "baseline"
        delta = (tpot[name] - tpot[ref]) * 1e3 if ref in tpot else float("nan")
        print(
            f"{name:<34} {tpot[name]:8.3f} {delta:14.1f} {delta / LAYERS:8.2f}"
            f"  ({result['device']})",
            flush=True,
        )


if __name__ == "__main__":
    main()
