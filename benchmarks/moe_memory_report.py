"""Persistent MoE scratch memory: shared per slot vs. owned per layer.

Builds L FusedMoE layers from a preset, warms them up at the given token
counts (largest first) under a workspace manager, locks it, and prints the
manager's accounting: permute scratch objects and bytes, lock buffers and
arena bytes. Beside it, the design before the change is measured with real
allocations: every layer owns a scratch sized from its config, with a
permuted-hidden-states buffer. Writes JSON and a PNG plot of persistent
scratch bytes against the number of layers for both designs.

Expert weights are shrunk (``--intermediate-size``): they do not change the
permute scratch, only the arena that holds the activation between GEMMs.

    python benchmarks/moe_memory_report.py --preset qwen3.6-35b-a3b --tokens 8192
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm.model_executor.kernels.moe_permute import sort_workspace_numel
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.layer import BACKENDS, FusedMoE
from vllm.v1.worker.workspace import (
    init_workspace_manager,
    reset_workspace_manager,
)
from vllm.v1.worker.workspace_report import tensor_storage_bytes

MiB = 2**20
SCHEMES = {
    "bf16": QuantScheme.UNQUANTIZED,
    "fp8_w8a8": QuantScheme.FP8_PER_TOKEN,
    "w4a16": QuantScheme.W4A16_UINT4,
    "w4a8": QuantScheme.W4A8_UINT4,
}

PRESETS = {
    # name: (layers, hidden, experts, topk)
    "small": (4, 256, 16, 4),
    "qwen3-30b-a3b": (48, 2048, 128, 8),
    "qwen3.6-35b-a3b": (40, 2048, 256, 8),
}


class PerLayerScratch:
    """The design before the change: one scratch per layer, sized from its
    config (max tokens x top-k rows), including permuted hidden states."""

    def __init__(self, moe: FusedMoEConfig, max_num_tokens: int, device) -> None:
        rows = max_num_tokens * moe.experts_per_token
        i32 = dict(dtype=torch.int32, device=device)
        self.inv_permuted_idx = torch.empty(rows, **i32)
        self.permuted_idx = torch.empty(rows, **i32)
        self.expert_first_token_offset = torch.empty(
            moe.num_local_experts + 1, dtype=torch.int64, device=device
        )
        self.sort_workspace = torch.empty(
            sort_workspace_numel(rows, moe.num_local_experts), **i32
        )
        self.permuted_hidden_states = torch.empty(
            rows, moe.hidden_size, dtype=moe.in_dtype, device=device
        )


@dataclass
class Report:
    device: str
    preset: str
    layers: int
    hidden_size: int
    num_experts: int
    topk: int
    intermediate_size: int
    backend: str
    tokens: list[int]
    shared_scratch_objects: int
    shared_scratch_bytes: int
    shared_lock_buffers: int
    shared_lock_bytes: int
    shared_arena_bytes: int
    shared_cuda_delta_bytes: int | None
    per_layer_scratch_objects: int
    per_layer_scratch_bytes: int
    per_layer_cuda_delta_bytes: int | None


def cuda_allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def build_layers(moe: FusedMoEConfig, n: int, backend: str, device) -> list[FusedMoE]:
    layers = []
    gen = torch.Generator(device=device).manual_seed(0)
    for i in range(n):
        layer = FusedMoE(
            moe, prefix=f"report.layers.{i}.mlp", backend=backend, device=device
        )
        e, i, h = moe.num_experts, moe.intermediate_size, moe.hidden_size
        layer.stacked_weight_loader(
            torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=moe.in_dtype)
            * 0.02,
            torch.randn(e, h, i, generator=gen, device=device, dtype=moe.in_dtype)
            * 0.02,
        )
        layer.process_weights_after_loading()
        layers.append(layer)
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument(
        "--intermediate-size", type=int, default=128, help="a multiple of 128"
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="w4a16 runs Humming on auto (GPU); marlin also runs on CPU",
    )
    parser.add_argument("--dtype", choices=sorted(SCHEMES), default="bf16")
    parser.add_argument("--output-json", type=Path, default=Path("out/moe_memory.json"))
    parser.add_argument("--plot", type=Path, default=Path("out/moe_memory.png"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers_n, hidden, experts, topk = PRESETS[args.preset]
    layers_n = args.num_layers or layers_n
    tokens = sorted(
        args.tokens or ([8192, 1024, 1] if device.type == "cuda" else [256, 16, 1]),
        reverse=True,
    )
    scheme = SCHEMES[args.dtype]
    moe = FusedMoEConfig(
        num_experts=experts,
        experts_per_token=topk,
        hidden_size=hidden,
        intermediate_size=args.intermediate_size,
        quant_config=FusedMoEQuantConfig(scheme),
    )
    torch.manual_seed(0)
    torch.set_grad_enabled(False)

    # Shared design: the manager owns one scratch per slot.
    reset_workspace_manager()
    manager = init_workspace_manager(device)
    layers = build_layers(moe, layers_n, args.backend, device)
    before = cuda_allocated(device)
    for t in tokens:  # largest first, as a runner warms up
        x = torch.randn(t, hidden, device=device, dtype=moe.in_dtype)
        logits = torch.randn(t, experts, device=device)
        for layer in layers:
            x = layer(x, logits)
    del x
    manager.lock()
    shared_delta = delta(before, cuda_allocated(device))
    report = manager.memory_report()
    scratches = report.resources_of_type("MoEPermuteScratch")
    locks = [r for r in report.slots[0].resources if r.kind == "tensor"]
    print(report.format())
    del layers
    reset_workspace_manager()

    # Per-layer design, with real allocations.
    before = cuda_allocated(device)
    owned = [PerLayerScratch(moe, max(tokens), device) for _ in range(layers_n)]
    per_layer_delta = delta(before, cuda_allocated(device))
    per_layer_bytes = sum(tensor_storage_bytes(s) for s in owned)
    del owned

    result = Report(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        preset=args.preset,
        layers=layers_n,
        hidden_size=hidden,
        num_experts=experts,
        topk=topk,
        intermediate_size=args.intermediate_size,
        backend=args.backend,
        tokens=tokens,
        shared_scratch_objects=len(scratches),
        shared_scratch_bytes=sum(r.nbytes for r in scratches),
        shared_lock_buffers=len(locks),
        shared_lock_bytes=sum(r.nbytes for r in locks),
        shared_arena_bytes=report.arena_bytes,
        shared_cuda_delta_bytes=shared_delta,
        per_layer_scratch_objects=layers_n,
        per_layer_scratch_bytes=per_layer_bytes,
        per_layer_cuda_delta_bytes=per_layer_delta,
    )
    print_table(result)
    for path in (args.output_json, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(asdict(result), indent=2))
    plot(result, args.plot)
    print(f"wrote {args.output_json} and {args.plot}")


def print_table(r: Report) -> None:
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / MiB:,.2f}"

    print(
        f"\n{r.preset}: {r.layers} MoE layers, hidden {r.hidden_size}, "
        f"{r.num_experts} experts, top-{r.topk}, warmed at {r.tokens} tokens on "
        f"{r.device}"
    )
    head = (
        f"{'design':<10} {'scratch objs':>12} {'scratch MiB':>12} {'lock bufs':>9} "
        f"{'lock KiB':>9} {'arena MiB':>10} {'cuda alloc MiB':>15}"
    )
    print(head)
    print("-" * len(head))
    print(
        f"{'per-layer':<10} {r.per_layer_scratch_objects:>12} "
        f"{mib(r.per_layer_scratch_bytes):>12} {'-':>9} {'-':>9} {'-':>10} "
        f"{mib(r.per_layer_cuda_delta_bytes):>15}"
    )
    print(
        f"{'shared':<10} {r.shared_scratch_objects:>12} "
        f"{mib(r.shared_scratch_bytes):>12} "
        f"{r.shared_lock_buffers:>9} {r.shared_lock_bytes / 1024:>9.1f} "
        f"{mib(r.shared_arena_bytes):>10} {mib(r.shared_cuda_delta_bytes):>15}"
    )


def plot(r: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(1, r.layers + 1))
    per_layer = [n * r.per_layer_scratch_bytes / r.layers / MiB for n in layers]
    shared = [r.shared_scratch_bytes / MiB] * len(layers)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(layers, per_layer, label="scratch owned per layer (before)")
    ax.plot(layers, shared, label="shared per-slot scratch (manager)")
    ax.set_yscale("log")
    ax.set_xlabel("MoE layers")
    ax.set_ylabel("persistent scratch (MiB)")
    ax.set_title(f"{r.preset}, {max(r.tokens)} tokens x top-{r.topk}, {r.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
