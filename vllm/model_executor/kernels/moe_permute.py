"""Triton kernels for MoE token permute / unpermute.

A route is ``r = t * topk + k`` for token ``t`` and slot ``k``; there are
``R = T * topk`` routes. ``route_sort`` is a stable counting sort of the routes
by local expert (invalid routes form a last bucket), ``permute_rows`` scatters
each token row to its routes' destinations, and ``unpermute_rows`` gathers a
token's routes back and reduces them with the top-k weights in fp32.

Every launcher is allocation-free and never synchronises with the host, so the
three ops can be captured in a CUDA graph and replayed with new inputs of the
same shape. The ``*_reference`` functions are plain PyTorch with the same
semantics: the CPU path and the test oracle.
"""

import torch
import triton
import triton.language as tl

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

# permute_rows: tile bytes and warps (one 16-byte vector per thread and store;
# 3.7-3.8 TB/s for every tile of 2-16 KiB at 4 or 8 warps on an H200).
_PERMUTE_TILE_BYTES = 2048
_PERMUTE_NUM_WARPS = 4
# unpermute_rows: two 16-byte vectors per thread and route (4.3-4.4 TB/s, where
# 2 KiB tiles gave 4.1-4.2).
_UNPERMUTE_TILE_BYTES = 4096
_UNPERMUTE_NUM_WARPS = 4


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
def _route_bucket(
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
    in_range = (ids >= 0) & (ids < n_expert)
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
    bucket = _route_bucket(
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
    bucket = _route_bucket(
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
    bucket = _route_bucket(
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


def _error(name: str, expected: str) -> ValueError:
    # Messages are built only on failure: launchers check on every call.
    return ValueError(f"{name}: expected {expected}")


def _check_index(t: torch.Tensor, name: str, min_numel: int, dev: torch.device) -> None:
    if not (t.dtype == torch.int32 and t.is_contiguous() and t.numel() >= min_numel):
        raise _error(
            name,
            f"a contiguous int32 tensor with at least {min_numel} elements, got "
            f"{t.dtype} {tuple(t.shape)}",
        )
    if t.device != dev:
        raise _error(name, f"a tensor on {dev}, got {t.device}")


def _check_rows(
    name: str,
    t: torch.Tensor,
    min_rows: int,
    cols: int,
    dtypes: tuple[torch.dtype, ...],
    dev: torch.device,
) -> None:
    """A row buffer: [>= min_rows, cols] of one of ``dtypes``, unit last stride."""
    if not (
        t.dim() == 2
        and t.dtype in dtypes
        and t.shape[0] >= min_rows
        and t.shape[1] == cols
        and t.stride(1) == 1
        and t.device == dev
    ):
        raise _error(
            name,
            f"a [>= {min_rows}, {cols}] tensor of {dtypes} on {dev} with unit last "
            f"stride, got {t.dtype} {tuple(t.shape)} on {t.device}",
        )


def _check_row_offsets(t: torch.Tensor, dev: torch.device) -> None:
    """Offsets the row kernels read (only their last entry, the valid rows)."""
    if not (
        t.dtype == torch.int64 and t.dim() == 1 and t.numel() >= 1 and t.device == dev
    ):
        raise _error("expert_first_token_offset", f"a 1-D int64 tensor on {dev}")


def _check_offsets(t: torch.Tensor, name: str, n_local: int, dev: torch.device) -> None:
    if not (t.dtype == torch.int64 and t.dim() == 1 and t.numel() == n_local + 1):
        raise _error(
            name,
            f"an int64 tensor of shape [{n_local + 1}], got {t.dtype} {tuple(t.shape)}",
        )
    if t.device != dev:
        raise _error(name, f"a tensor on {dev}, got {t.device}")


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
        raise _error(
            "topk_ids",
            f"a contiguous [T, topk] int32/int64 tensor, got {topk_ids.dtype} "
            f"{tuple(topk_ids.shape)}",
        )
    if n_local_expert < 1:
        raise _error("n_local_expert", f">= 1, got {n_local_expert}")
    if n_expert < 0:
        raise _error("n_expert", f">= 0, got {n_expert}")
    if expert_map is not None:
        if not (
            expert_map.dtype == torch.int32
            and expert_map.dim() == 1
            and expert_map.is_contiguous()
            and expert_map.numel() >= n_expert
        ):
            raise _error(
                "expert_map",
                f"a contiguous int32 [n_expert={n_expert}] tensor, got "
                f"{expert_map.dtype} {tuple(expert_map.shape)}",
            )
        if expert_map.device != dev:
            raise _error("expert_map", f"a tensor on {dev}")
    num_routes = topk_ids.numel()
    _check_index(inv_permuted_idx, "inv_permuted_idx", num_routes, dev)
    _check_index(permuted_idx, "permuted_idx", num_routes, dev)
    _check_offsets(
        expert_first_token_offset, "expert_first_token_offset", n_local_expert, dev
    )
    _check_index(
        sort_workspace,
        "sort_workspace",
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


@triton.jit
def _permute_rows_kernel(
    x_ptr,
    inv_permuted_idx_ptr,
    expert_first_token_offset_ptr,
    out_ptr,
    scale_ptr,
    out_scale_ptr,
    row_numel,
    x_stride,
    out_stride,
    num_groups,
    scale_stride,
    out_scale_stride,
    n_local_expert,
    num_tiles,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # Scatter form: each (token, tile) is read once and stored to its valid
    # destinations, so the token rows are read exactly once overall.
    pid = tl.program_id(0)
    token = pid // num_tiles
    tile = pid % num_tiles
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(x_ptr + token.to(tl.int64) * x_stride + cols, mask=cols < row_numel)
    num_valid = tl.load(expert_first_token_offset_ptr + n_local_expert)
    for k in tl.static_range(TOPK):
        dest = tl.load(inv_permuted_idx_ptr + token * TOPK + k)
        # A skipped route gets an empty column range (a scalar-and-vector mask
        # would be neater, but the interpreter rejects it).
        limit = tl.where(dest < num_valid, row_numel, 0)
        tl.store(
            out_ptr + dest.to(tl.int64) * out_stride + cols,
            row,
            mask=cols < limit,
            # The permuted rows are not read back soon: keep L2 for the sources.
            eviction_policy="evict_first",
        )
    if HAS_SCALE:  # noqa: SIM102 (compile-time test outside the runtime one)
        if tile == 0:
            groups = tl.arange(0, BLOCK_G)
            s = tl.load(
                scale_ptr + token * scale_stride + groups, mask=groups < num_groups
            )
            for k in tl.static_range(TOPK):
                dest = tl.load(inv_permuted_idx_ptr + token * TOPK + k)
                limit = tl.where(dest < num_valid, num_groups, 0)
                tl.store(
                    out_scale_ptr + dest.to(tl.int64) * out_scale_stride + groups,
                    s,
                    mask=groups < limit,
                )


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """The rows as int32 words when their bytes allow it, else as a same-size
    integer type: the copy is dtype-agnostic (fp8 included) and wide words let
    Triton prove 16-byte alignment for more row sizes."""
    size = rows.element_size()
    if (
        size < 4
        and rows.shape[1] * size % 4 == 0
        and rows.stride(0) * size % 4 == 0
        and rows.storage_offset() * size % 4 == 0
    ):
        return rows.view(torch.int32)
    return rows.view(_SAME_SIZE_INT[size])


_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def permute_rows(
    hidden_states: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    topk: int,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> None:
    """out[inv_permuted_idx[t * topk + k]] = hidden_states[t] for every valid
    route (destination < expert_first_token_offset[-1]); the scale rows move
    with their rows. Destinations of invalid routes are left untouched."""
    _permute_rows_launch(
        hidden_states,
        inv_permuted_idx,
        topk,
        expert_first_token_offset,
        out,
        scale,
        out_scale,
        _PERMUTE_TILE_BYTES,
        _PERMUTE_NUM_WARPS,
    )


def _permute_rows_launch(
    hidden_states: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    topk: int,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None,
    out_scale: torch.Tensor | None,
    tile_bytes: int,
    num_warps: int,
) -> None:
    dev = hidden_states.device
    if not (
        hidden_states.dim() == 2
        and hidden_states.dtype in _ROW_DTYPES
        and hidden_states.stride(1) == 1
    ):
        raise _error(
            "hidden_states",
            f"a [T, H] tensor of {_ROW_DTYPES} with unit last stride, got "
            f"{hidden_states.dtype} {tuple(hidden_states.shape)}",
        )
    num_tokens, hidden = hidden_states.shape
    num_routes = num_tokens * topk
    if topk < 1:
        raise _error("topk", f">= 1, got {topk}")
    _check_index(inv_permuted_idx, "inv_permuted_idx", num_routes, dev)
    _check_row_offsets(expert_first_token_offset, dev)
    _check_rows("out", out, num_routes, hidden, (hidden_states.dtype,), dev)
    if not ((scale is None) == (out_scale is None)):
        raise _error("out_scale", "to be given exactly when scale is given")
    num_groups = 0
    if scale is not None and out_scale is not None:
        if not (
            scale.dim() == 2
            and scale.dtype == torch.float32
            and scale.shape[0] == num_tokens
            and scale.stride(1) == 1
            and scale.device == dev
        ):
            raise _error(
                "scale",
                f"a [{num_tokens}, G] float32 tensor on {dev} with unit last stride, "
                f"got {scale.dtype} {tuple(scale.shape)}",
            )
        num_groups = scale.shape[1]
        _check_rows(
            "out_scale", out_scale, num_routes, num_groups, (torch.float32,), dev
        )
    if num_tokens == 0 or hidden == 0:
        return
    x_words = _as_words(hidden_states)
    out_words = out.view(x_words.dtype)
    row_numel = x_words.shape[1]
    block = min(
        max(1, tile_bytes // x_words.element_size()),
        triton.next_power_of_2(row_numel),
    )
    num_tiles = triton.cdiv(row_numel, block)
    _permute_rows_kernel[(num_tokens * num_tiles,)](
        x_words,
        inv_permuted_idx,
        expert_first_token_offset,
        out_words,
        scale if scale is not None else x_words,
        out_scale if out_scale is not None else x_words,
        row_numel,
        x_words.stride(0),
        out_words.stride(0),
        num_groups,
        scale.stride(0) if scale is not None else 0,
        out_scale.stride(0) if out_scale is not None else 0,
        expert_first_token_offset.numel() - 1,
        num_tiles,
        TOPK=topk,
        BLOCK=block,
        HAS_SCALE=scale is not None,
        BLOCK_G=triton.next_power_of_2(max(num_groups, 1)),
        num_warps=num_warps,
    )


@triton.jit
def _unpermute_rows_kernel(
    out_ptr,
    permuted_ptr,
    topk_weights_ptr,
    inv_permuted_idx_ptr,
    expert_first_token_offset_ptr,
    hidden,
    out_stride,
    permuted_stride,
    weights_stride,
    n_local_expert,
    num_tiles,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
):
    pid = tl.program_id(0)
    token = pid // num_tiles
    tile = pid % num_tiles
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    if HAS_OFFSETS:
        num_valid = tl.load(expert_first_token_offset_ptr + n_local_expert)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        dest = tl.load(inv_permuted_idx_ptr + token * TOPK + k)
        weight = tl.load(topk_weights_ptr + token * weights_stride + k).to(tl.float32)
        limit = hidden
        if HAS_OFFSETS:
            # Skipped routes contribute exact zeros, whatever their rows hold.
            weight = tl.where(dest < num_valid, weight, 0.0)
            limit = tl.where(dest < num_valid, hidden, 0)
        rows = tl.load(
            permuted_ptr + dest.to(tl.int64) * permuted_stride + cols,
            mask=cols < limit,
            other=0.0,
        )
        acc += weight * rows.to(tl.float32)
    tl.store(
        out_ptr + token.to(tl.int64) * out_stride + cols,
        acc.to(out_ptr.dtype.element_ty),
        mask=cols < hidden,
    )


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unpermute_rows(
    out: torch.Tensor,
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None,
) -> None:
    """out[t] = sum_k topk_weights[t, k] * permuted[inv[t * topk + k]] in fp32,
    skipping routes with destination >= expert_first_token_offset[-1] when the
    offsets are given. Every row of ``out`` is written."""
    _unpermute_rows_launch(
        out,
        permuted_hidden_states,
        topk_weights,
        inv_permuted_idx,
        expert_first_token_offset,
        _UNPERMUTE_TILE_BYTES,
        _UNPERMUTE_NUM_WARPS,
    )


def check_unpermute_args(
    out: torch.Tensor,
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None,
) -> None:
    """The checks of :func:`unpermute_rows` (also for its CPU reference path)."""
    dev = out.device
    if not (out.dim() == 2 and out.dtype in _FLOAT_DTYPES and out.stride(1) == 1):
        raise _error(
            "out",
            f"a [T, H] tensor of {_FLOAT_DTYPES} with unit last stride, got "
            f"{out.dtype} {tuple(out.shape)}",
        )
    num_tokens, hidden = out.shape
    if not (
        topk_weights.dim() == 2
        and topk_weights.shape[0] == num_tokens
        and topk_weights.dtype in _FLOAT_DTYPES
        and topk_weights.stride(1) == 1
        and topk_weights.device == dev
    ):
        raise _error(
            "topk_weights",
            f"a [{num_tokens}, topk] float tensor on {dev} with unit last stride, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}",
        )
    topk = topk_weights.shape[1]
    num_routes = num_tokens * topk
    _check_rows(
        "permuted_hidden_states",
        permuted_hidden_states,
        num_routes,
        hidden,
        _FLOAT_DTYPES,
        dev,
    )
    _check_index(inv_permuted_idx, "inv_permuted_idx", num_routes, dev)
    if expert_first_token_offset is not None:
        _check_row_offsets(expert_first_token_offset, dev)


def _unpermute_rows_launch(
    out: torch.Tensor,
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None,
    tile_bytes: int,
    num_warps: int,
) -> None:
    check_unpermute_args(
        out,
        permuted_hidden_states,
        topk_weights,
        inv_permuted_idx,
        expert_first_token_offset,
    )
    num_tokens, hidden = out.shape
    topk = topk_weights.shape[1]
    if num_tokens == 0 or hidden == 0:
        return
    block = min(
        max(1, tile_bytes // permuted_hidden_states.element_size()),
        triton.next_power_of_2(hidden),
    )
    num_tiles = triton.cdiv(hidden, block)
    offsets = expert_first_token_offset
    _unpermute_rows_kernel[(num_tokens * num_tiles,)](
        out,
        permuted_hidden_states,
        topk_weights,
        inv_permuted_idx,
        offsets if offsets is not None else inv_permuted_idx,
        hidden,
        out.stride(0),
        permuted_hidden_states.stride(0),
        topk_weights.stride(0),
        offsets.numel() - 1 if offsets is not None else 0,
        num_tiles,
        TOPK=topk,
        BLOCK=block,
        HAS_OFFSETS=offsets is not None,
        num_warps=num_warps,
    )


def route_sort_reference(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    n_expert: int,
    n_local_expert: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inv_permuted_idx int32 [R], permuted_idx int32 [R],
    expert_first_token_offset int64 [n_local_expert + 1])."""
    ids = topk_ids.reshape(-1).long()
    in_range = (ids >= 0) & (ids < n_expert)
    if expert_map is not None:
        local = expert_map.long()[torch.where(in_range, ids, 0)]
    else:
        local = ids
    valid = in_range & (local >= 0) & (local < n_local_expert)
    bucket = torch.where(valid, local, n_local_expert)
    permuted_idx = torch.sort(bucket, stable=True).indices
    inv_permuted_idx = torch.empty_like(permuted_idx)
    inv_permuted_idx[permuted_idx] = torch.arange(
        ids.numel(), device=ids.device, dtype=permuted_idx.dtype
    )
    counts = torch.bincount(bucket, minlength=n_local_expert + 1)
    offsets = torch.zeros(n_local_expert + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts[:n_local_expert], 0)
    return inv_permuted_idx.int(), permuted_idx.int(), offsets


def permute_rows_reference(
    hidden_states: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    topk: int,
    expert_first_token_offset: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows [R, H], scales [R, G] or None): destination d holds the row (and
    scale row) of its route's token when d < offsets[-1], zeros otherwise."""
    num_routes = hidden_states.shape[0] * topk
    inv = inv_permuted_idx[:num_routes].long()
    dest = torch.arange(num_routes, device=hidden_states.device)
    permuted_idx = torch.empty_like(inv)
    permuted_idx[inv] = dest
    valid = (dest < expert_first_token_offset[-1])[:, None]
    token = permuted_idx // topk
    # Integer views keep the gather exact for every dtype, fp8 included.
    words = hidden_states.view(_SAME_SIZE_INT[hidden_states.element_size()])
    rows = torch.where(valid, words[token], 0).view(hidden_states.dtype)
    scales = None if scale is None else torch.where(valid, scale[token], 0.0)
    return rows, scales


def unpermute_rows_reference(
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[T, H] in ``out_dtype`` (default: the permuted rows' dtype), summed in
    fp32 over k in order, skipping routes with destination >= offsets[-1]."""
    num_tokens, topk = topk_weights.shape
    inv = inv_permuted_idx[: num_tokens * topk].long().view(num_tokens, topk)
    hidden = permuted_hidden_states.shape[1]
    acc = torch.zeros(
        num_tokens, hidden, dtype=torch.float32, device=permuted_hidden_states.device
    )
    for k in range(topk):
        rows = permuted_hidden_states[inv[:, k]].float()
        weight = topk_weights[:, k].float()
        if expert_first_token_offset is not None:
            valid = inv[:, k] < expert_first_token_offset[-1]
            rows = torch.where(valid[:, None], rows, 0.0)
            weight = torch.where(valid, weight, 0.0)
        acc += weight[:, None] * rows
    return acc.to(out_dtype or permuted_hidden_states.dtype)
