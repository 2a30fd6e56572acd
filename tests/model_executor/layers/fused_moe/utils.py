"""Shared helpers of the fused-MoE tests: layer configs, random weights, a
dense float64 reference, and layers built and loaded for a test."""

from typing import Any

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, make_experts
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.model_executor.layers.fused_moe.routing import fused_topk

CUDA = torch.cuda.is_available()


HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)


SCHEMES = {
    "grouped_mm": QuantScheme.UNQUANTIZED,
    # bf16 on our kernels: Hopper's, or their references on the CPU.
    **({"triton": QuantScheme.UNQUANTIZED} if HOPPER or not CUDA else {}),
    "cutlass": QuantScheme.FP8_PER_TOKEN,
    "triton_fp8": QuantScheme.FP8_PER_TOKEN,
}


TOLERANCE = {
    "grouped_mm": 2e-2,
    "triton": 2e-2,
    "cutlass": 0.1,
    "triton_fp8": 0.1,
    # against its dequantized weights: the fp8 activations' error
    "triton_w4a8": 0.1,
}


def moe_config(
    device, ep_size=1, scheme=QuantScheme.UNQUANTIZED, **kw
) -> FusedMoEConfig:
    dims: dict[str, Any] = (
        {"num_experts": 32, "hidden_size": 2048, "intermediate_size": 768}
        if torch.device(device).type == "cuda"
        else {"num_experts": 16, "hidden_size": 128, "intermediate_size": 64}
    )
    dims.update(kw)
    return FusedMoEConfig(
        experts_per_token=dims.pop("experts_per_token", 8),
        ep_size=ep_size,
        ep_rank=ep_size // 2,
        quant_config=FusedMoEQuantConfig(scheme),
        **dims,
    )


def random_weights(moe: FusedMoEConfig, device):
    el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
    w13 = (torch.randn(el, 2 * i, k, device=device) / k**0.5).to(moe.in_dtype)
    w2 = (torch.randn(el, k, i, device=device) / i**0.5).to(moe.in_dtype)
    return w13, w2


def dequantized(experts, w13, w2):
    if isinstance(experts, GroupedMMExperts):
        return w13, w2
    return experts.dequantized_weights()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_backend(backend, tokens, topk, ep_size, device, **dims):
    scheme = RELOAD_SCHEMES[backend]
    moe = moe_config(device, ep_size, scheme, experts_per_token=topk, **dims)
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(tokens, moe.num_experts, device=device)
    topk_weights, topk_ids = fused_topk(hidden, logits, topk, renormalize=True)
    expert_map = moe.make_expert_map(device)
    out = kernel.forward(hidden, topk_weights, topk_ids, expert_map)
    dq13, dq2 = dequantized(experts, w13, w2)
    ref = fused_moe_reference(hidden, dq13, dq2, topk_weights, topk_ids, expert_map)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert not bool(out.isnan().any())
    if ep_size > 1 and bool((ref == 0).all()):
        assert bool((out == 0).all())  # no local route at all
        return
    assert relative_error(out, ref) < TOLERANCE[backend]


UNQUANTIZED = [b for b, scheme in SCHEMES.items() if scheme == QuantScheme.UNQUANTIZED]


layer_ids = iter(range(10**9))


def make_layer(moe: FusedMoEConfig, device, backend="auto", seed=0) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(
        moe,
        prefix=f"test.layers.{next(layer_ids)}.mlp",
        backend=backend,
        device=device,
    )
    load_random_weights(layer, seed)
    layer.process_weights_after_loading()
    return layer


def load_random_weights(layer: FusedMoE, seed: int) -> None:
    moe = layer.moe
    gen = torch.Generator().manual_seed(seed)
    k, i = moe.hidden_size, moe.intermediate_size
    for e in range(moe.num_experts):
        for shard, shape, fan_in in (
            ("w1", (i, k), k),
            ("w3", (i, k), k),
            ("w2", (k, i), i),
        ):
            w = torch.randn(shape, generator=gen) / fan_in**0.5
            layer.weight_loader(w.to(layer.device), shard, e)


# Backends needing 128-multiples (weight groups) besides SCHEMES'.
RELOAD_SCHEMES = {
    **SCHEMES,
    "marlin": QuantScheme.W4A16_UINT4,
    "triton_w4a8": QuantScheme.W4A8_UINT4,
}
