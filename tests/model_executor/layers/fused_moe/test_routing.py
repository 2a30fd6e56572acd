"""Top-k routing."""

import pytest
import torch

from vllm.model_executor.layers.fused_moe.routing import fused_topk


def test_fused_topk(device):
    torch.manual_seed(1)
    logits = torch.randn(5, 16, device=device)
    weights, ids = fused_topk(torch.empty(5, 8, device=device), logits, 3, True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, device=device))
    probs = logits.softmax(-1)
    assert torch.equal(ids.long(), probs.topk(3).indices)
    raw, _ = fused_topk(torch.empty(5, 8, device=device), logits, 3, False)
    # rtol: the CUDA kernel's exp is the fast approximate one
    torch.testing.assert_close(raw, probs.topk(3).values, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="topk"):
        fused_topk(torch.empty(5, 8, device=device), logits, 17, True)
