"""Experts backends through the modular kernel.

Every backend is compared with a dense float64 reference on its own
dequantized weights. CPU runs the reference loops at small sizes; CUDA runs
the GPU kernels at model sizes.
"""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    CUDA,
    HOPPER,
    RELOAD_SCHEMES,
    SCHEMES,
    TOLERANCE,
    UNQUANTIZED,
    check_backend,
    dequantized,
    moe_config,
    random_weights,
    relative_error,
)
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference
from vllm.model_executor.layers.fused_moe.experts import (
    fused_marlin_moe,
    triton_fp8_moe,
    triton_moe,
    triton_w4a8_moe,
)
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    GroupedMMExperts,
)
from vllm.model_executor.layers.fused_moe.layer import make_experts
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEModularKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.reference import fused_moe_reference
from vllm.model_executor.layers.fused_moe.routing import fused_topk


@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_backend_cpu(workspace_init, backend, tokens, topk, ep_size):
    if CUDA:
        pytest.skip("CPU path")
    torch.manual_seed(tokens * 10 + topk + ep_size)
    check_backend(backend, tokens, topk, ep_size, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 7, 64, 1024])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_backend_gpu(workspace_init, backend, tokens, topk, ep_size):
    torch.manual_seed(tokens * 10 + topk + ep_size)
    check_backend(backend, tokens, topk, ep_size, "cuda")


@pytest.mark.parametrize("backend", list(SCHEMES))
def test_swiglu_activation(workspace_init, device, backend):
    torch.manual_seed(0)
    moe = moe_config(
        device, scheme=SCHEMES[backend], activation="swiglu", experts_per_token=2
    )
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.randn(9, moe.hidden_size, device=device, dtype=moe.in_dtype) * 4
    topk_weights, topk_ids = fused_topk(
        hidden, torch.randn(9, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, topk_weights, topk_ids)
    dq13, dq2 = dequantized(experts, w13, w2)
    ref = fused_moe_reference(hidden, dq13, dq2, topk_weights, topk_ids, None, "swiglu")
    assert relative_error(out, ref) < TOLERANCE[backend]


@pytest.mark.parametrize("backend", list(SCHEMES))
@pytest.mark.parametrize("ep_size", [1, 4])
def test_zero_tokens(workspace_init, device, backend, ep_size):
    moe = moe_config(device, ep_size, SCHEMES[backend], experts_per_token=2)
    w13, w2 = random_weights(moe, device)
    experts = make_experts(moe, w13, w2, backend)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), experts)
    hidden = torch.empty(0, moe.hidden_size, device=device, dtype=moe.in_dtype)
    topk_weights, topk_ids = fused_topk(
        hidden, torch.empty(0, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, topk_weights, topk_ids, moe.make_expert_map(device))
    assert out.shape == (0, moe.hidden_size) and out.dtype == moe.in_dtype


@pytest.mark.parametrize("backend", UNQUANTIZED)
def test_strided_hidden_states(workspace_init, device, backend):
    """A column slice of a wider tensor (as a fused QKV-style split leaves
    it) gives what its contiguous copy gives."""
    torch.manual_seed(11)
    moe = moe_config(device, experts_per_token=2)
    w13, w2 = random_weights(moe, device)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), make_experts(moe, w13, w2, backend)
    )
    wide = torch.randn(9, moe.hidden_size + 8, device=device, dtype=moe.in_dtype)
    hidden = wide[:, 8:]
    assert not hidden.is_contiguous()
    weights, ids = fused_topk(
        hidden, torch.randn(9, moe.num_experts, device=device), 2, True
    )
    out = kernel.forward(hidden, weights, ids)
    torch.testing.assert_close(out, kernel.forward(hidden.contiguous(), weights, ids))


def test_bad_inputs_are_named(workspace_init, device):
    moe = moe_config(device, experts_per_token=2)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), GroupedMMExperts(moe, *random_weights(moe, device))
    )
    x = torch.randn(3, moe.hidden_size, device=device, dtype=moe.in_dtype)
    w, ids = fused_topk(x, torch.randn(3, moe.num_experts, device=device), 2, True)
    for args, name in (
        ((x.float(), w, ids), "hidden_states"),
        ((x[:, :-8], w, ids), "hidden_states"),
        ((x, w, ids[:, :1]), "topk_ids"),
        ((x, w, ids.float()), "topk_ids"),
        ((x, w.double(), ids), "topk_weights"),
        ((x, w[:2], ids), "topk_weights"),
    ):
        with pytest.raises(ValueError, match=name):
            kernel.forward(*args)


# Experts whose decode kernels route from logits (uint4 ones in either packing).
ROUTED = [
    *(["triton", "triton_fp8"] if HOPPER else ["triton"] if not CUDA else []),
    "marlin",
    "triton_w4a8",
]


@pytest.mark.parametrize("backend", ROUTED)
@pytest.mark.parametrize("tokens", [1, None])  # None: the decode path's most
@pytest.mark.parametrize("ep_size", [1, 4])
def test_routed_forward_is_the_forward_of_its_routing(
    workspace_init, device, monkeypatch, backend, tokens, ep_size
):
    """``forward_routed``: the decode kernels routing from the logits give
    ``forward`` of the logits' routing (softmax top-k, ties to the lower
    id), local experts only under an expert map; on the CPU through the
    interpreter."""
    for module in (triton_moe, triton_fp8_moe, fused_marlin_moe, triton_w4a8_moe):
        monkeypatch.setattr(module, "runs_gpu_kernels", lambda t: True)
    torch.manual_seed(ep_size)
    # uint4 scales come in groups of 128 along both GEMMs' K
    moe = moe_config(
        device, ep_size, RELOAD_SCHEMES[backend], experts_per_token=4,
        **({"intermediate_size": 128} if device.type == "cpu" else {}),
    )  # fmt: skip
    w13, w2 = random_weights(moe, device)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), make_experts(moe, w13, w2, backend)
    )
    decode_max = type(kernel.experts).decode_max_tokens  # type: ignore[attr-defined]
    tokens = tokens or decode_max
    hidden = torch.randn(tokens, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(tokens, moe.num_experts, device=device).to(moe.in_dtype)
    expert_map = moe.make_expert_map(device)
    assert kernel.routes_from_logits(hidden)
    assert not kernel.routes_from_logits(
        hidden.new_zeros(decode_max + 1, hidden.shape[1])
    )
    renormalize = ep_size == 1  # each way once (the interpreter is slow)
    out = kernel.forward_routed(hidden, logits, renormalize, expert_map)
    weights, ids = top_routes_reference(logits, 4, renormalize)
    expected = kernel.forward(hidden, weights, ids, expert_map)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    assert not bool(out.isnan().any())


def test_routed_forward_refusals_are_named(workspace_init, device, monkeypatch):
    monkeypatch.setattr(triton_moe, "runs_gpu_kernels", lambda t: t.numel() > 0)
    moe = moe_config(device, experts_per_token=2)
    w13, w2 = random_weights(moe, device)
    kernel = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), make_experts(moe, w13, w2, "triton")
    )
    x = torch.randn(3, moe.hidden_size, device=device, dtype=moe.in_dtype)
    logits = torch.randn(3, moe.num_experts, device=device).to(moe.in_dtype)
    for args, name in (
        ((x, logits.float()), "router_logits"),
        ((x, logits[:, :-1]), "router_logits"),
        ((x, logits[:2]), "router_logits"),
        ((x.float(), logits), "hidden_states"),
        ((x[:, :-8], logits), "hidden_states"),
    ):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            kernel.forward_routed(*args, True)
    many = torch.randn(9, moe.hidden_size, device=device, dtype=moe.in_dtype)
    grouped = FusedMoEModularKernel(
        MoEPrepareAndFinalizeNoEP(), GroupedMMExperts(moe, w13, w2)
    )
    for refused, tokens in ((kernel, many), (grouped, x)):
        assert not refused.routes_from_logits(tokens)
        with pytest.raises(ValueError, match=r"^hidden_states: .* call forward\(\)"):
            refused.forward_routed(tokens, logits, True)
