"""The fused router (GEMM, softmax, top-k in one launch) against fp32
PyTorch: the token routed, several K steps and partial ones, the counter
left zero for the next launch, edge sizes and named errors; the same
launch with the norm prologue, routing or leaving the logits out."""

import pytest
import torch

from vllm.model_executor.kernels.common.rms_norm import rms_norm
from vllm.model_executor.kernels.common.router_topk import (
    rms_norm_router_logits,
    rms_norm_router_topk,
    router_topk,
    router_topk_reference,
)
from vllm.model_executor.kernels.common.skinny_gemm import skinny_gemm_reference
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference


@pytest.mark.parametrize(
    ("experts", "hidden", "topk"),
    [(128, 2048, 8), (60, 1100, 4), (20, 96, 1), (5, 64, 5)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_the_reference(device, experts, hidden, topk, renormalize):
    """Inputs whose logits are exact in any summation order and in bf16
    (multiples of 1/32 below 8): the kernel and the reference see the same
    logits, ties included (the kernel takes the lower expert id; torch's
    top-k any), so they must pick experts of the same probabilities."""
    g = torch.Generator().manual_seed(experts + topk)
    x = torch.randint(-1, 2, (1, hidden), generator=g).to(device, torch.bfloat16)
    gate = torch.randint(-1, 2, (experts, hidden), generator=g) / 32
    gate = gate.to(device, torch.bfloat16)
    probs = torch.softmax(x.float() @ gate.float().T, -1)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):  # the second launch reuses the counter the first reset
        weights, ids = router_topk(x, gate, topk, renormalize, counter)
        ref_weights, ref_ids = router_topk_reference(x, gate, topk, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        torch.testing.assert_close(
            probs.gather(1, ids.long()), probs.gather(1, ref_ids.long())
        )
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
        assert (ids >= 0).all() and (ids < experts).all()
        assert all(len(set(row)) == topk for row in ids.tolist())
        assert counter.item() == 0


def test_no_tokens_and_bad_arguments(device):
    x = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    gate = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    weights, ids = router_topk(x[:0], gate, 4, True, counter)
    assert weights.shape == ids.shape == (0, 4)
    bad = [
        ((torch.randn(2, 64, device=device).bfloat16(), gate, 4, counter), "x"),
        ((torch.randn(3, 64, device=device).bfloat16(), gate, 4, counter), "x"),
        ((x, gate[:, :32], 4, counter), "gate_weight"),
        ((x, gate.float(), 4, counter), "gate_weight"),
        ((x, gate, 17, counter), "topk"),
        ((x, gate, 4, counter.long()), "counter"),
        ((x, gate, 4, counter[:0]), "counter"),
    ]
    for (a, g, k, c), name in bad:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            router_topk(a, g, k, True, c)
    with pytest.raises(ValueError, match=r"^x: expected at most one row, got 3"):
        router_topk(
            torch.randn(3, 64, device=device).bfloat16(), gate, 4, True, counter
        )
    assert counter.item() == 0


@pytest.mark.parametrize(
    ("experts", "hidden", "topk"), [(128, 2048, 8), (20, 96, 3), (30, 2100, 4)]
)
def test_norm_prologue_routes_the_normalized_row(device, experts, hidden, topk):
    """``rms_norm_router_topk`` against ``rms_norm`` then ``router_topk``:
    the sum exactly (one K step, less, and two, the second partial), the
    normalized row (written by program 0, for the experts) within a bf16
    step of the norm's kernel (another fp32 sum order), and the same
    routing where that row is the same; the residual left as it was and the
    counter zero."""
    torch.manual_seed(experts + hidden)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16) * 2
    residual = torch.randn_like(x)
    before = residual.clone()
    norm_weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
    gate = (torch.randn(experts, hidden, device=device) / hidden**0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    weights, ids, normed, total = rms_norm_router_topk(
        x, residual, norm_weight, 1e-6, gate, topk, True, counter
    )
    ref_normed, ref_total = rms_norm(x, norm_weight, 1e-6, residual)
    assert ref_total is not None and torch.equal(total, ref_total)
    assert torch.equal(residual, before) and counter.item() == 0
    torch.testing.assert_close(normed, ref_normed, atol=1e-6, rtol=2**-7)
    ref_weights, ref_ids = router_topk(normed, gate, topk, True, counter)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    probs = torch.softmax(normed.float() @ gate.float().T, -1)
    top = probs.topk(topk).values
    torch.testing.assert_close(probs.gather(1, ids.long()), top, atol=2e-3, rtol=0)


@pytest.mark.parametrize(("experts", "hidden"), [(128, 2048), (20, 96), (30, 2100)])
def test_norm_prologue_logits_alone(device, experts, hidden):
    """``rms_norm_router_logits``: the launch of ``rms_norm_router_topk``
    without its routing writes the same normalized row and sum, and the
    logits of that row in its dtype (rounded as the routing's), from which
    the token routes as ``rms_norm_router_topk`` routed it."""
    torch.manual_seed(experts * hidden)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16) * 2
    residual = torch.randn_like(x)
    before = residual.clone()
    norm_weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
    gate = (torch.randn(experts, hidden, device=device) / hidden**0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    logits, normed, total = rms_norm_router_logits(x, residual, norm_weight, 1e-6, gate)
    weights, ids, routed_normed, routed_total = rms_norm_router_topk(
        x, residual, norm_weight, 1e-6, gate, 4, True, counter
    )
    assert torch.equal(normed, routed_normed) and torch.equal(total, routed_total)
    assert torch.equal(residual, before)
    assert logits.dtype == x.dtype and logits.shape == (1, experts)
    ref = skinny_gemm_reference(normed, gate)
    torch.testing.assert_close(logits, ref, atol=1e-2, rtol=2**-7)
    ref_weights, ref_ids = top_routes_reference(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_norm_prologue_bad_arguments_are_named(device):
    x = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    gate = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    nw = torch.ones(64, device=device, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    bad = [
        ((x, x[:, :32], nw, gate), "residual"),
        ((x, x.half(), nw, gate), "residual"),
        ((x, x, nw[:32], gate), "norm_weight"),
        ((x, x, nw, gate[:, :32]), "gate_weight"),
    ]
    for (a, r, w, g), name in bad:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            rms_norm_router_topk(a, r, w, 1e-6, g, 4, True, counter)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            rms_norm_router_logits(a, r, w, 1e-6, g)
    logits, normed, total = rms_norm_router_logits(x[:0], x[:0], nw, 1e-6, gate)
    assert logits.shape == (0, 16) and normed.shape == total.shape == (0, 64)
    weights, ids, normed, total = rms_norm_router_topk(
        x[:0], x[:0], nw, 1e-6, gate, 4, True, counter
    )
    assert weights.shape == ids.shape == (0, 4)
    assert normed.shape == total.shape == (0, 64)
    assert counter.item() == 0
