"""Row kernels of the MoE permute: scatter token rows to their routes'
destinations and gather them back.

``permute_rows`` copies each token row (and its scale row) to the
destinations of its valid routes, as raw words, so any row dtype moves bit
exact; ``unpermute_rows`` sums a token's routes weighted by the top-k weights
in fp32. Both take the index metadata that ``route_sort`` wrote, read only
``expert_first_token_offset[-1]`` of the offsets, never allocate and never
synchronise with the host (CUDA-graph safe).
"""

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import (
    arg_error,
    check_index,
    check_rows,
)

# permute_rows: tile bytes and warps (one 16-byte vector per thread and store;
# 3.7-3.8 TB/s for every tile of 2-16 KiB at 4 or 8 warps on an H200).
_PERMUTE_TILE_BYTES = 2048
_PERMUTE_NUM_WARPS = 4
# unpermute_rows: two 16-byte vectors per thread and route (4.3-4.4 TB/s, where
# 2 KiB tiles gave 4.1-4.2).
_UNPERMUTE_TILE_BYTES = 4096
_UNPERMUTE_NUM_WARPS = 4


def _check_row_offsets(t: torch.Tensor, dev: torch.device) -> None:
    """Offsets the row kernels read (only their last entry, the valid rows)."""
    if not (
        t.dtype == torch.int64 and t.dim() == 1 and t.numel() >= 1 and t.device == dev
    ):
        raise arg_error("expert_first_token_offset", f"a 1-D int64 tensor on {dev}")


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
        raise arg_error(
            "hidden_states",
            f"a [T, H] tensor of {_ROW_DTYPES} with unit last stride, got "
            f"{hidden_states.dtype} {tuple(hidden_states.shape)}",
        )
    num_tokens, hidden = hidden_states.shape
    num_routes = num_tokens * topk
    if topk < 1:
        raise arg_error("topk", f">= 1, got {topk}")
    check_index("inv_permuted_idx", inv_permuted_idx, num_routes, dev)
    _check_row_offsets(expert_first_token_offset, dev)
    check_rows("out", out, num_routes, hidden, (hidden_states.dtype,), dev)
    if not ((scale is None) == (out_scale is None)):
        raise arg_error("out_scale", "to be given exactly when scale is given")
    num_groups = 0
    if scale is not None and out_scale is not None:
        if not (
            scale.dim() == 2
            and scale.dtype == torch.float32
            and scale.shape[0] == num_tokens
            and scale.stride(1) == 1
            and scale.device == dev
        ):
            raise arg_error(
                "scale",
                f"a [{num_tokens}, G] float32 tensor on {dev} with unit last stride, "
                f"got {scale.dtype} {tuple(scale.shape)}",
            )
        num_groups = scale.shape[1]
        check_rows(
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
        raise arg_error(
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
        raise arg_error(
            "topk_weights",
            f"a [{num_tokens}, topk] float tensor on {dev} with unit last stride, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}",
        )
    topk = topk_weights.shape[1]
    num_routes = num_tokens * topk
    check_rows(
        "permuted_hidden_states",
        permuted_hidden_states,
        num_routes,
        hidden,
        _FLOAT_DTYPES,
        dev,
    )
    check_index("inv_permuted_idx", inv_permuted_idx, num_routes, dev)
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
