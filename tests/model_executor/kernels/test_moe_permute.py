"""Kernel tests for MoE permute / unpermute against the PyTorch references.

On CPU the kernels run under the Triton interpreter (set in tests/conftest.py),
so CPU sizes are tiny; GPU-size cases are marked ``gpu``.
"""

import pytest
import torch

from vllm.model_executor.kernels import moe_permute as mp

POISON_INT = -7


def make_topk_ids(
    num_tokens: int,
    topk: int,
    n_expert: int,
    device: torch.device,
    dtype: torch.dtype = torch.int32,
    invalid_fraction: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """Distinct experts per token (as a router gives), with a fraction of ids
    replaced by invalid ones (-1, n_expert, and for int64 a huge id)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, n_expert, generator=gen)
    ids = scores.topk(min(topk, n_expert), dim=1).indices
    if ids.shape[1] < topk:  # more slots than experts: repeats are allowed
        ids = torch.randint(0, n_expert, (num_tokens, topk), generator=gen)
    invalid = torch.rand(num_tokens, topk, generator=gen) < invalid_fraction
    bad_values = [-1, n_expert, n_expert + 5] + (
        [2**40] if dtype == torch.int64 else []
    )
    bad = torch.tensor(bad_values)[
        torch.randint(0, len(bad_values), (num_tokens, topk), generator=gen)
    ]
    return torch.where(invalid, bad, ids).to(dtype).to(device)


def make_expert_map(
    n_expert: int, ep_size: int, device: torch.device, seed: int = 0
) -> torch.Tensor | None:
    """A random subset of n_expert / ep_size experts mapped to local ids in a
    random order; None for ep_size 1."""
    if ep_size == 1:
        return None
    gen = torch.Generator().manual_seed(seed)
    n_local = n_expert // ep_size
    expert_map = torch.full((n_expert,), -1, dtype=torch.int32)
    chosen = torch.randperm(n_expert, generator=gen)[:n_local]
    expert_map[chosen] = torch.randperm(n_local, generator=gen).int()
    return expert_map.to(device)


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
        (mp.sort_workspace_numel(num_routes, n_local),),
        POISON_INT,
        dtype=torch.int32,
        device=dev,
    )
    mp.route_sort(
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
    ref_inv, ref_perm, ref_offsets = mp.route_sort_reference(
        topk_ids, expert_map, n_expert, n_local
    )
    torch.testing.assert_close(offsets, ref_offsets, rtol=0, atol=0)
    torch.testing.assert_close(inv, ref_inv, rtol=0, atol=0)
    torch.testing.assert_close(perm, ref_perm, rtol=0, atol=0)


def test_route_sort_reference_semantics() -> None:
    # Local ids: expert 2 -> 0, expert 3 -> 1; everything else is invalid.
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    topk_ids = torch.tensor([[3, 2], [-1, 3], [2, 9], [0, 2]], dtype=torch.int32)
    inv, perm, offsets = mp.route_sort_reference(topk_ids, expert_map, 4, 2)
    # Routes by bucket: local 0 = {1, 4, 7}, local 1 = {0, 3}, invalid = {2, 5, 6}.
    assert perm.tolist() == [1, 4, 7, 0, 3, 2, 5, 6]
    assert offsets.tolist() == [0, 3, 5]
    assert inv[perm.long()].tolist() == list(range(8))


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
        (triton_cdiv(num_routes, block) * mp._num_count_columns(n_local),),
        POISON_INT,
        dtype=torch.int32,
        device=device,
    )
    mp._route_sort_blocked(
        topk_ids, expert_map, n_expert, n_local, inv, perm, offsets, workspace, block
    )
    ref_inv, ref_perm, ref_offsets = mp.route_sort_reference(
        topk_ids, expert_map, n_expert, n_local
    )
    assert torch.equal(offsets, ref_offsets)
    assert torch.equal(inv, ref_inv)
    assert torch.equal(perm, ref_perm)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_route_sort_public_blocked_dispatch(device: torch.device) -> None:
    # Just past the single-program limit: the public entry uses the workspace.
    num_tokens = mp._SINGLE_PROGRAM_MAX_ROUTES // 8 + 1
    assert mp.sort_workspace_numel(num_tokens * 8, 4) > 0
    topk_ids = make_topk_ids(num_tokens, 8, 16, device, invalid_fraction=0.1)
    check_route_sort(topk_ids, make_expert_map(16, 4, device), 16, 4)


def test_sort_workspace_numel_monotonic() -> None:
    for n_local in (1, 16, 64, 256):
        sizes = [mp.sort_workspace_numel(r, n_local) for r in range(0, 300_000, 97)]
        assert sizes == sorted(sizes)
        for r in range(0, 300_000, 997):
            block = mp._sort_block(r)
            if r > mp._SINGLE_PROGRAM_MAX_ROUTES:
                need = triton_cdiv(r, block) * mp._num_count_columns(n_local)
                assert mp.sort_workspace_numel(r, n_local) >= need


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """0x7f in every byte: NaN for the float types, a huge value for ints."""
    return torch.empty_like(t).view(torch.uint8).fill_(0x7F).view(t.dtype)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(mp._SAME_SIZE_INT[t.element_size()])


def random_rows(
    num_tokens: int, hidden: int, dtype: torch.dtype, device
) -> torch.Tensor:
    x = torch.randn(num_tokens, hidden, device=device) * 3 + 0.5
    return x.to(dtype)


ROW_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def check_permute(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local: int,
    scale: torch.Tensor | None,
) -> None:
    num_tokens, hidden = hidden_states.shape
    topk = topk_ids.shape[1]
    inv, _, offsets = mp.route_sort_reference(topk_ids, expert_map, n_expert, n_local)
    num_routes = num_tokens * topk
    out = poison_like(
        torch.empty(
            num_routes + 2, hidden, dtype=hidden_states.dtype, device=inv.device
        )
    )
    out_scale = None
    if scale is not None:
        out_scale = torch.full(
            (num_routes + 2, scale.shape[1]), float("nan"), device=scale.device
        )
    mp.permute_rows(hidden_states, inv, topk, offsets, out, scale, out_scale)
    ref, ref_scale = mp.permute_rows_reference(hidden_states, inv, topk, offsets, scale)
    num_valid = int(offsets[-1])
    assert torch.equal(as_bits(out[:num_valid]), as_bits(ref[:num_valid]))
    # Destinations of invalid routes (and rows past R) are never written.
    assert torch.equal(as_bits(out[num_valid:]), as_bits(poison_like(out[num_valid:])))
    if scale is not None:
        assert out_scale is not None and ref_scale is not None
        assert torch.equal(out_scale[:num_valid], ref_scale[:num_valid])
        assert out_scale[num_valid:].isnan().all()


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("groups", [0, 1, 4])
def test_permute_rows(device: torch.device, dtype: torch.dtype, groups: int) -> None:
    num_tokens, topk, n_expert, hidden = 33, 6, 16, 64
    hidden_states = random_rows(num_tokens, hidden, dtype, device)
    scale = torch.rand(num_tokens, groups, device=device) + 0.1 if groups else None
    topk_ids = make_topk_ids(num_tokens, topk, n_expert, device, invalid_fraction=0.2)
    check_permute(
        hidden_states,
        topk_ids,
        make_expert_map(n_expert, 4, device),
        n_expert,
        4,
        scale,
    )


@pytest.mark.parametrize(
    ("num_tokens", "topk", "hidden", "ep_size"),
    [(1, 1, 16, 1), (1, 8, 40, 16), (7, 2, 24, 1), (5, 8, 2, 4), (3, 6, 7, 1)],
)
def test_permute_rows_shapes(
    device: torch.device, num_tokens: int, topk: int, hidden: int, ep_size: int
) -> None:
    # Odd and tiny hidden sizes (rows that are not whole int32 words included).
    n_expert = 16
    hidden_states = random_rows(num_tokens, hidden, torch.bfloat16, device)
    topk_ids = make_topk_ids(num_tokens, topk, n_expert, device, invalid_fraction=0.2)
    check_permute(
        hidden_states,
        topk_ids,
        make_expert_map(n_expert, ep_size, device),
        n_expert,
        n_expert // ep_size,
        torch.rand(num_tokens, 1, device=device),
    )


def test_permute_rows_strided_input(device: torch.device) -> None:
    # A row stride larger than H (a column slice of a wider tensor).
    wide = random_rows(9, 48, torch.bfloat16, device)
    topk_ids = make_topk_ids(9, 2, 8, device)
    check_permute(wide[:, :32], topk_ids, None, 8, 8, None)


def check_unpermute(
    num_tokens: int,
    topk: int,
    hidden: int,
    ep_size: int,
    out_dtype: torch.dtype,
    use_offsets: bool,
    device: torch.device,
    invalid_fraction: float = 0.2,
) -> None:
    n_expert = 16
    expert_map = make_expert_map(n_expert, ep_size, device)
    topk_ids = make_topk_ids(
        num_tokens, topk, n_expert, device, invalid_fraction=invalid_fraction
    )
    inv, _, offsets = mp.route_sort_reference(
        topk_ids, expert_map, n_expert, n_expert // ep_size
    )
    num_routes = num_tokens * topk
    permuted = random_rows(num_routes, hidden, out_dtype, device)
    if use_offsets:
        # Rows of skipped routes hold garbage: it must never reach the output.
        invalid_rows = torch.arange(num_routes, device=device) >= offsets[-1]
        permuted[invalid_rows] = float("nan")
    weights = torch.rand(num_tokens, topk, device=device) + 0.05
    out = torch.full((num_tokens, hidden), float("nan"), dtype=out_dtype, device=device)
    offsets_arg = offsets if use_offsets else None
    mp.unpermute_rows(out, permuted, weights, inv, offsets_arg)
    ref = mp.unpermute_rows_reference(permuted, weights, inv, offsets_arg)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("use_offsets", [True, False])
@pytest.mark.parametrize("topk", [1, 8])
def test_unpermute_rows(
    device: torch.device, out_dtype: torch.dtype, use_offsets: bool, topk: int
) -> None:
    check_unpermute(
        21, topk, 40, 4 if use_offsets else 1, out_dtype, use_offsets, device
    )


@pytest.mark.parametrize(("num_tokens", "topk", "hidden"), [(1, 2, 64), (7, 6, 3)])
def test_unpermute_rows_shapes(
    device: torch.device, num_tokens: int, topk: int, hidden: int
) -> None:
    check_unpermute(num_tokens, topk, hidden, 16, torch.bfloat16, True, device)


def test_unpermute_rows_no_valid_route_gives_zeros(device: torch.device) -> None:
    check_unpermute(6, 2, 16, 16, torch.float32, True, device, invalid_fraction=1.0)


def test_zero_tokens(device: torch.device) -> None:
    topk_ids = torch.empty(0, 8, dtype=torch.int32, device=device)
    inv, _, offsets = run_route_sort(topk_ids, None, 16, 16)
    assert inv.numel() == 0 and offsets.tolist() == [0] * 17
    hidden_states = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    out = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    mp.permute_rows(hidden_states, inv, 8, offsets, out)
    weights = torch.empty(0, 8, device=device)
    mp.unpermute_rows(out, out, weights, inv, offsets)


def test_launchers_reject_bad_arguments(device: torch.device) -> None:
    topk_ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    inv = torch.empty(8, dtype=torch.int32, device=device)
    offsets = torch.empty(5, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="topk_ids"):
        mp.route_sort(topk_ids.float(), None, 4, 4, inv, inv, offsets, empty)
    with pytest.raises(ValueError, match="permuted_idx"):
        mp.route_sort(topk_ids, None, 4, 4, inv, inv[:7], offsets, empty)
    with pytest.raises(ValueError, match="expert_first_token_offset"):
        mp.route_sort(topk_ids, None, 4, 4, inv, inv, offsets[:4], empty)
    hidden_states = torch.zeros(4, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="out"):
        mp.permute_rows(hidden_states, inv, 2, offsets, hidden_states)
    with pytest.raises(ValueError, match="out_scale"):
        scale = torch.ones(4, 1, device=device)
        out = torch.empty(8, 16, dtype=torch.bfloat16, device=device)
        mp.permute_rows(hidden_states, inv, 2, offsets, out, scale, None)
    with pytest.raises(ValueError, match="topk_weights"):
        weights = torch.ones(3, 2, device=device)
        mp.unpermute_rows(hidden_states, out, weights, inv, offsets)


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 5000])
@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_permute_unpermute_gpu(
    num_tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    device = torch.device("cuda")
    topk_ids = make_topk_ids(num_tokens, 8, 256, device, invalid_fraction=0.05)
    scale = torch.rand(num_tokens, hidden // 128, device=device)
    hidden_states = random_rows(num_tokens, hidden, dtype, device)
    check_permute(
        hidden_states, topk_ids, make_expert_map(256, 4, device), 256, 64, scale
    )
    check_unpermute(num_tokens, 8, hidden, 4, torch.bfloat16, True, device)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_cuda_graph_replay(num_tokens: int) -> None:
    # Both sort paths (single program, count + scatter) under replay.
    device = torch.device("cuda")
    topk, n_expert, n_local, hidden = 8, 64, 16, 512
    num_routes = num_tokens * topk
    expert_map = make_expert_map(n_expert, n_expert // n_local, device)
    topk_ids = make_topk_ids(num_tokens, topk, n_expert, device)
    hidden_states = random_rows(num_tokens, hidden, torch.bfloat16, device)
    weights = torch.rand(num_tokens, topk, device=device)
    inv = torch.empty(num_routes, dtype=torch.int32, device=device)
    perm = torch.empty_like(inv)
    offsets = torch.empty(n_local + 1, dtype=torch.int64, device=device)
    workspace = torch.empty(
        mp.sort_workspace_numel(num_routes, n_local), dtype=torch.int32, device=device
    )
    permuted = torch.empty(num_routes, hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    def step() -> None:
        mp.route_sort(
            topk_ids, expert_map, n_expert, n_local, inv, perm, offsets, workspace
        )
        mp.permute_rows(hidden_states, inv, topk, offsets, permuted)
        mp.unpermute_rows(out, permuted, weights, inv, offsets)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile and warm up on the capture stream
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for seed in range(1, 4):
        topk_ids.copy_(
            make_topk_ids(
                num_tokens, topk, n_expert, device, invalid_fraction=0.1, seed=seed
            )
        )
        hidden_states.copy_(random_rows(num_tokens, hidden, torch.bfloat16, device))
        weights.copy_(torch.rand(num_tokens, topk, device=device))
        permuted.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_inv, ref_perm, ref_offsets = mp.route_sort_reference(
            topk_ids, expert_map, n_expert, n_local
        )
        assert torch.equal(inv, ref_inv) and torch.equal(perm, ref_perm)
        assert torch.equal(offsets, ref_offsets)
        ref_rows, _ = mp.permute_rows_reference(hidden_states, inv, topk, offsets)
        num_valid = int(offsets[-1])
        assert torch.equal(permuted[:num_valid], ref_rows[:num_valid])
        ref_out = mp.unpermute_rows_reference(permuted, weights, inv, offsets)
        torch.testing.assert_close(out, ref_out, rtol=8e-3, atol=8e-3)
