"""The fused router (GEMM, softmax, top-k in one launch) against fp32
PyTorch: every token routed, several K steps and partial ones, the counter
left zero for the next launch, edge sizes and named errors."""

import pytest
import torch

from vllm.model_executor.kernels.common.router_topk import (
    router_topk,
    router_topk_reference,
)


@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "topk"),
    [(1, 128, 2048, 8), (2, 60, 1100, 4), (1, 20, 96, 1), (2, 5, 64, 5)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_the_reference(device, tokens, experts, hidden, topk, renormalize):
    torch.manual_seed(tokens * experts + topk)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    gate = torch.randn(experts, hidden, device=device, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):  # the second launch reuses the counter the first reset
        weights, ids = router_topk(x, gate, topk, renormalize, counter)
        ref_weights, ref_ids = router_topk_reference(x, gate, topk, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids, ref_ids)  # random logits: no near-ties
        torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-4)
        assert counter.item() == 0


def test_no_tokens_and_bad_arguments(device):
    x = torch.randn(2, 64, device=device, dtype=torch.bfloat16)
    gate = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    weights, ids = router_topk(x[:0], gate, 4, True, counter)
    assert weights.shape == ids.shape == (0, 4)
    bad = [
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
    assert counter.item() == 0
