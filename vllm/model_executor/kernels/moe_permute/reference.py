"""Plain-PyTorch references of the MoE permute kernels.

Same semantics as :mod:`.sort` and :mod:`.rows`, written for clarity rather
than speed: the CPU path of the layer ops and the oracle of the kernel tests.
They allocate their results and may synchronise with the host.
"""

import torch

from vllm.model_executor.kernels.moe_permute.rows import _SAME_SIZE_INT


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
