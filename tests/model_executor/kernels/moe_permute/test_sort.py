"""Tests of the route sort kernels against the PyTorch reference.

On CPU the kernels run under the Triton interpreter (set in tests/conftest.py),
so CPU sizes are tiny; GPU-size cases are marked ``gpu``.
"""

import pytest
import torch

from tests.model_executor.kernels.moe_permute.utils import (
    POISON_INT,
    make_expert_map,
    make_topk_ids,
)
from vllm.model_executor.kernels.moe_permute import reference, sort


def run_route_sort(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_sort into poisoned buffers a little larger than needed."""
    dev = topk_ids.device
    num_routes = topk_ids.numel()
    inv = torch.full((num_routes + 3,), POISON_INT, dtype=torch.int32, device=dev)
    perm = torch.full((num_routes + 3,), POISON_INT, dtype=torch.int32, device=dev)
    offsets = torch.full((n_local + 1,), POISON_INT, dtype=torch.int64, device=dev)
    workspace = torch.full(
        (sort.sort_workspace_numel(num_routes, n_local),),
        POISON_INT,
        dtype=torch.int32,
        device=dev,
    )
    sort.route_sort(
        topk_ids, expert_map, n_expert, n_local, inv, perm, offsets, workspace
    )
    assert (inv[num_routes:] == POISON_INT).all()
    assert (perm[num_routes:] == POISON_INT).all()
    return inv[:num_routes], perm[:num_routes], offsets


def check_route_sort(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local: int,
) -> None:
    inv, perm, offsets = run_route_sort(topk_ids, expert_map, n_expert, n_local)
    ref_inv, ref_perm, ref_offsets = reference.route_sort_reference(
        topk_ids, expert_map, n_expert, n_local
    )
    torch.testing.assert_close(offsets, ref_offsets, rtol=0, atol=0)
    torch.testing.assert_close(inv, ref_inv, rtol=0, atol=0)
    torch.testing.assert_close(perm, ref_perm, rtol=0, atol=0)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("topk", [1, 2, 6, 8])
@pytest.mark.parametrize("ep_size", [1, 4, 16])
def test_route_sort(device: torch.device, topk: int, ep_size: int) -> None:
    n_expert = 16
    expert_map = make_expert_map(n_expert, ep_size, device, seed=topk)
    topk_ids = make_topk_ids(
        33, topk, n_expert, device, invalid_fraction=0.2, seed=ep_size
    )
    check_route_sort(topk_ids, expert_map, n_expert, n_expert // ep_size)


@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_sort_edge_sizes(
    device: torch.device, num_tokens: int, dtype: torch.dtype
) -> None:
    n_expert = 16
    expert_map = make_expert_map(n_expert, 4, device)
    topk_ids = make_topk_ids(
        num_tokens, 6, n_expert, device, dtype, invalid_fraction=0.3, seed=num_tokens
    )
    check_route_sort(topk_ids, expert_map, n_expert, 4)
    check_route_sort(topk_ids, None, n_expert, n_expert)


def test_route_sort_zero_tokens_zeroes_offsets(device: torch.device) -> None:
    topk_ids = torch.empty(0, 8, dtype=torch.int32, device=device)
    inv, _, offsets = run_route_sort(topk_ids, None, 16, 16)
    assert inv.numel() == 0 and offsets.tolist() == [0] * 17


def test_route_sort_all_invalid(device: torch.device) -> None:
    topk_ids = torch.full((5, 2), -1, dtype=torch.int32, device=device)
    check_route_sort(topk_ids, None, 8, 8)
    expert_map = torch.full((8,), -1, dtype=torch.int32, device=device)
    check_route_sort(torch.randint(0, 8, (5, 2), device=device), expert_map, 8, 2)


def test_route_sort_map_values_beyond_local(device: torch.device) -> None:
    # Map entries >= n_local_expert are treated as invalid, never as buckets.
    expert_map = torch.tensor([0, 5, 1, -3], dtype=torch.int32, device=device)
    topk_ids = torch.randint(0, 4, (9, 3), dtype=torch.int32, device=device)
    check_route_sort(topk_ids, expert_map, 4, 2)


@pytest.mark.parametrize(
    ("num_tokens", "n_local"), [(37, 16), (37, 6), (32, 4), (9, 1)]
)
def test_route_sort_blocked_path(
    device: torch.device, num_tokens: int, n_local: int
) -> None:
    # Small blocks drive the two-launch path (count, then scatter) at a size
    # the interpreter handles quickly: partial and full last blocks, local
    # expert counts that are not powers of two.
    n_expert = 16
    gen = torch.Generator().manual_seed(n_local)
    expert_map = None
    if n_local < n_expert:
        expert_map = torch.full((n_expert,), -1, dtype=torch.int32)
        chosen = torch.randperm(n_expert, generator=gen)[:n_local]
        expert_map[chosen] = torch.arange(n_local, dtype=torch.int32)
        expert_map = expert_map.to(device)
    topk_ids = make_topk_ids(num_tokens, 8, n_expert, device, invalid_fraction=0.2)
    num_routes = topk_ids.numel()
    inv = torch.full((num_routes,), POISON_INT, dtype=torch.int32, device=device)
    perm = torch.full_like(inv, POISON_INT)
    offsets = torch.full((n_local + 1,), POISON_INT, dtype=torch.int64, device=device)
    block = 64
    workspace = torch.full(
        (triton_cdiv(num_routes, block) * sort._num_count_columns(n_local),),
        POISON_INT,
        dtype=torch.int32,
        device=device,
    )
    sort._route_sort_blocked(
        topk_ids, expert_map, n_expert, n_local, inv, perm, offsets, workspace, block
    )
    ref_inv, ref_perm, ref_offsets = reference.route_sort_reference(
        topk_ids, expert_map, n_expert, n_local
    )
    assert torch.equal(offsets, ref_offsets)
    assert torch.equal(inv, ref_inv)
    assert torch.equal(perm, ref_perm)


def test_route_sort_public_blocked_dispatch(device: torch.device) -> None:
    # Just past the single-program limit: the public entry uses the workspace.
    num_tokens = sort._SINGLE_PROGRAM_MAX_ROUTES // 8 + 1
    assert sort.sort_workspace_numel(num_tokens * 8, 4) > 0
    topk_ids = make_topk_ids(num_tokens, 8, 16, device, invalid_fraction=0.1)
    check_route_sort(topk_ids, make_expert_map(16, 4, device), 16, 4)


def test_sort_workspace_numel_monotonic() -> None:
    for n_local in (1, 16, 64, 256):
        sizes = [sort.sort_workspace_numel(r, n_local) for r in range(0, 300_000, 97)]
        assert sizes == sorted(sizes)
        for r in range(0, 300_000, 997):
            block = sort._sort_block(r)
            if r > sort._SINGLE_PROGRAM_MAX_ROUTES:
                need = triton_cdiv(r, block) * sort._num_count_columns(n_local)
                assert sort.sort_workspace_numel(r, n_local) >= need


def test_route_sort_rejects_bad_arguments(device: torch.device) -> None:
    topk_ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    inv = torch.empty(8, dtype=torch.int32, device=device)
    offsets = torch.empty(5, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="topk_ids"):
        sort.route_sort(topk_ids.float(), None, 4, 4, inv, inv, offsets, empty)
    with pytest.raises(ValueError, match="permuted_idx"):
        sort.route_sort(topk_ids, None, 4, 4, inv, inv[:7], offsets, empty)
    with pytest.raises(ValueError, match="expert_first_token_offset"):
        sort.route_sort(topk_ids, None, 4, 4, inv, inv, offsets[:4], empty)


# --- GPU sizes -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 129, 1024, 5000, 16384])
@pytest.mark.parametrize(("n_expert", "ep_size"), [(16, 1), (64, 4), (256, 1)])
def test_route_sort_gpu(num_tokens: int, n_expert: int, ep_size: int) -> None:
    device = torch.device("cuda")
    topk_ids = make_topk_ids(
        num_tokens, 8, n_expert, device, torch.int64, invalid_fraction=0.05
    )
    expert_map = make_expert_map(n_expert, ep_size, device)
    check_route_sort(topk_ids, expert_map, n_expert, n_expert // ep_size)
