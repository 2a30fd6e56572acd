"""The fused routing kernel against softmax + ``torch.topk``."""

import pytest
import torch

from vllm.model_executor.kernels.common.topk_softmax import topk_softmax


def _reference(logits, topk, renormalize):
    weights, ids = torch.softmax(logits.float(), -1).topk(topk, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


@pytest.mark.parametrize(
    ("tokens", "experts", "topk"),
    [(1, 128, 8), (2, 512, 8), (9, 60, 4), (3, 16, 1), (2, 5, 5)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_softmax_topk(device, tokens, experts, topk, renormalize):
    torch.manual_seed(tokens * experts + topk)
    logits = torch.randn(tokens, experts, device=device, dtype=torch.bfloat16) * 4
    logits = logits.float().to(torch.bfloat16)
    weights, ids = topk_softmax(logits, topk, renormalize)
    ref_weights, ref_ids = _reference(logits, topk, renormalize)
    # ids may differ only where bf16 logits tie; compare by what they pick
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    picked = torch.softmax(logits.float(), -1).gather(1, ids.long())
    ref_picked = torch.softmax(logits.float(), -1).gather(1, ref_ids.long())
    torch.testing.assert_close(picked, ref_picked)
    assert ids.dtype == torch.int32 and (ids.sort(-1).values.diff(dim=-1) > 0).all()


def test_strided_rows_ties_and_no_tokens(device):
    logits = torch.zeros(2, 24, device=device)[:, :12]  # all tie; rows 24 apart
    logits[1, 7] = 1.0
    weights, ids = topk_softmax(logits, 3, renormalize=False)
    assert ids.tolist() == [[0, 1, 2], [7, 0, 1]]  # ties: lower expert ids first
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 12, device=device))
    empty_w, empty_ids = topk_softmax(logits[:0], 3, True)
    assert empty_w.shape == empty_ids.shape == (0, 3)
    with pytest.raises(ValueError, match=r"topk in 1\.\.12"):
        topk_softmax(logits, 13, True)


def test_a_nan_row_still_routes_to_valid_experts(device):
    logits = torch.randn(3, 60, device=device)
    logits[1, 5] = float("nan")
    _, ids = topk_softmax(logits, 4, renormalize=True)
    assert ((ids >= 0) & (ids < 60)).all()
    torch.testing.assert_close(ids[[0, 2]], topk_softmax(logits[[0, 2]], 4, True)[1])
