"""The plain-PyTorch references on hand-computed cases: the kernel tests
compare the kernels with these, so their semantics are pinned here."""

import torch

from vllm.model_executor.kernels.moe_permute import reference


def test_route_sort_reference_semantics() -> None:
    # Local ids: expert 2 -> 0, expert 3 -> 1; everything else is invalid.
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    topk_ids = torch.tensor([[3, 2], [-1, 3], [2, 9], [0, 2]], dtype=torch.int32)
    inv, perm, offsets = reference.route_sort_reference(topk_ids, expert_map, 4, 2)
    # Routes by bucket: local 0 = {1, 4, 7}, local 1 = {0, 3}, invalid = {2, 5, 6}.
    assert perm.tolist() == [1, 4, 7, 0, 3, 2, 5, 6]
    assert offsets.tolist() == [0, 3, 5]
    assert inv[perm.long()].tolist() == list(range(8))


def test_permute_rows_reference_semantics() -> None:
    # Two tokens, top-2: routes 0..3 go to destinations 2, 0, 3, 1, and only
    # destinations below offsets[-1] = 3 are valid.
    hidden_states = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(torch.float8_e4m3fn)
    inv = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 3], dtype=torch.int64)
    scale = torch.tensor([[0.5], [0.25]])
    rows, scales = reference.permute_rows_reference(
        hidden_states, inv, 2, offsets, scale
    )
    assert rows.dtype == torch.float8_e4m3fn
    assert rows.float().tolist() == [[1, 2], [3, 4], [1, 2], [0, 0]]
    assert scales is not None and scales.tolist() == [[0.5], [0.25], [0.5], [0.0]]
    _, no_scales = reference.permute_rows_reference(hidden_states, inv, 2, offsets)
    assert no_scales is None


def test_unpermute_rows_reference_semantics() -> None:
    # Row 2 is past offsets[-1] = 2: its NaNs must not reach the output.
    permuted = torch.tensor([[1.0, 1.0], [2.0, 2.0], [float("nan")] * 2])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    inv = torch.tensor([0, 2, 1, 0], dtype=torch.int32)
    offsets = torch.tensor([0, 2], dtype=torch.int64)
    out = reference.unpermute_rows_reference(
        permuted, weights, inv, offsets, out_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [[0.5, 0.5], [4.0, 4.0]]
    # Without offsets every route counts, the NaN row included.
    every_route = reference.unpermute_rows_reference(permuted, weights, inv)
    assert every_route.dtype == torch.float32
    assert every_route[0].isnan().all() and every_route[1].tolist() == [4.0, 4.0]
