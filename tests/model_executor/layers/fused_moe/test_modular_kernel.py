"""Experts backends through the modular kernel.

Every backend is compared with a dense float64 reference on its own
dequantized weights. CPU runs the reference loops at small sizes; CUDA runs
the GPU kernels at model sizes.
"""

import pytest
import torch

from tests.model_executor.layers.fused_moe.utils import (
    CUDA,
    SCHEMES,
    TOLERANCE,
    UNQUANTIZED,
    check_backend,
    dequantized,
    moe_config,
    random_weights,
    relative_error,
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
