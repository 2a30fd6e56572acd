"""moe_permute / moe_unpermute and the shared permute scratch.

The oracle here is written independently of the kernels' references: a
stable argsort on (bucket, route) in int64 and a float64 weighted sum.
On CPU the ops run the references; on CUDA they run the Triton kernels, also
at full model sizes (the ``gpu`` cases).
"""

import functools
import itertools
import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    MoEPermuteScratch,
    get_moe_permute_scratch,
    moe_permute,
    moe_prepare_scatter,
    moe_unpermute,
)
from vllm.v1.worker.ubatching import run_ubatches
from vllm.v1.worker.workspace import (
    WorkspaceLockedError,
    init_workspace_manager,
    reset_workspace_manager,
    use_workspace_lane,
)

POISON = -7.0


def random_routing(
    num_tokens: int, topk: int, n_expert: int, device, invalid_fraction: float = 0.0
) -> torch.Tensor:
    """Distinct experts per token (like top-k), optionally some invalid ids."""
    scores = torch.rand(num_tokens, n_expert, device=device)
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    if invalid_fraction and ids.numel():
        bad = torch.rand(ids.shape, device=device) < invalid_fraction
        choices = torch.tensor([-1, n_expert, n_expert + 5], device=device)
        pick = torch.randint(0, 3, ids.shape, device=device)
        ids = torch.where(bad, choices[pick].to(torch.int32), ids)
    return ids


def ep_expert_map(n_expert: int, ep_size: int, device) -> torch.Tensor | None:
    """The expert map of a middle EP rank, or None without EP."""
    if ep_size == 1:
        return None
    n_local = n_expert // ep_size
    rank = ep_size // 2
    expert_map = torch.full((n_expert,), -1, dtype=torch.int32)
    expert_map[rank * n_local : (rank + 1) * n_local] = torch.arange(
        n_local, dtype=torch.int32
    )
    return expert_map.to(device)


def oracle_sort(topk_ids, expert_map, n_expert, n_local):
    ids = topk_ids.flatten().long().cpu()
    rows = ids.numel()
    valid = (ids >= 0) & (ids < n_expert)
    local = ids.clone()
    if expert_map is not None:
        local[valid] = expert_map.cpu().long()[ids[valid]]
    valid &= (local >= 0) & (local < n_local)
    bucket = torch.where(valid, local, torch.full_like(local, n_local))
    order = torch.argsort(bucket * max(rows, 1) + torch.arange(rows))
    inv = torch.empty(rows, dtype=torch.long)
    inv[order] = torch.arange(rows)
    counts = torch.bincount(bucket[valid], minlength=n_local)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return inv, order, offsets


def oracle_unpermute(permuted, weights, inv, num_valid):
    num_tokens, topk = weights.shape
    gathered = permuted.cpu().double()[
        inv.view(num_tokens, topk).clamp(max=max(len(inv) - 1, 0))
    ]
    ok = (inv < num_valid).view(num_tokens, topk, 1)
    return (gathered * weights.cpu().double().unsqueeze(-1) * ok).sum(1)


def run_and_check(
    num_tokens,
    hidden,
    n_expert,
    topk,
    ep_size,
    dtype,
    device,
    use_scratch,
    invalid_fraction=0.0,
):
    n_local = n_expert // ep_size
    expert_map = ep_expert_map(n_expert, ep_size, device)
    topk_ids = random_routing(num_tokens, topk, n_expert, device, invalid_fraction)
    hidden_states = torch.randn(num_tokens, hidden, device=device).to(dtype)
    rows = num_tokens * topk
    buffer = torch.full((rows + 3, hidden), POISON, device=device).to(dtype)
    scratch = MoEPermuteScratch(n_expert, n_local, device) if use_scratch else None
    permuted, scale, offsets, inv, permuted_idx = moe_permute(
        hidden_states,
        None,
        topk_ids,
        n_expert,
        n_local,
        expert_map,
        permuted_hidden_states=buffer,
        scratch=scratch,
    )
    assert scale is None
    assert permuted.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert permuted.shape[0] == rows
    ref_inv, ref_order, ref_offsets = oracle_sort(
        topk_ids, expert_map, n_expert, n_local
    )
    assert torch.equal(inv.cpu().long(), ref_inv)
    assert torch.equal(permuted_idx.cpu().long(), ref_order)
    assert torch.equal(offsets.cpu(), ref_offsets)
    num_valid = int(ref_offsets[-1])
    expected_rows = hidden_states.cpu()[ref_order[:num_valid] // topk]
    assert torch.equal(permuted[:num_valid].cpu(), expected_rows)
    assert bool((buffer[rows:].float() == POISON).all())  # nothing past the rows

    if dtype == torch.float8_e4m3fn:
        return
    weights = torch.rand(num_tokens, topk, device=device)
    expert_out = torch.randn(rows, hidden, device=device).to(dtype)
    out = torch.full((num_tokens, hidden), POISON, device=device).to(dtype)
    moe_unpermute(out, expert_out, weights, inv, offsets)
    ref = oracle_unpermute(expert_out, weights, ref_inv, num_valid)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol * 4, rtol=tol)


# -- exactness -----------------------------------------------------------------

CPU_CASES = [
    # tokens, hidden, experts, topk, ep size, dtype
    (t, h, e, k, ep, dt)
    for (t, k, ep), (h, e, dt) in zip(
        itertools.product([0, 1, 33], [1, 2, 6, 8], [1, 4, 16]),
        itertools.cycle(
            [
                (64, 16, torch.bfloat16),
                (48, 64, torch.float16),
                (32, 256, torch.float32),
            ]
        ),
    )
]

GPU_CASES = [
    (t, h, e, k, ep, dt)
    for (t, k, ep), (h, e, dt) in zip(
        itertools.product([0, 1, 33, 1024, 5000], [1, 2, 6, 8], [1, 4, 16]),
        itertools.cycle(
            list(
                itertools.product(
                    [2048, 7168],
                    [16, 64, 256],
                    [torch.bfloat16, torch.float16, torch.float32],
                )
            )
        ),
    )
]


@pytest.mark.parametrize("use_scratch", [True, False])
@pytest.mark.parametrize("tokens,hidden,experts,topk,ep,dtype", CPU_CASES)
def test_permute_unpermute_cpu(tokens, hidden, experts, topk, ep, dtype, use_scratch):
    torch.manual_seed(tokens * 131 + topk * 7 + ep)
    run_and_check(tokens, hidden, experts, topk, ep, dtype, "cpu", use_scratch)


@pytest.mark.gpu
@pytest.mark.parametrize("use_scratch", [True, False])
@pytest.mark.parametrize("tokens,hidden,experts,topk,ep,dtype", GPU_CASES)
def test_permute_unpermute_gpu(tokens, hidden, experts, topk, ep, dtype, use_scratch):
    torch.manual_seed(tokens * 131 + topk * 7 + ep)
    run_and_check(tokens, hidden, experts, topk, ep, dtype, "cuda", use_scratch)


@pytest.mark.parametrize("ep", [1, 4])
def test_invalid_ids_excluded_and_rows_zero(device, ep):
    torch.manual_seed(ep)
    run_and_check(37, 64, 16, 4, ep, torch.float32, device, True, invalid_fraction=0.3)
    # A token whose every route is invalid gets an all-zero output row.
    ids = torch.tensor([[-1, 16], [3, 2]], dtype=torch.int32, device=device)
    hidden_states = torch.randn(2, 32, device=device)
    permuted, _, offsets, inv, _ = moe_permute(hidden_states, None, ids, 16)
    assert offsets[-1].item() == 2 and sorted(inv.tolist()[2:]) == [0, 1]
    out = torch.full((2, 32), POISON, device=device)
    weights = torch.rand(2, 2, device=device)
    moe_unpermute(out, permuted, weights, inv, offsets)
    assert bool((out[0] == 0).all())
    expected = weights[1, 0] * hidden_states[1] + weights[1, 1] * hidden_states[1]
    torch.testing.assert_close(out[1], expected)


def test_fp8_rows_move_bit_exact(device):
    torch.manual_seed(0)
    run_and_check(19, 64, 16, 2, 1, torch.float8_e4m3fn, device, True)


@pytest.mark.parametrize("groups", [1, 4])
def test_scales_move_with_rows(device, groups):
    torch.manual_seed(groups)
    ids = random_routing(21, 3, 8, device)
    hidden_states = torch.randn(21, 64, device=device)
    scale = torch.rand(21, groups, device=device)
    _, permuted_scale, _, _, order = moe_permute(hidden_states, scale, ids, 8)
    assert permuted_scale is not None and permuted_scale.shape == (63, groups)
    torch.testing.assert_close(permuted_scale, scale[order.long() // 3], rtol=0, atol=0)
    # Into a caller's buffer (a workspace view), rows past R untouched.
    buffer = torch.full((70, groups), POISON, device=device)
    _, into, *_ = moe_permute(hidden_states, scale, ids, 8, permuted_a1q_scale=buffer)
    assert into is not None and into.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(into, scale[order.long() // 3], rtol=0, atol=0)
    assert bool((buffer[63:] == POISON).all())
    with pytest.raises(ValueError, match="permuted_a1q_scale"):
        moe_permute(hidden_states, scale, ids, 8, permuted_a1q_scale=buffer[:62])
    # One token: a [1, G] scale is still per token and moves with the rows.
    _, one_scale, *_ = moe_permute(hidden_states[:1], scale[:1], ids[:1], 8)
    assert one_scale is not None and one_scale.shape == (3, groups)
    per_tensor = torch.tensor([0.5], device=device)
    _, passed, *_ = moe_permute(hidden_states, per_tensor, ids, 8)
    assert passed is per_tensor


def test_prepare_scatter_matches_permute(device):
    torch.manual_seed(3)
    ids = random_routing(40, 6, 64, device, invalid_fraction=0.1)
    expert_map = ep_expert_map(64, 4, device)
    scratch = MoEPermuteScratch(64, 16, device)
    offsets, inv = moe_prepare_scatter(ids, expert_map, scratch)
    ref_inv, _, ref_offsets = oracle_sort(ids, expert_map, 64, 16)
    assert torch.equal(inv.cpu().long(), ref_inv)
    assert torch.equal(offsets.cpu(), ref_offsets)
    assert offsets.data_ptr() == scratch.expert_first_token_offset.data_ptr()


# -- the shared scratch --------------------------------------------------------


def test_one_scratch_per_slot_for_forty_layers(device):
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_ubatches=2, num_lanes=2)
    try:

        def forty_layers():
            return {
                id(
                    get_moe_permute_scratch(
                        num_experts=256, num_local_experts=256, device=device
                    )
                )
                for _ in range(40)
            }

        def per_slot():
            with use_workspace_lane(0):
                lane0 = forty_layers()
            with use_workspace_lane(1):
                lane1 = forty_layers()
            return lane0, lane1

        (a, b), (c, d) = run_ubatches([per_slot, per_slot])
        assert all(len(s) == 1 for s in (a, b, c, d))
        assert len(a | b | c | d) == 4
        other = get_moe_permute_scratch(
            num_experts=256, num_local_experts=64, device=device
        )
        assert id(other) not in a | b | c | d
        report = manager.memory_report()
        assert len(report.resources_of_type("MoEPermuteScratch")) == 5
    finally:
        reset_workspace_manager()


def test_fresh_scratch_without_manager(device):
    reset_workspace_manager()
    first = get_moe_permute_scratch(num_experts=8, num_local_experts=8, device=device)
    second = get_moe_permute_scratch(num_experts=8, num_local_experts=8, device=device)
    assert first is not second


def test_scratch_grows_until_lock(workspace_init, device):
    scratch = get_moe_permute_scratch(
        num_experts=64, num_local_experts=64, device=device
    )

    def permute(tokens, topk):
        ids = random_routing(tokens, topk, 64, device)
        hidden_states = torch.randn(tokens, 32, device=device)
        moe_permute(hidden_states, None, ids, 64, scratch=scratch)

    permute(8, 6)
    assert scratch.capacity == 48
    permute(64, 6)
    assert scratch.capacity == 384
    permute(384, 1)
    assert scratch.capacity == 384
    workspace_init.lock()
    permute(64, 6)
    with pytest.raises(WorkspaceLockedError) as info:
        permute(65, 6)
    msg = str(info.value)
    assert isinstance(info.value, AssertionError)
    assert "Scratch growth is not allowed after locking" in msg
    assert "390" in msg and "384" in msg
    assert "ubatch=0, lane=0" in msg and "test_moe_permute_unpermute.py:" in msg


def test_scratch_holds_metadata_only(device):
    scratch = MoEPermuteScratch(256, 256, device)
    scratch.reserve(8192 * 8)
    tensors = [v for v in vars(scratch).values() if isinstance(v, torch.Tensor)]
    assert all(not t.is_floating_point() for t in tensors)
    assert scratch.nbytes() <= 4 * 2**20  # 8192 tokens x top-8 within 4 MiB


# -- bad input -----------------------------------------------------------------


def test_bad_input_is_named(device):
    cases: list[tuple[Callable[[], object], str]]
    h = torch.randn(4, 32, device=device)
    ids = random_routing(4, 2, 8, device)
    cases = [
        (lambda: moe_permute(h.long(), None, ids, 8), "hidden_states"),
        (lambda: moe_permute(h[0], None, ids, 8), "hidden_states"),
        (lambda: moe_permute(h, None, ids.float(), 8), "topk_ids"),
        (lambda: moe_permute(h, None, ids[:3], 8), "topk_ids"),
        (lambda: moe_permute(h, None, ids, 8, 9), "n_local_expert"),
        (
            lambda: moe_permute(
                h, None, ids, 8, 4, torch.zeros(7, dtype=torch.int32, device=device)
            ),
            "expert_map",
        ),
        (
            lambda: moe_permute(
                h, None, ids, 8, 4, torch.zeros(8, dtype=torch.int64, device=device)
            ),
            "expert_map",
        ),
        (
            lambda: moe_permute(
                h,
                None,
                ids,
                8,
                permuted_hidden_states=torch.empty(7, 32, device=device),
            ),
            "permuted_hidden_states",
        ),
        (
            lambda: moe_permute(
                h,
                None,
                ids,
                8,
                permuted_hidden_states=torch.empty(8, 31, device=device),
            ),
            "permuted_hidden_states",
        ),
        (
            lambda: moe_permute(
                h, None, ids, 8, scratch=MoEPermuteScratch(16, 16, device)
            ),
            "scratch",
        ),
        (lambda: moe_permute(h, torch.rand(3, 1, device=device), ids, 8), "a1q_scale"),
    ]
    out = torch.empty(4, 32, device=device)
    w = torch.rand(4, 2, device=device)
    inv = torch.zeros(8, dtype=torch.int32, device=device)
    cases += [
        (lambda: moe_unpermute(out.int(), h.repeat(2, 1), w, inv), "out"),
        (lambda: moe_unpermute(out, h, w, inv), "permuted_hidden_states"),
        (lambda: moe_unpermute(out, h.repeat(2, 1), w.double(), inv), "topk_weights"),
        (lambda: moe_unpermute(out, h.repeat(2, 1), w[:3], inv), "topk_weights"),
        (lambda: moe_unpermute(out, h.repeat(2, 1), w, inv.long()), "inv_permuted_idx"),
        (lambda: moe_unpermute(out, h.repeat(2, 1), w, inv[:7]), "inv_permuted_idx"),
    ]
    if device.type == "cuda":
        cases.append((lambda: moe_permute(h, None, ids.cpu(), 8), "topk_ids"))
    for fn, name in cases:
        with pytest.raises(ValueError, match=name):
            fn()


# -- property: roundtrip -------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 24),
    topk=st.integers(1, 4),
    n_expert=st.sampled_from([4, 8, 16]),
    ep=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(tokens, topk, n_expert, ep, seed):
    """Permute, identity experts, unpermute == weighted sum of local routes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, n_expert + 1, (tokens, topk), generator=gen).to(torch.int32)
    hidden_states = torch.randn(tokens, 16, generator=gen, dtype=torch.float64).float()
    weights = torch.rand(tokens, topk, generator=gen)
    expert_map = ep_expert_map(n_expert, ep, "cpu")
    n_local = n_expert // ep
    permuted, _, offsets, inv, _ = moe_permute(
        hidden_states, None, ids, n_expert, n_local, expert_map
    )
    out = torch.full_like(hidden_states, POISON)
    moe_unpermute(out, permuted, weights, inv, offsets)
    ids64 = ids.long()
    in_range = (ids64 >= 0) & (ids64 < n_expert)
    local = ids64.clone()
    if expert_map is not None:
        local[in_range] = expert_map.long()[ids64[in_range]]
    valid = in_range & (local >= 0)
    expected = (weights * valid).sum(1, keepdim=True) * hidden_states
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# -- CUDA graphs ---------------------------------------------------------------


class GraphedMoE:
    """permute -> per-expert scale -> unpermute captured at a fixed size."""

    def __init__(self, tokens, hidden, n_expert, topk, expert_map, stream):
        dev = "cuda"
        self.tokens, self.topk, self.n_expert = tokens, topk, n_expert
        self.n_local = n_expert if expert_map is None else int((expert_map >= 0).sum())
        self.expert_map = expert_map
        self.hidden = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        self.ids = random_routing(tokens, topk, n_expert, dev)
        self.weights = torch.rand(tokens, topk, device=dev)
        self.out = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
        self.stream = stream
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.step()  # warm-up on the capture stream
        stream.synchronize()
        with torch.cuda.graph(self.graph, stream=stream):
            self.step()

    def step(self):
        scratch = get_moe_permute_scratch(
            num_experts=self.n_expert, num_local_experts=self.n_local, device="cuda"
        )
        permuted, _, offsets, inv, _ = moe_permute(
            self.hidden,
            None,
            self.ids,
            self.n_expert,
            self.n_local,
            self.expert_map,
            scratch=scratch,
        )
        moe_unpermute(self.out, permuted, self.weights, inv, offsets)

    def replay_and_check(self, invalid_fraction=0.0):
        self.hidden.copy_(torch.randn_like(self.hidden))
        self.ids.copy_(
            random_routing(
                self.tokens, self.topk, self.n_expert, "cuda", invalid_fraction
            )
        )
        self.weights.copy_(torch.rand_like(self.weights))
        self.out.fill_(POISON)
        self.graph.replay()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        inv, _, offsets = oracle_sort(
            self.ids, self.expert_map, self.n_expert, self.n_local
        )
        num_valid = int(offsets[-1])
        permuted = torch.zeros(
            self.tokens * self.topk, self.hidden.shape[1], dtype=torch.float64
        )
        order = torch.empty_like(inv)
        order[inv] = torch.arange(len(inv))
        permuted[:num_valid] = self.hidden.cpu().double()[
            order[:num_valid] // self.topk
        ]
        ref = oracle_unpermute(permuted, self.weights, inv, num_valid)
        torch.testing.assert_close(self.out.cpu().double(), ref, atol=3e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_graphs_at_several_sizes_after_lock(workspace_init):
    stream = torch.cuda.Stream()
    expert_map = ep_expert_map(64, 4, "cuda")
    with torch.cuda.stream(stream):
        # Warm up at the largest size, then lock, then capture every size.
        GraphedMoE(128, 256, 64, 8, expert_map, stream)
    workspace_init.lock()
    graphs = {t: GraphedMoE(t, 256, 64, 8, expert_map, stream) for t in (128, 1, 33)}
    for order in ((128, 1, 33), (33, 1, 128)):
        for t in order:
            graphs[t].replay_and_check()
            graphs[t].replay_and_check(invalid_fraction=0.25)


@pytest.mark.gpu
def test_graphs_per_slot_two_ubatches_two_lanes(device):
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_ubatches=2, num_lanes=2)
    try:
        one_capture_at_a_time = threading.Lock()

        def capture(lane: int) -> GraphedMoE:
            with one_capture_at_a_time, use_workspace_lane(lane):
                return GraphedMoE(64, 128, 16, 4, None, torch.cuda.Stream())

        graphs: list[GraphedMoE] = []
        for lane in (0, 1):
            graphs += run_ubatches([functools.partial(capture, lane)] * 2)
        manager.lock()
        assert len(manager.memory_report().resources_of_type("MoEPermuteScratch")) == 4
        for _ in range(3):
            for g in graphs:
                g.replay_and_check()
    finally:
        reset_workspace_manager()
