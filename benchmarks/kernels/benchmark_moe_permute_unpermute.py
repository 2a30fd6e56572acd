"""Benchmark moe_permute / moe_unpermute against the plain-PyTorch path.

On CUDA, each op is captured in a CUDA graph that runs it ``--iters`` times,
every iteration on its own fresh routing, and timed over graph replays.
Bandwidth counts unique bytes (each input read once, each output written
once) and is compared with a device-to-device copy measured in the same run.
Without CUDA the reference path runs at small sizes so the command still
works.

    python benchmarks/kernels/benchmark_moe_permute_unpermute.py \
        --model-config deepseek-v3 --batch-size 1 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.benchmarks.utils import (
    copy_bandwidth_gbps,
    time_cpu_us,
    time_graph_us,
    write_results,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    get_moe_permute_scratch,
    moe_permute,
    moe_unpermute,
)
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    init_workspace_manager,
    reset_workspace_manager,
)

PRESETS = {
    # name: (num_experts, topk, hidden_size)
    "mixtral-8x7b": (8, 2, 4096),
    "qwen3-30b-a3b": (128, 8, 2048),
    "qwen3.6-35b-a3b": (256, 8, 2048),
    "deepseek-v3": (256, 8, 7168),
}


@dataclass
class Row:
    tokens: int
    hidden: int
    experts: int
    topk: int
    dtype: str
    permute_us: float
    permute_gbps: float
    permute_copy_frac: float
    permute_speedup: float
    unpermute_us: float
    unpermute_gbps: float
    unpermute_copy_frac: float
    unpermute_speedup: float
    torch_permute_us: float
    torch_unpermute_us: float
    scratch_bytes: int


def load_model_config(name_or_path: str) -> tuple[int, int, int]:
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise SystemExit(
            f"--model-config: expected one of {sorted(PRESETS)} or the path of a "
            f"Hugging Face config.json, got {name_or_path!r}"
        )
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in cfg:
            return (
                int(cfg[key]),
                int(cfg["num_experts_per_tok"]),
                int(cfg["hidden_size"]),
            )
    raise SystemExit(f"--model-config: {path} names no expert count")


def routing(tokens: int, topk: int, experts: int, device: torch.device) -> torch.Tensor:
    scores = torch.rand(tokens, experts, device=device)
    return scores.topk(topk, dim=1).indices.to(torch.int32)


def torch_permute(hidden: torch.Tensor, ids: torch.Tensor, experts: int):
    """What a user would write: stable sort + index_select."""
    topk = ids.shape[1]
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat, stable=True)
    offsets = torch.searchsorted(
        sorted_ids, torch.arange(experts + 1, device=ids.device, dtype=flat.dtype)
    )
    return hidden.index_select(0, order // topk), offsets, order


def torch_unpermute(permuted, weights, inv):
    tokens, topk = weights.shape
    rows = permuted.index_select(0, inv).view(tokens, topk, -1).float()
    return (rows * weights.unsqueeze(-1)).sum(1).to(permuted.dtype)


def bench_one(
    tokens: int,
    experts: int,
    topk: int,
    hidden: int,
    fp8: bool,
    device: torch.device,
    copy_gbps: float,
) -> Row:
    cuda = device.type == "cuda"
    # >= 20 steps per graph so that the replay's own launch gap is amortized;
    # the routings are small, so this costs little memory.
    iters = max(20, min(100, (2**31) // max(tokens * hidden * 2, 1)))
    act_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    hidden_states = torch.randn(tokens, hidden, device=device).to(act_dtype)
    scale = torch.rand(tokens, 1, device=device) if fp8 else None
    ids = [routing(tokens, topk, experts, device) for _ in range(iters)]
    weights = torch.rand(tokens, topk, device=device)
    expert_out = torch.randn(tokens * topk, hidden, device=device, dtype=torch.bfloat16)
    out = torch.empty(tokens, hidden, device=device, dtype=torch.bfloat16)
    manager = current_workspace_manager()
    invs = []

    def permute_step(i: int) -> None:
        scratch = get_moe_permute_scratch(
            num_experts=experts, num_local_experts=experts, device=device
        )
        (buffer,) = manager.get_simultaneous(((tokens * topk, hidden), act_dtype))
        moe_permute(
            hidden_states,
            scale,
            ids[i],
            experts,
            scratch=scratch,
            permuted_hidden_states=buffer,
        )

    # The unpermute reads the inverse index of a real permute.
    _, _, offsets, inv, _ = moe_permute(hidden_states, scale, ids[0], experts)
    invs.append(inv)

    def unpermute_step(i: int) -> None:
        moe_unpermute(out, expert_out, weights, invs[0], offsets)

    inv_long = inv.long()

    def torch_permute_step(i: int) -> None:
        torch_permute(hidden_states, ids[i], experts)

    def torch_unpermute_step(i: int) -> None:
        torch_unpermute(expert_out, weights, inv_long)

    timer = (
        (lambda f: time_graph_us(f, iters)) if cuda else (lambda f: time_cpu_us(f, 3))
    )
    permute_us = timer(permute_step)
    unpermute_us = timer(unpermute_step)
    torch_permute_us = timer(torch_permute_step)
    torch_unpermute_us = timer(torch_unpermute_step)

    elem = hidden_states.element_size()
    rows = tokens * topk
    permute_bytes = tokens * hidden * elem + rows * hidden * elem + rows * 4 * 3
    unpermute_bytes = rows * hidden * 2 + tokens * hidden * 2 + rows * 8
    report = manager.memory_report()
    scratch_bytes = sum(r.nbytes for r in report.resources_of_type("MoEPermuteScratch"))

    def gbps(nbytes: int, us: float) -> float:
        return nbytes / (us * 1e-6) / 1e9

    return Row(
        tokens=tokens,
        hidden=hidden,
        experts=experts,
        topk=topk,
        dtype=str(act_dtype).removeprefix("torch."),
        permute_us=permute_us,
        permute_gbps=gbps(permute_bytes, permute_us),
        permute_copy_frac=gbps(permute_bytes, permute_us) / copy_gbps,
        permute_speedup=torch_permute_us / permute_us,
        unpermute_us=unpermute_us,
        unpermute_gbps=gbps(unpermute_bytes, unpermute_us),
        unpermute_copy_frac=gbps(unpermute_bytes, unpermute_us) / copy_gbps,
        unpermute_speedup=torch_unpermute_us / unpermute_us,
        torch_permute_us=torch_permute_us,
        torch_unpermute_us=torch_unpermute_us,
        scratch_bytes=scratch_bytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-config",
        default="deepseek-v3",
        help=f"one of {sorted(PRESETS)} or a config.json path",
    )
    parser.add_argument("--dtype", choices=["auto", "fp8_w8a8"], default="auto")
    parser.add_argument("--batch-size", type=int, nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts, topk, hidden = load_model_config(args.model_config)
    batch_sizes = args.batch_size or (
        [1, 128, 1024, 4096, 16384] if device.type == "cuda" else [1, 16, 64]
    )
    if device.type == "cpu":
        hidden = min(hidden, 256)  # the reference path at small sizes
    torch.manual_seed(args.seed)
    name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else "CPU (reference path)"
    )
    copy_gbps = copy_bandwidth_gbps(device)

    reset_workspace_manager()
    init_workspace_manager(device)
    rows = []
    for tokens in tqdm(batch_sizes, desc="batch sizes"):
        rows.append(
            bench_one(
                tokens,
                experts,
                topk,
                hidden,
                args.dtype == "fp8_w8a8",
                device,
                copy_gbps,
            )
        )

    print(
        f"\ndevice: {name}; model: {args.model_config} (experts={experts}, "
        f"topk={topk}, hidden={hidden}); copy bandwidth {copy_gbps:.0f} GB/s"
    )
    header = (
        f"{'T':>6} {'dtype':>13} | {'permute us':>10} {'GB/s':>7} {'copy%':>6} "
        f"{'x torch':>7} | {'unpermute us':>12} {'GB/s':>7} {'copy%':>6} "
        f"{'x torch':>7} | {'scratch KiB':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.tokens:>6} {r.dtype:>13} | "
            f"{r.permute_us:>10.1f} {r.permute_gbps:>7.0f} "
            f"{100 * r.permute_copy_frac:>5.0f}% {r.permute_speedup:>7.2f} | "
            f"{r.unpermute_us:>12.1f} {r.unpermute_gbps:>7.0f} "
            f"{100 * r.unpermute_copy_frac:>5.0f}% {r.unpermute_speedup:>7.2f} | "
            f"{r.scratch_bytes / 1024:>11.1f}"
        )
    write_results(
        args.output_json,
        name,
        rows,
        model_config=args.model_config,
        copy_gbps=copy_gbps,
    )
    reset_workspace_manager()


if __name__ == "__main__":
    main()
