"""Top-k routing."""

import pytest
import torch

from vllm.model_executor.layers.fused_moe.routing import fused_topk, gated_topk


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


@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("experts", [128, 1536])
def test_gated_topk_routes_as_its_logits(workspace_init, device, tokens, experts):
    """The router's GEMM inside the routing (on a GPU: ``router_topk`` at one
    token up to 1024 experts, ``skinny_gemm`` at two or past them, cuBLAS
    above) picks experts as likely as the routing of the logits does, with
    the same weights. Logits exact in any sum order and in bf16 (multiples
    of 1/32 below 8); ties may pick either expert, so probabilities are
    compared, not ids."""
    g = torch.Generator().manual_seed(tokens + experts)
    x = torch.randint(-1, 2, (tokens, 256), generator=g).to(device, torch.bfloat16)
    gate = (torch.randint(-1, 2, (experts, 256), generator=g) / 32).to(device)
    gate = gate.bfloat16()
    logits = (x.float() @ gate.float().T).bfloat16()
    probs = logits.float().softmax(-1)
    weights, ids = gated_topk(x, gate, 8, True)
    ref_weights, ref_ids = fused_topk(x, logits, 8, True)
    assert ids.dtype == torch.int32 and ids.shape == (tokens, 8)
    assert all(len(set(row)) == 8 for row in ids.tolist())
    torch.testing.assert_close(
        probs.gather(1, ids.long()), probs.gather(1, ref_ids.long())
    )
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
