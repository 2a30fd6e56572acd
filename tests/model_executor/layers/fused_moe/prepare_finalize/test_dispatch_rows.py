"""A token's dispatch row: packing and unpacking round-trip every field bit
for bit (activations of each dtype the schemes dispatch, with and without
scales, 0 and 1 tokens), and padding rows route nowhere."""

import pytest
import torch

from vllm.model_executor.layers.fused_moe.prepare_finalize.dispatch_rows import (
    DispatchLayout,
)


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("scale_groups", [0, 3])
def test_rows_round_trip_and_padding_routes_nowhere(num_tokens, dtype, scale_groups):
    g = torch.Generator().manual_seed(num_tokens + scale_groups)
    topk, hidden = 4, 24
    ids = torch.randint(-1, 64, (num_tokens, topk), generator=g)  # int64 in
    weights = torch.rand(num_tokens, topk, generator=g)
    a1q = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    scale = torch.rand(num_tokens, scale_groups, generator=g) if scale_groups else None
    layout = DispatchLayout.of(ids, a1q, scale)

    packed = layout.pack(ids, weights, a1q, scale)
    width = 8 * topk + hidden * a1q.element_size() + 4 * scale_groups
    assert packed.dtype == torch.uint8 and packed.shape == (num_tokens, width)
    rows = layout.unpack(torch.cat([packed, layout.padding(2, packed.device)]))

    assert rows.topk_ids.dtype == torch.int32
    assert torch.equal(rows.topk_ids[:num_tokens], ids.int())
    assert torch.equal(rows.topk_weights[:num_tokens], weights)
    assert rows.a1q.dtype == dtype
    assert torch.equal(rows.a1q[:num_tokens].view(torch.uint8), a1q.view(torch.uint8))
    if scale is None:
        assert rows.a1q_scale is None
    else:
        assert rows.a1q_scale is not None
        assert torch.equal(rows.a1q_scale[:num_tokens], scale)
    assert (rows.topk_ids[num_tokens:] == -1).all()
    assert (rows.topk_weights[num_tokens:] == 0).all()
    for t in (rows.topk_ids, rows.topk_weights, rows.a1q):
        assert t.is_contiguous() and t.shape[0] == num_tokens + 2
