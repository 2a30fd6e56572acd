"""Tests of the row permute / unpermute kernels against the PyTorch references.

On CPU the kernels run under the Triton interpreter (set in tests/conftest.py),
so CPU sizes are tiny; GPU-size cases are marked ``gpu``.
"""

import pytest
import torch

from tests.model_executor.kernels.moe_permute.utils import (
    make_expert_map,
    make_topk_ids,
    random_rows,
)
from vllm.model_executor.kernels.moe_permute import reference, rows, sort

ROW_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """0x7f in every byte: NaN for the float types, a huge value for ints."""
    return torch.empty_like(t).view(torch.uint8).fill_(0x7F).view(t.dtype)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(rows._SAME_SIZE_INT[t.element_size()])


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
    inv, _, offsets = reference.route_sort_reference(
        topk_ids, expert_map, n_expert, n_local
    )
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
    rows.permute_rows(hidden_states, inv, topk, offsets, out, scale, out_scale)
    ref, ref_scale = reference.permute_rows_reference(
        hidden_states, inv, topk, offsets, scale
    )
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
    inv, _, offsets = reference.route_sort_reference(
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
    rows.unpermute_rows(out, permuted, weights, inv, offsets_arg)
    ref = reference.unpermute_rows_reference(permuted, weights, inv, offsets_arg)
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


def test_rows_zero_tokens(device: torch.device) -> None:
    inv = torch.empty(0, dtype=torch.int32, device=device)
    offsets = torch.zeros(17, dtype=torch.int64, device=device)
    hidden_states = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    out = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    rows.permute_rows(hidden_states, inv, 8, offsets, out)
    weights = torch.empty(0, 8, device=device)
    rows.unpermute_rows(out, out, weights, inv, offsets)


def test_row_launchers_reject_bad_arguments(device: torch.device) -> None:
    inv = torch.empty(8, dtype=torch.int32, device=device)
    offsets = torch.empty(5, dtype=torch.int64, device=device)
    hidden_states = torch.zeros(4, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="out"):
        rows.permute_rows(hidden_states, inv, 2, offsets, hidden_states)
    scale = torch.ones(4, 1, device=device)
    out = torch.empty(8, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="out_scale"):
        rows.permute_rows(hidden_states, inv, 2, offsets, out, scale, None)
    weights = torch.ones(3, 2, device=device)
    with pytest.raises(ValueError, match="topk_weights"):
        rows.unpermute_rows(hidden_states, out, weights, inv, offsets)


# --- GPU sizes -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 5000])
@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_permute_rows_gpu(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    topk_ids = make_topk_ids(num_tokens, 8, 256, device, invalid_fraction=0.05)
    scale = torch.rand(num_tokens, hidden // 128, device=device)
    hidden_states = random_rows(num_tokens, hidden, dtype, device)
    check_permute(
        hidden_states, topk_ids, make_expert_map(256, 4, device), 256, 64, scale
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 5000])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_unpermute_rows_gpu(num_tokens: int, hidden: int) -> None:
    check_unpermute(
        num_tokens, 8, hidden, 4, torch.bfloat16, True, torch.device("cuda")
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_cuda_graph_replay(num_tokens: int) -> None:
    # Sort and row kernels together, both sort paths (single program, count +
    # scatter), under replay with new inputs.
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
        sort.sort_workspace_numel(num_routes, n_local),
        dtype=torch.int32,
        device=device,
    )
    permuted = torch.empty(num_routes, hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    def step() -> None:
        sort.route_sort(
            topk_ids, expert_map, n_expert, n_local, inv, perm, offsets, workspace
        )
        rows.permute_rows(hidden_states, inv, topk, offsets, permuted)
        rows.unpermute_rows(out, permuted, weights, inv, offsets)

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
        ref_inv, ref_perm, ref_offsets = reference.route_sort_reference(
            topk_ids, expert_map, n_expert, n_local
        )
        assert torch.equal(inv, ref_inv) and torch.equal(perm, ref_perm)
        assert torch.equal(offsets, ref_offsets)
        ref_rows, _ = reference.permute_rows_reference(
            hidden_states, inv, topk, offsets
        )
        num_valid = int(offsets[-1])
        assert torch.equal(permuted[:num_valid], ref_rows[:num_valid])
        ref_out = reference.unpermute_rows_reference(permuted, weights, inv, offsets)
        torch.testing.assert_close(out, ref_out, rtol=8e-3, atol=8e-3)
