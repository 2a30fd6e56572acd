"""Stable counting sort of MoE routes by local expert.

A route is ``r = t * topk + k`` for token ``t`` and slot ``k``; there are
``R = T * topk`` routes. :func:`route_sort` writes, for every route, its
destination (``inv_permuted_idx``), the reverse map (``permuted_idx``) and the
per-local-expert offsets; invalid routes (id out of range, or mapped outside
the local experts) form a last bucket that the offsets exclude.

Up to ``_SINGLE_PROGRAM_MAX_ROUTES`` routes one program sorts everything;
above it a count launch and a scatter launch share the work through a
caller-sized ``sort_workspace`` (:func:`sort_workspace_numel`). No allocation
and no host sync, so the sort can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import arg_error, check_index

# At most this many routes are sorted by one program in a single launch (the
# decode path); above it a count launch and a scatter launch share the work
# (measured on an H200: at 1024 routes two launches take 5.1 us, one 8.7 us).
_SINGLE_PROGRAM_MAX_ROUTES = 512
# Block sizes of the two-launch sort: about sqrt(8 R) balances the per-block
# sort against the count-matrix reduction that every program repeats.
_MIN_SORT_BLOCK = 256
_MAX_SORT_BLOCK = 2048
# Elements of the count matrix that one step of the scatter kernel's
# reduction loads.
_COUNT_TILE = 8192


def _num_buckets_padded(n_local_expert: int) -> int:
    # Local experts plus the invalid bucket, rounded up for tl.histogram.
    return triton.next_power_of_2(n_local_expert + 1)


def _num_count_columns(n_local_expert: int) -> int:
    # The count matrix keeps local experts only; invalid counts are derived.
    return triton.next_power_of_2(n_local_expert)


def _sort_block(num_routes: int) -> int:
    block = 1 << ((8 * num_routes).bit_length() // 2)
    return min(max(block, _MIN_SORT_BLOCK), _MAX_SORT_BLOCK)


def sort_workspace_numel(num_routes: int, num_local_experts: int) -> int:
    """int32 elements of sort workspace that ``route_sort`` needs.

    Zero when one program sorts everything; otherwise a count matrix with one
    row per block of routes (at least ``_MIN_SORT_BLOCK`` routes per block).
    """
    if num_routes <= _SINGLE_PROGRAM_MAX_ROUTES:
        return 0
    return triton.cdiv(num_routes, _MIN_SORT_BLOCK) * _num_count_columns(
        num_local_experts
    )


@triton.jit
def route_bucket(
    topk_ids_ptr,
    expert_map_ptr,
    routes,
    in_bounds,
    n_expert,
    n_local_expert,
    HAS_MAP: tl.constexpr,
):
    """Local expert of each route, ``n_local_expert`` for invalid routes and
    for lanes past the end (so they sort last)."""
    ids = tl.load(topk_ids_ptr + routes, mask=in_bounds, other=-1)
    return local_expert(
        ids, in_bounds, expert_map_ptr, n_expert, n_local_expert, HAS_MAP
    )


@triton.jit
def local_expert(
    ids,
    in_bounds,
    expert_map_ptr,
    n_expert,
    n_local_expert,
    HAS_MAP: tl.constexpr,
):
    """:func:`route_bucket` of expert ids already loaded."""
    in_range = in_bounds & (ids >= 0) & (ids < n_expert)
    # The map load is masked so that an out-of-range id never indexes it.
    local = tl.load(expert_map_ptr + ids, mask=in_range, other=-1) if HAS_MAP else ids
    valid = in_range & (local >= 0) & (local < n_local_expert)
    return tl.where(valid, local, n_local_expert).to(tl.int32)


@triton.jit
def _route_sort_single_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    inv_permuted_idx_ptr,
    permuted_idx_ptr,
    expert_first_token_offset_ptr,
    num_routes,
    n_expert,
    n_local_expert,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
):
    # One program: sorting the unique keys (bucket, route) puts every route at
    # its destination directly.
    routes = tl.arange(0, BLOCK)
    bucket = route_bucket(
        topk_ids_ptr,
        expert_map_ptr,
        routes,
        routes < num_routes,
        n_expert,
        n_local_expert,
        HAS_MAP,
    )
    keys = tl.sort(bucket * BLOCK + routes)
    src = keys & (BLOCK - 1)
    dest = tl.arange(0, BLOCK)
    # Padding lanes have the largest keys, so they land at dest >= num_routes.
    in_bounds = dest < num_routes
    tl.store(permuted_idx_ptr + dest, src, mask=in_bounds)
    tl.store(inv_permuted_idx_ptr + src, dest, mask=in_bounds)

    counts = tl.histogram(bucket, NUM_BUCKETS)
    starts = tl.cumsum(counts, 0) - counts
    experts = tl.arange(0, NUM_BUCKETS)
    tl.store(
        expert_first_token_offset_ptr + experts,
        starts.to(tl.int64),
        mask=experts <= n_local_expert,
    )


@triton.jit
def _route_count_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,
    num_routes,
    n_expert,
    n_local_expert,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    NUM_COLS: tl.constexpr,
):
    # counts[block, e] = routes of this block on local expert e.
    block = tl.program_id(0)
    routes = block * BLOCK + tl.arange(0, BLOCK)
    bucket = route_bucket(
        topk_ids_ptr,
        expert_map_ptr,
        routes,
        routes < num_routes,
        n_expert,
        n_local_expert,
        HAS_MAP,
    )
    counts = tl.histogram(bucket, NUM_BUCKETS)
    buckets = tl.arange(0, NUM_BUCKETS)
    tl.store(
        counts_ptr + block * NUM_COLS + buckets, counts, mask=buckets < n_local_expert
    )


@triton.jit
def _route_scatter_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,
    inv_permuted_idx_ptr,
    permuted_idx_ptr,
    expert_first_token_offset_ptr,
    num_routes,
    num_blocks,
    n_expert,
    n_local_expert,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_COLS: tl.constexpr,
    COUNT_ROWS: tl.constexpr,
):
    block = tl.program_id(0)
    experts = tl.arange(0, NUM_COLS)
    expert_mask = experts < n_local_expert

    # Column sums of the count matrix: over all blocks and over earlier blocks.
    total = tl.zeros([NUM_COLS], dtype=tl.int32)
    earlier = tl.zeros([NUM_COLS], dtype=tl.int32)
    for first in range(0, num_blocks, COUNT_ROWS):
        rows = first + tl.arange(0, COUNT_ROWS)
        tile = tl.load(
            counts_ptr + rows[:, None] * NUM_COLS + experts[None, :],
            mask=(rows[:, None] < num_blocks) & expert_mask[None, :],
            other=0,
        )
        total += tl.sum(tile, 0)
        earlier += tl.sum(tl.where(rows[:, None] < block, tile, 0), 0)
    expert_start = tl.cumsum(total, 0) - total
    num_valid = tl.sum(total, 0)
    if block == 0:
        tl.store(
            expert_first_token_offset_ptr + experts,
            expert_start.to(tl.int64),
            mask=expert_mask,
        )
        tl.store(expert_first_token_offset_ptr + n_local_expert, num_valid.to(tl.int64))

    # Inside the block, sorting (bucket, route) gives each route its position
    # p; the route's rank in its bucket is p minus the block's count of smaller
    # buckets, and its destination adds the bucket's start and earlier blocks.
    own = tl.load(counts_ptr + block * NUM_COLS + experts, mask=expert_mask, other=0)
    shift = expert_start + earlier - (tl.cumsum(own, 0) - own)
    # Invalid routes: every earlier block is full, so its invalid count is
    # BLOCK minus its valid count.
    invalid_shift = num_valid + (block * BLOCK - tl.sum(earlier, 0)) - tl.sum(own, 0)
    local = tl.arange(0, BLOCK)
    bucket = route_bucket(
        topk_ids_ptr,
        expert_map_ptr,
        block * BLOCK + local,
        block * BLOCK + local < num_routes,
        n_expert,
        n_local_expert,
        HAS_MAP,
    )
    keys = tl.sort(bucket * BLOCK + local)
    sorted_bucket = keys // BLOCK
    src = block * BLOCK + (keys & (BLOCK - 1))
    expert_shift = tl.gather(shift, tl.minimum(sorted_bucket, NUM_COLS - 1), 0)
    dest = tl.where(sorted_bucket < n_local_expert, expert_shift, invalid_shift) + local
    # Padding lanes exist only in the last block, where they sort last.
    in_bounds = src < num_routes
    tl.store(permuted_idx_ptr + dest, src, mask=in_bounds)
    tl.store(inv_permuted_idx_ptr + src, dest, mask=in_bounds)


def _check_offsets(t: torch.Tensor, name: str, n_local: int, dev: torch.device) -> None:
    if not (t.dtype == torch.int64 and t.dim() == 1 and t.numel() == n_local + 1):
        raise arg_error(
            name,
            f"an int64 tensor of shape [{n_local + 1}], got {t.dtype} {tuple(t.shape)}",
        )
    if t.device != dev:
        raise arg_error(name, f"a tensor on {dev}, got {t.device}")


def route_sort(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local_expert: int,
    inv_permuted_idx: torch.Tensor,
    permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    sort_workspace: torch.Tensor,
) -> None:
    """Stable counting sort of the routes by local expert (invalid ones last).

    Writes ``inv_permuted_idx[:R]`` (route -> destination), ``permuted_idx[:R]``
    (destination -> route) and ``expert_first_token_offset`` (exclusive prefix
    of the per-local-expert counts; ``[-1]`` is the number of valid routes).
    """
    dev = topk_ids.device
    if not (
        topk_ids.dim() == 2
        and topk_ids.dtype in (torch.int32, torch.int64)
        and topk_ids.is_contiguous()
    ):
        raise arg_error(
            "topk_ids",
            f"a contiguous [T, topk] int32/int64 tensor, got {topk_ids.dtype} "
            f"{tuple(topk_ids.shape)}",
        )
    if n_local_expert < 1:
        raise arg_error("n_local_expert", f">= 1, got {n_local_expert}")
    if n_expert < 0:
        raise arg_error("n_expert", f">= 0, got {n_expert}")
    if expert_map is not None:
        if not (
            expert_map.dtype == torch.int32
            and expert_map.dim() == 1
            and expert_map.is_contiguous()
            and expert_map.numel() >= n_expert
        ):
            raise arg_error(
                "expert_map",
                f"a contiguous int32 [n_expert={n_expert}] tensor, got "
                f"{expert_map.dtype} {tuple(expert_map.shape)}",
            )
        if expert_map.device != dev:
            raise arg_error("expert_map", f"a tensor on {dev}")
    num_routes = topk_ids.numel()
    check_index("inv_permuted_idx", inv_permuted_idx, num_routes, dev)
    check_index("permuted_idx", permuted_idx, num_routes, dev)
    _check_offsets(
        expert_first_token_offset, "expert_first_token_offset", n_local_expert, dev
    )
    check_index(
        "sort_workspace",
        sort_workspace,
        sort_workspace_numel(num_routes, n_local_expert),
        dev,
    )
    if num_routes == 0:
        expert_first_token_offset.zero_()
    elif num_routes <= _SINGLE_PROGRAM_MAX_ROUTES:
        _route_sort_single(
            topk_ids,
            expert_map,
            n_expert,
            n_local_expert,
            inv_permuted_idx,
            permuted_idx,
            expert_first_token_offset,
        )
    else:
        _route_sort_blocked(
            topk_ids,
            expert_map,
            n_expert,
            n_local_expert,
            inv_permuted_idx,
            permuted_idx,
            expert_first_token_offset,
            sort_workspace,
            _sort_block(num_routes),
        )


def _route_sort_single(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local_expert: int,
    inv_permuted_idx: torch.Tensor,
    permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    num_warps: int | None = None,
) -> None:
    num_routes = topk_ids.numel()
    block = max(16, triton.next_power_of_2(num_routes))
    if num_warps is None:
        # One warp is a little faster for a handful of routes (1.9 vs 2.1 us).
        num_warps = 1 if block <= 32 else 4
    _route_sort_single_kernel[(1,)](
        topk_ids,
        topk_ids if expert_map is None else expert_map,
        inv_permuted_idx,
        permuted_idx,
        expert_first_token_offset,
        num_routes,
        n_expert,
        n_local_expert,
        HAS_MAP=expert_map is not None,
        BLOCK=block,
        NUM_BUCKETS=_num_buckets_padded(n_local_expert),
        num_warps=num_warps,
    )


def _route_sort_blocked(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local_expert: int,
    inv_permuted_idx: torch.Tensor,
    permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    sort_workspace: torch.Tensor,
    block: int,
    num_warps: int = 4,
) -> None:
    num_routes = topk_ids.numel()
    num_blocks = triton.cdiv(num_routes, block)
    num_cols = _num_count_columns(n_local_expert)
    # The workspace formula guarantees this; the check guards the private entry.
    assert sort_workspace.numel() >= num_blocks * num_cols
    map_arg = topk_ids if expert_map is None else expert_map
    _route_count_kernel[(num_blocks,)](
        topk_ids,
        map_arg,
        sort_workspace,
        num_routes,
        n_expert,
        n_local_expert,
        HAS_MAP=expert_map is not None,
        BLOCK=block,
        NUM_BUCKETS=_num_buckets_padded(n_local_expert),
        NUM_COLS=num_cols,
        num_warps=num_warps,
    )
    _route_scatter_kernel[(num_blocks,)](
        topk_ids,
        map_arg,
        sort_workspace,
        inv_permuted_idx,
        permuted_idx,
        expert_first_token_offset,
        num_routes,
        num_blocks,
        n_expert,
        n_local_expert,
        HAS_MAP=expert_map is not None,
        BLOCK=block,
        NUM_COLS=num_cols,
        COUNT_ROWS=max(1, _COUNT_TILE // num_cols),
        num_warps=num_warps,
    )
