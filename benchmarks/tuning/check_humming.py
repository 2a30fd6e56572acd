"""Check HummingGroupedExperts on a CUDA device: accuracy, kernel configs, timing.

Run from the repository root with humming-kernels installed::

    HUMMING_DISABLE_PARALLEL_BUILD=1 PYTHONUNBUFFERED=1 PYTHONPATH=. \\
        python benchmarks/tuning/check_humming.py [--api] [--bench]

For each scheme: build time (quantize + repack), the kernel table of both
GEMMs, the first-call time of each case (JIT compile when the config is new),
the relative error against the float64 reference on the dequantized weights,
and with ``--bench`` the steady-state time per forward.
"""

import argparse
import inspect
import json
import time
import traceback

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (
    HummingGroupedExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.v1.worker.workspace import init_workspace_manager

SCHEMES = [
    QuantScheme.W4A16_UINT4,
    QuantScheme.W4A16_MXFP4,
    QuantScheme.FP8_PER_TOKEN,
    QuantScheme.FP8_BLOCK,
]


def print_api() -> None:
    import humming
    from humming.forward import humming_forward, may_process_input
    from humming.tune import get_heuristics_config

    print(f"humming {humming.__version__}, torch {torch.__version__}")
    for fn in (humming_forward, may_process_input, get_heuristics_config):
        print(f"{fn.__module__}.{fn.__name__}{inspect.signature(fn)}")


def describe_table(table: str) -> str:
    parts = []
    for lower, upper, cfg in json.loads(table):
        keys = ("block_shape", "mma_type", "num_ctas_per_sm", "use_stream_k")
        parts.append(f"({lower},{upper}]: " + " ".join(str(cfg.get(k)) for k in keys))
    return "; ".join(parts)


def check_scheme(
    scheme: QuantScheme,
    cases: list[tuple[int, int]],
    ep: bool,
    bench: bool,
    dims: tuple[int, int, int],
) -> None:
    num_experts, hidden, inter = dims
    moe = FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=8,
        hidden_size=hidden,
        intermediate_size=inter,
        ep_size=4 if ep else 1,
        ep_rank=1 if ep else 0,
        quant_config=FusedMoEQuantConfig(scheme),
    )
    gen = torch.Generator().manual_seed(0)
    el = moe.num_local_experts
    w13 = (torch.randn(el, 2 * inter, hidden, generator=gen) / hidden**0.5).cuda()
    w2 = (torch.randn(el, hidden, inter, generator=gen) / inter**0.5).cuda()
    start = time.perf_counter()
    experts = HummingGroupedExperts.from_unquantized(moe, w13.bfloat16(), w2.bfloat16())
    torch.cuda.synchronize()
    print(f"[{scheme.value} ep={ep}] build {time.perf_counter() - start:.2f}s")
    print(f"  gemm1 {describe_table(experts.gemm1.tuning)}")
    print(f"  gemm2 {describe_table(experts.gemm2.tuning)}")
    dw13, dw2 = (w.cpu().double() for w in experts.dequantized_weights())
    ow13, ow2 = (w.cpu().bfloat16().double() for w in (w13, w2))
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    expert_map = moe.make_expert_map("cuda")
    cpu_map = None if expert_map is None else expert_map.cpu()
    for num_tokens, topk in cases:
        x = torch.randn(num_tokens, hidden, generator=gen).cuda().bfloat16()
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :topk]
        ids = ids.cuda().int()
        weights = torch.randn(num_tokens, topk, generator=gen).softmax(-1).cuda()
        start = time.perf_counter()
        out = kernel.forward(x, weights, ids, expert_map)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ref = fused_moe_reference(x, dw13, dw2, weights, ids, cpu_map)
        ref_orig = fused_moe_reference(x, ow13, ow2, weights, ids, cpu_map)
        out64 = out.cpu().double()
        denom = max(float(ref.norm()), 1e-30)
        err = float((out64 - ref).norm()) / denom
        err_orig = float((out64 - ref_orig).norm()) / max(float(ref_orig.norm()), 1e-30)
        line = (
            f"  T={num_tokens:5d} topk={topk}: first call {first:6.2f}s, "
            f"rel err {err:.4f} (vs bf16 weights {err_orig:.4f})"
        )
        if bench:
            for _ in range(3):
                kernel.forward(x, weights, ids, expert_map)
            torch.cuda.synchronize()
            reps = 20
            start = time.perf_counter()
            for _ in range(reps):
                kernel.forward(x, weights, ids, expert_map)
            torch.cuda.synchronize()
            line += f", {(time.perf_counter() - start) / reps * 1e6:8.1f} us/forward"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--api", action="store_true", help="print humming's API")
    parser.add_argument("--bench", action="store_true", help="time each case")
    parser.add_argument("--ep", action="store_true", help="ep_size=4, ep_rank=1")
    parser.add_argument(
        "--schemes", nargs="*", default=[s.value for s in SCHEMES], help="schemes"
    )
    parser.add_argument(
        "--cases", default="1x1,7x2,64x8,1024x8", help="TOKENSxTOPK,... to run"
    )
    parser.add_argument("--dims", default="32,2048,768", help="experts,hidden,inter")
    args = parser.parse_args()
    if args.api:
        print_api()
    init_workspace_manager("cuda")
    cases = []
    for case in args.cases.split(","):
        tokens, topk = case.split("x")
        cases.append((int(tokens), int(topk)))
    e, h, i = (int(v) for v in args.dims.split(","))
    for name in args.schemes:
        try:
            check_scheme(QuantScheme(name), cases, args.ep, args.bench, (e, h, i))
        except Exception:
            print(f"[{name}] FAILED")
            traceback.print_exc()


if __name__ == "__main__":
    main()
