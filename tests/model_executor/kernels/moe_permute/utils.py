"""Routing and row inputs shared by the MoE permute kernel tests."""

import torch

# Written into index buffers before a launch: entries a kernel must not touch
# keep it.
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


def random_rows(
    num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    x = torch.randn(num_tokens, hidden, device=device) * 3 + 0.5
    return x.to(dtype)
